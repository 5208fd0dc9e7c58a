"""Small database helpers shared by the services, and the circuit that keeps a database
known to be down from being tried on every call."""
import asyncio
import concurrent.futures
import logging
import re
import threading
import time
from typing import Callable, Optional, Protocol, TypeVar

import peewee

from models import is_postgres
from engine.errors import is_conflict

log = logging.getLogger("receiver.db")

# Errors that mean "the database cannot be reached or written", not "this data is wrong".
# The database classes (engine.connection) raise every error as DatabaseDown (one of
# these) or StatementRefused (not one of these) by its SQLSTATE or SQLite result code:
# engine.errors.is_down.
UNAVAILABLE = (peewee.OperationalError, peewee.InterfaceError)

# How often a database found down is probed again.
PROBE_INTERVAL_SECONDS = 1.0

Query = TypeVar("Query", bound=peewee.Select)


def why_unavailable(exc: BaseException) -> str:
    """The driver's message on one log line (psycopg2's runs over several)."""
    return " ".join(str(exc).split())


# What PostgreSQL (or libpq) says when DATABASE_URL names a database that is not there,
# or a role, password or client address the server refuses: settings to fix, which no
# wait mends, as opposed to a server that cannot be reached or does not answer (an
# outage, waited out on the spool). The server says it while the connection is made,
# before there is a session, and psycopg2 then gives no SQLSTATE, only the server's text:
# the text is what there is to read (in English, the servers' default lc_messages; in
# another language the refusal reads as an outage, as before).
REFUSED_SETTINGS = re.compile(
    r'database "[^"]*" does not exist'
    r'|role "[^"]*" does not exist'
    r'|role "[^"]*" is not permitted to log in'
    r'|permission denied for database'
    r'|(?:password|Ident|Peer|certificate|SCRAM) authentication failed for user'
    r'|no pg_hba\.conf entry for'
    r'|no password supplied')
# The same refusals by SQLSTATE, where a driver gives it: invalid_catalog_name,
# invalid_authorization_specification, invalid_password.
REFUSED_SETTINGS_SQLSTATES = ("3D000", "28000", "28P01")


def refused_settings(exc: BaseException) -> str | None:
    """The database server's reason on one line when `exc` says the database DATABASE_URL
    names does not exist or our credentials are refused; None for an outage."""
    said = why_unavailable(exc)
    sqlstate = getattr(getattr(exc, "orig", None), "pgcode", None)
    if sqlstate not in REFUSED_SETTINGS_SQLSTATES and not REFUSED_SETTINGS.search(said):
        return None
    # libpq puts the server's own words after "FATAL:"; the address before is ours.
    return said.split("FATAL:", 1)[-1].strip()


def locked(query: Query) -> Query:
    """`query` with FOR UPDATE on PostgreSQL; SQLite serialises writers by itself."""
    return query.for_update() if is_postgres() else query


def due_by(column: peewee.Field, moment: object) -> peewee.Expression:
    """`column <= moment`, in a form SQLite does not choose an index by (its own way of
    saying so: a unary + on the column). Without statistics SQLite takes a range of
    (status, next_attempt_at) for a claim of the due rows oldest first, reads every row
    of the range and sorts it: 21 ms for 100 of a backlog of 45,000, against 0.2 ms
    walking an index in id order (docs/PERFORMANCE.md). PostgreSQL chooses by its
    statistics, and has no unary + for a time. The moment is converted as the column's
    own values are: a bare expression would leave it to the driver."""
    if is_postgres():
        return column <= moment
    return (peewee.NodeList((peewee.SQL("+"), column), glue="")
            <= peewee.Value(moment, converter=column.db_value))


class ProbedDatabase(Protocol):
    """The database a Circuit watches (engine.connection.ServiceDatabase): it consults
    `circuit` before each statement, and `probe()` raises unless it answers and takes a
    write."""
    circuit: Optional["Circuit"]

    def probe(self) -> None: ...


class Circuit:
    """Open while the database is known to be down. The first failure opens it (whoever
    met it: a request, a scheduled job, a mail thread); from then on the database class
    raises DatabaseDown at once instead of waiting on it, so webhooks go straight to the
    spool and the loop stays free. A probe in a thread of its own (a fresh connection
    that must take a write) runs every PROBE_INTERVAL_SECONDS and closes the circuit when
    it succeeds; then the callbacks given to `when_back` run (the spool drain, so what was
    spooled is stored before anything else).

    `hold_until(work, why)` keeps it open until `work()` (the migrations of a service that
    started with its database down) has also succeeded in the probe's thread, the only
    statements let through meanwhile."""

    def __init__(self, db: ProbedDatabase, interval: float = PROBE_INTERVAL_SECONDS) -> None:
        self.db = db
        self.interval = interval
        self.reason: str | None = None
        self.opened_at = 0.0
        # When the database was last found back (time.monotonic()); made closed.
        self.closed_at = time.monotonic()
        # The service's loop, from `attach` on.
        self.loop: asyncio.AbstractEventLoop
        self.prober: asyncio.Future | None = None
        self.threads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="db-probe")
        self.on_back: list[Callable[[], object]] = []
        # What must succeed before the circuit closes, and what the operator is told
        # meanwhile (/readyz).
        self.held_by: Callable[[], object] | None = None
        self.held_for: str | None = None
        self._letting_through = threading.local()
        self._held_failure: str | None = None

    @property
    def is_open(self) -> bool:
        return self.reason is not None

    def answering_for(self) -> float:
        """Seconds the database has answered since it was last found back (or since
        the circuit was made, when it never opened); 0 while it is open."""
        return 0.0 if self.is_open else time.monotonic() - self.closed_at

    def lets_through(self) -> bool:
        """Whether this thread's statements go to the database though the circuit is open:
        the work it is held for, in the probe's thread."""
        return getattr(self._letting_through, "on", False)

    def when_back(self, callback: Callable[[], object]) -> None:
        """Call `callback()` on the loop each time a probe closes the circuit."""
        self.on_back.append(callback)

    def hold_until(self, work: Callable[[], object], why: str, failure: Exception) -> None:
        """Open the circuit for `failure` and keep it open until `work()` succeeds after
        a probe; `why` says so on /readyz."""
        self.held_by, self.held_for = work, why
        self.trip(failure)

    def attach(self) -> None:
        """From now on the database consults this circuit (call on the service's loop)."""
        self.loop = asyncio.get_running_loop()
        self.db.circuit = self

    async def detach(self) -> None:
        self.db.circuit = None
        if self.prober is not None:
            self.prober.cancel()
            await asyncio.gather(self.prober, return_exceptions=True)
        self.threads.shutdown(wait=False)

    def trip(self, failure: BaseException) -> None:
        """Called by the database class on every DatabaseDown, from any thread."""
        if self.is_open or is_conflict(failure):
            return
        self.reason = why_unavailable(failure)[:200]
        self.opened_at = time.monotonic()
        log.warning("database down (%s): calls go to the spool, probing every %g s",
                    self.reason, self.interval)
        self.loop.call_soon_threadsafe(self._start_probing)

    def _start_probing(self) -> None:
        if self.prober is None or self.prober.done():
            self.prober = asyncio.ensure_future(self._probe_until_back())

    async def _probe_until_back(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if await self.probe():
                break
        log.warning("database back after %.1f s: calls are stored again",
                    time.monotonic() - self.opened_at)
        self.closed_at = time.monotonic()
        self.reason = None
        for callback in self.on_back:
            callback()

    async def probe(self) -> bool:
        """Whether the database answers and takes writes, asked in the probe's thread."""
        try:
            await self.loop.run_in_executor(self.threads, self._probe_and_prepare)
        except Exception as exc:  # whatever the driver raises, the database is still down
            log.debug("database probe failed: %s", why_unavailable(exc))
            return False
        return True

    def _probe_and_prepare(self) -> None:
        self.db.probe()
        if self.held_by is None:
            return
        self._letting_through.on = True
        try:
            self.held_by()
        except UNAVAILABLE:
            raise
        except Exception as failure:  # the database answers, and refuses the work
            said = why_unavailable(failure)
            if said != self._held_failure:  # said once, not at every probe
                self._held_failure = said
                log.exception("the database answers, but the work the service waits for "
                              "(%s) failed; tried again at every probe", self.held_for)
            raise
        finally:
            self._letting_through.on = False
        self.held_by, self.held_for = None, None
