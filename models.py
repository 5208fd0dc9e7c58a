"""Peewee models: every table, in one module as the design card fixes (it is longer than
the others for that reason). The table and column names marked as other systems' are
relied on by them: the workflow system and the worker read and write the order tables.

One Database is chosen at start-up from DATABASE_URL by `open_database`; models are
bound to it through a proxy. Times are stored as timezone-aware UTC, money as integer
cents, coin amounts as exact decimals (every digit kept, on SQLite too).
"""
import contextlib
import datetime
import decimal
import math
import os
import select
import threading
import time
from typing import Any, Callable, Iterator

import peewee
from peewee import (
    AutoField, BigIntegerField, BooleanField, DatabaseError, DatabaseProxy, DateTimeField,
    Field, ForeignKeyField, IntegerField, InterfaceError, Model, OperationalError,
    PeeweeException, PostgresqlDatabase, SQL, SqliteDatabase, TextField,
)
from playhouse.db_url import parse
import psycopg2
import psycopg2.extensions
from playhouse.shortcuts import ReconnectMixin

database = DatabaseProxy()

UTC = datetime.timezone.utc

# Our two custom column kinds, spelled per database: PostgreSQL keeps time zones and
# arbitrary-precision numerics natively; SQLite keeps text so no digit is lost.
POSTGRES_FIELD_TYPES = {"UTCDATETIME": "TIMESTAMPTZ", "EXACTDECIMAL": "NUMERIC"}
SQLITE_FIELD_TYPES = {"UTCDATETIME": "DATETIME", "EXACTDECIMAL": "TEXT"}


def utcnow():
    return datetime.datetime.now(UTC)


class UTCDateTimeField(DateTimeField):
    """A timezone-aware UTC timestamp; naive values read from the database are UTC."""

    field_type = "UTCDATETIME"

    def db_value(self, value):
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.datetime.fromisoformat(value)
        if value.tzinfo is None:
            raise ValueError(f"{self.name}: refusing a naive datetime {value!r}")
        return value.astimezone(UTC).isoformat(sep=" ", timespec="microseconds")

    def python_value(self, value):
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.datetime.fromisoformat(value)
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class ExactDecimalField(Field):
    """A Decimal stored without rounding (NUMERIC on PostgreSQL, TEXT on SQLite)."""

    field_type = "EXACTDECIMAL"

    def db_value(self, value):
        if value is None:
            return None
        return format(decimal.Decimal(value), "f")

    def python_value(self, value):
        if value is None:
            return None
        return decimal.Decimal(str(value))


# What counts as "the database is down": the errors worth waiting out, as opposed to a
# statement the database refuses and will refuse again (a value past PostgreSQL's index
# row limit, SQLSTATE 54000, which psycopg2 raises as OperationalError). PostgreSQL's by
# SQLSTATE: connection (08), conflict (40, the group commit runs the unit again),
# insufficient resources (53: too many connections, disk full), lock timeout (55P03, a
# conflict too),
# statement timeout or shutdown (57: 57014, 57P01-57P05), system error (58), read-only
# (25006, a standby after a failover), idle session ended (25P03).
DOWN_SQLSTATE_CLASSES = ("08", "40", "53", "57", "58")
DOWN_SQLSTATES = ("55P03", "25006", "25P03")
# SQLite's by primary result code: BUSY (the busy timeout ran out), LOCKED, NOMEM,
# READONLY, IOERR, FULL, CANTOPEN, PROTOCOL.
DOWN_SQLITE_CODES = frozenset((5, 6, 7, 8, 10, 13, 14, 15))


class DatabaseDown(OperationalError):
    """The database cannot be reached or written now; the same statement may work later."""


class StatementRefused(DatabaseError):
    """The database answered and refused this statement; it would refuse it again."""


class MaintenanceCutShort(StatementRefused):
    """A statement of maintenance work (`maintenance()`: retention's deletes) that did not
    finish: timed out, or met the database down. Not an outage: it opens no circuit, and
    the maintenance tries again later; a database that really is down is found by the
    calls that need it."""


_maintenance = threading.local()
# Held before the PREPAREs of a session whose prepared statements are unknown, and
# counted among them: ClassifiedErrors.execute_prepared.
_DEALLOCATE = b"DEALLOCATE ALL"
# The writes held in this thread (ClassifiedErrors.holding_writes); only the database
# thread's turns hold any, a probe or a mail thread sends its statements as they come.
_held = threading.local()


@contextlib.contextmanager
def maintenance():
    """The statements run inside are maintenance (in the thread that runs them): a long
    prune must never be taken for the database going down and send every call to the
    spool."""
    _maintenance.active = True
    try:
        yield
    finally:
        _maintenance.active = False


# SQLSTATE class 40 (a deadlock, 40P01, or a serialization failure) and 55P03 (a lock
# waited for past lock_timeout: another process's transaction holds it, or each waits on
# the other): conflicts, which the group commit runs again; the database is up.
CONFLICT_CLASS = "40"
LOCK_NOT_AVAILABLE = "55P03"


def is_conflict(failure):
    """peewee keeps the driver's error as `orig`; psycopg2's carries the SQLSTATE."""
    driver_error = getattr(failure, "orig", None)
    sqlstate = str(getattr(driver_error, "pgcode", "") or "")
    return sqlstate.startswith(CONFLICT_CLASS) or sqlstate == LOCK_NOT_AVAILABLE


def is_down(exc):
    """Whether a driver error (as peewee raised it) means the database is unavailable.

    An error without a code from the server is the client's own (connection refused,
    reset, timed out): down. One with a code is down only if the code says so."""
    driver_error = getattr(exc, "orig", None)
    sqlstate = getattr(driver_error, "pgcode", None)
    if sqlstate:
        return sqlstate.startswith(DOWN_SQLSTATE_CLASSES) or sqlstate in DOWN_SQLSTATES
    sqlite_code = getattr(driver_error, "sqlite_errorcode", None)
    if sqlite_code is not None:
        return sqlite_code & 0xFF in DOWN_SQLITE_CODES
    return isinstance(exc, (OperationalError, InterfaceError))


class ClassifiedErrors:
    """Raises DatabaseDown or StatementRefused by `is_down`, whatever class the driver
    chose: code that waits out an outage catches OperationalError and InterfaceError
    (engine.db.UNAVAILABLE), and must never wait out a refusal, nor refuse in an outage.

    With a `circuit` (engine.db.Circuit, set by the service), a database found down is
    not tried again until the circuit's probe finds it back: every statement raises
    DatabaseDown at once, and the callers fall back as they do for a real failure.

    Held writes (`holding_writes`, PostgreSQL only): a BEGIN and the writes whose result
    nobody reads (`write_later`) wait in this thread, and go to the server in the same
    round trip as the next statement that is sent, or as the COMMIT. A held write that
    fails is raised by that statement or by the COMMIT, which the group commit takes as
    the turn failing (engine.commits).

    Statements prepared on the server (`execute_prepared`, PostgreSQL only, while holding
    writes): the server parses and plans a statement sent as text every time, which cost
    about as much as running it. A statement compiled once (engine.prepared) is PREPAREd
    on the connection with its first use there, in the same round trip, and EXECUTEd by
    name from then on. PREPARE is not undone by a rollback; a round trip that carried one
    and failed leaves unknown which ran, so the session's next PREPARE goes after a
    DEALLOCATE ALL, and the statements are prepared again as they are used."""

    circuit = None
    # Statements asked of the database by this process, BEGIN, COMMIT and ROLLBACK
    # included (/metrics' receiver_database_statements).
    statements = 0
    # Times this process waited for the server's answer (/metrics'
    # receiver_database_round_trips): the statements less those sent with another.
    round_trips = 0
    # Whether the driver sends several statements in one round trip: psycopg2 does
    # (one string, the last statement's result kept); sqlite3 runs one per call, and an
    # embedded database has no round trip to save. Statements are prepared on the server
    # only where it does: sqlite3 keeps its own cache of compiled statements.
    sends_several_at_once = False
    # Called before every statement, when set: the test suite's thread check
    # (tests/door.py) refuses one not run through the door (engine.commits).
    before_statement = None
    # Told of the model of every write peewee builds and runs (Model.save and create,
    # update, insert, delete; None for a table of no model), when set: engine.commits
    # drops the rows kept for the turn that the write may change.
    on_write: Callable[[Any], None] | None = None

    def execute(self, query, **context_options):
        if self.on_write is not None and isinstance(query, peewee._WriteQuery):
            self.on_write(getattr(query, "model", None))
        return super().execute(query, **context_options)

    def execute_sql(self, sql, params=None):
        self._asked(sql)
        with self._guarded():
            held = self._take_held()
            self.round_trips += 1
            if held:
                self._log_query(sql, params)
                return self._send_held([*held, self._text_of(sql, params)])
            return super().execute_sql(sql, params)

    def begin(self, *args, **kwargs):
        self._asked("BEGIN")
        with self._guarded():
            held = getattr(_held, "writes", None)
            if held is not None and not args and not kwargs and self._may_hold_begin():
                if self.is_closed():
                    # Now: connecting later, inside the transaction, would reset
                    # peewee's count of the transactions open.
                    self.connect()
                held.append(b"BEGIN")
                return None
            self.round_trips += 1
            return super().begin(*args, **kwargs)

    def rollback(self):
        self.statements += 1
        held = self._take_held()
        self._state.preparing = []  # held and never sent, if there were any
        if held and held[0] == b"BEGIN":
            return None  # the transaction never reached the server: nothing to undo
        self.round_trips += 1
        return super().rollback()

    def connect(self, *args, **kwargs):
        with self._guarded():
            return super().connect(*args, **kwargs)

    def commit(self):
        self.statements += 1
        held = self._take_held()
        if held == [b"BEGIN"]:
            return None  # nothing was asked in the transaction
        self.round_trips += 1
        # Not refused while the circuit is open: a transaction begun before is ended.
        with _classified(self.circuit):
            if held:
                self._send_held([*held, b"COMMIT"])
                return None
            return super().commit()

    @contextlib.contextmanager
    def holding_writes(self) -> Iterator[None]:
        """Held writes (above) for the code inside, in this thread; all are sent by the
        time it ends with a COMMIT or ROLLBACK, which the caller's transaction does."""
        if not self.sends_several_at_once:
            yield
            return
        _held.writes = []
        try:
            yield
        finally:
            _held.writes = None

    def write_later(self, sql, params=None, prepared=None):
        """`execute_sql` for a write whose cursor nobody reads: held, while holding, to
        be sent with the next statement. `prepared`: as `execute_prepared`."""
        held = getattr(_held, "writes", None)
        if held is None:
            self.execute_sql(sql, params)
            return
        self._asked(sql)
        self._log_query(sql, params)
        with self._guarded():
            if prepared is not None:
                sql, params = self._executing(prepared, held), prepared.arguments(params)
            held.append(self._text_of(sql, params))

    def rows_of_each(self, statements: list[tuple[str, list]]) -> list[tuple[list[str], list]]:
        """Each statement's (column names, rows), of statements that each return rows (a
        select, or a write with RETURNING), run as one, in the order given: each is a
        part of a WITH, and the select is one branch of a UNION ALL per part, which
        PostgreSQL runs in turn, so a part's writes and locks are all taken before the
        next part's begin. A branch holds its part's columns beside the other parts',
        NULL (an outer join to the other parts with WHERE false, which never runs them,
        gives those NULLs their columns' types); the part's `found_<n>` column, never
        NULL in its rows, tells which. One round trip where each would be one
        (engine.commits.Ahead); PostgreSQL only, as SQLite takes no write in a WITH."""
        if len(statements) == 1:
            cursor = self.execute_sql(*statements[0])
            return [([column[0] for column in cursor.description], cursor.fetchall())]
        parts = range(len(statements))

        def branch(n):
            others = " ".join(f"LEFT JOIN (SELECT 1 AS found_{other}, * FROM part_{other} "
                              f"WHERE false) AS rows_{other} ON true"
                              for other in parts if other != n)
            return (f"SELECT {', '.join(f'rows_{part}.*' for part in parts)} "
                    f"FROM (SELECT 1 AS found_{n}, * FROM part_{n}) AS rows_{n} {others}")
        sql = "".join((
            "WITH ", ", ".join(f"part_{n} AS ({statements[n][0]})" for n in parts), " ",
            " UNION ALL ".join(branch(n) for n in parts)))
        cursor = self.execute_sql(sql, [param for _, params in statements for param in params])
        names = [column[0] for column in cursor.description]
        starts = [names.index(f"found_{n}") for n in parts] + [len(names)]
        rows = cursor.fetchall()
        return [(names[starts[n] + 1:starts[n + 1]],
                 [row[starts[n] + 1:starts[n + 1]] for row in rows
                  if row[starts[n]] is not None])
                for n in parts]

    def execute_prepared(self, prepared, params):
        """`execute_sql` of a statement compiled once (engine.prepared.ServerSide): by
        name, prepared on the server with its first use on the connection, in a turn
        that holds writes on a database that sends several statements at once; as text
        otherwise."""
        held = getattr(_held, "writes", None)
        if held is None:
            return self.execute_sql(prepared.sql, params)
        self._asked(prepared.sql)
        with self._guarded():
            execute = self._text_of(self._executing(prepared, held), prepared.arguments(params))
            self.round_trips += 1
            self._log_query(prepared.sql, params)
            return self._send_held([*self._take_held(), execute])

    def _executing(self, prepared, held):
        """The EXECUTE of `prepared`, its PREPARE held before it unless the connection
        has it (or is about to). The database's own connection is open: its BEGIN is
        held or sent."""
        state = self._state
        if getattr(state, "prepared_on", None) is not state.conn:
            state.prepared_on, state.prepared, state.preparing = state.conn, set(), []
            state.deallocate = False
        if prepared.name in state.prepared or prepared.name in state.preparing:
            return prepared.execute
        if state.deallocate and _DEALLOCATE not in state.preparing:
            held.append(_DEALLOCATE)
            state.preparing.append(_DEALLOCATE)
        held.append(prepared.prepare_text(self.cursor()))
        state.preparing.append(prepared.name)
        return prepared.execute

    def _asked(self, sql):
        self.statements += 1
        if self.before_statement is not None:
            self.before_statement(sql)

    def _take_held(self):
        held = getattr(_held, "writes", None)
        if not held:
            return held
        _held.writes = []
        return held

    def _text_of(self, sql, params):
        with peewee.__exception_wrapper__:
            return self.cursor().mogrify(sql, params or ())

    def _send_held(self, statements):
        """Several statements, already bound, in one round trip: the last one's cursor."""
        state = self._state
        preparing, state.preparing = getattr(state, "preparing", []), []
        try:
            with peewee.__exception_wrapper__:
                cursor = self.cursor()
                cursor.execute(b"; ".join(statements))
        except BaseException:
            if preparing:  # which of them ran is unknown
                state.deallocate, state.prepared = True, set()
            raise
        if preparing:
            if _DEALLOCATE in preparing:
                state.deallocate = False  # `prepared` is empty since it was set
            state.prepared.update(name for name in preparing if name != _DEALLOCATE)
        return cursor

    def _may_hold_begin(self):
        return True

    @contextlib.contextmanager
    def _guarded(self):
        circuit = self.circuit
        if circuit is not None and circuit.is_open and not circuit.lets_through():
            raise DatabaseDown(f"the database is down ({circuit.reason}); not tried until "
                               "a probe finds it back")
        with _classified(circuit):
            yield


class _classified:
    """Re-raises a database error as DatabaseDown or StatementRefused; tells `circuit`
    (if any) of a DatabaseDown."""

    def __init__(self, circuit):
        self.circuit = circuit

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc is None or not isinstance(exc, PeeweeException) or isinstance(
                exc, StatementRefused) or getattr(exc, "orig", None) is None:
            return False
        if not is_down(exc):
            if not isinstance(exc, (OperationalError, InterfaceError)):
                return False
            raise StatementRefused(exc.orig, *exc.args).with_traceback(traceback) from None
        if getattr(_maintenance, "active", False) and not is_conflict(exc):
            raise MaintenanceCutShort(exc.orig, *exc.args).with_traceback(traceback) from None
        if self.circuit is not None:
            self.circuit.trip(exc)
        if isinstance(exc, DatabaseDown):
            return False
        raise DatabaseDown(exc.orig, *exc.args).with_traceback(traceback) from None


class BoundedWaits:
    """How long the service's loop may wait on the database: every wait of psycopg2's
    (connecting, a statement, a commit) goes through `wait`, which gives up after
    `seconds`. libpq's own timeouts cannot do that alone: a frozen server (a hung host, a
    partition whose packets are dropped by a proxy that still answers TCP) leaves a
    connection open and silent, and psycopg2 would block the IOLoop on it for good. On
    giving up psycopg2 closes that connection; the next statement opens a new one."""

    seconds = None

    @classmethod
    def wait(cls, conn):
        deadline = None if cls.seconds is None else time.monotonic() + cls.seconds
        while True:
            state = conn.poll()
            if state == psycopg2.extensions.POLL_OK:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise psycopg2.OperationalError(
                    f"the database did not answer within {cls.seconds:g} s")
            if state == psycopg2.extensions.POLL_READ:
                select.select([conn.fileno()], [], [], left)
            else:
                select.select([], [conn.fileno()], [], left)

    @classmethod
    def set(cls, seconds):
        cls.seconds = seconds
        psycopg2.extensions.set_wait_callback(cls.wait)

    @classmethod
    @contextlib.contextmanager
    def lifted(cls):
        seconds, cls.seconds = cls.seconds, None
        try:
            yield
        finally:
            cls.seconds = seconds


class ClassifiedSqliteDatabase(ClassifiedErrors, SqliteDatabase):
    """SQLite, its errors sorted into down and refused."""

    def probe(self):
        """Raise unless the file can be written now: a connection of its own (any thread)
        takes the write lock, within the busy timeout, and lets it go."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        finally:
            conn.close()

    @contextlib.contextmanager
    def unbounded(self):
        """Nothing to lift: the busy timeout is the only wait."""
        yield


class ReconnectingPostgresqlDatabase(ClassifiedErrors, ReconnectMixin, PostgresqlDatabase):
    """Reconnects once when PostgreSQL dropped the connection (restart, failover)."""

    sends_several_at_once = True

    # psycopg2's words for a connection that is gone (ReconnectMixin only knows MySQL's).
    reconnect_errors = (
        (OperationalError, "server closed the connection"),
        (OperationalError, "could not connect"),
        (OperationalError, "connection to server"),
        (OperationalError, "terminating connection"),
        (InterfaceError, "connection already closed"),
    )

    def begin(self, *args, **kwargs):
        # A connection psycopg2 found broken is replaced before the transaction.
        if self._connection_broken():
            self.close()
        return super().begin(*args, **kwargs)

    def rollback(self):
        if self._connection_broken():
            return None  # the server ended the transaction with the connection
        return super().rollback()

    def _may_hold_begin(self):
        """Not when the server has said something unasked since its last answer: most
        likely that it ended the session (a restart, a failover, an administrator).
        The BEGIN then goes alone, and ReconnectMixin replaces the connection if it
        fails, as it would have without held writes; held, it would fail inside the
        transaction, where a reconnect may not be made."""
        if self.is_closed():
            return True
        readable, _, _ = select.select([self._state.conn.fileno()], [], [], 0)
        return not readable

    def _connection_broken(self):
        return not self.is_closed() and bool(self._state.conn.closed)

    def session_apart(self):
        """A connection of its own (any thread), in autocommit, bounded like every other
        wait, that neither the circuit nor the held writes know of: for what must hold a
        session (scheduler.AdvisoryLock). The caller closes it."""
        return self._connect()

    def probe(self):
        """Raise unless PostgreSQL answers and takes writes: a connection of its own (any
        thread), bounded like every other wait."""
        conn = self._connect()
        try:
            cursor = conn.cursor()
            cursor.execute("SELECT pg_is_in_recovery()")
            if cursor.fetchone()[0]:
                raise psycopg2.OperationalError("the database is a standby (read-only)")
        finally:
            conn.close()

    @contextlib.contextmanager
    def unbounded(self):
        """Statements that may wait long on purpose (migrations: one process migrates,
        the others wait for its lock) run without the service's bounds. The connection is
        made within them: libpq leaves a connection made through psycopg2's wait callback
        to the callback's bound, and a server that never answers it would hold `serve`
        at its start for good, instead of being found down."""
        self.connect(reuse_if_open=True)
        with BoundedWaits.lifted():
            self.execute_sql("SET statement_timeout = 0; SET lock_timeout = 0")
            try:
                yield
            finally:
                self.execute_sql("RESET statement_timeout; RESET lock_timeout")


def sqlite_file(url):
    """The file a sqlite:/// URL names; None for PostgreSQL or an in-memory database."""
    if url.split(":", 1)[0] != "sqlite":
        return None
    path = parse(url)["database"]
    return None if path == ":memory:" else path


def open_database(url, timeout_ms=None):
    """Create the Database for `url` (sqlite:///path or postgresql://...) and bind the models.

    With `timeout_ms` (the service's DATABASE_TIMEOUT_MS), every wait on the database is
    bounded by it: on PostgreSQL the connect timeout (libpq's minimum is 2 s),
    tcp_user_timeout, TCP keepalives (a dead idle connection is found in about 4 s), the
    statement timeout and BoundedWaits, and a lock's wait by half of it (`lock_timeout_ms`);
    on SQLite the busy timeout. Without it (the
    operator's commands) only the connect timeout is bounded, and SQLite waits 5 s for a
    lock. Parameters in the URL's query string win."""
    parsed = parse(url)
    scheme = url.split(":", 1)[0]
    if scheme == "sqlite":
        path = parsed.pop("database")
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        db = ClassifiedSqliteDatabase(
            path,
            field_types=SQLITE_FIELD_TYPES,
            # Every transaction takes the write lock at its start: a deferred one that
            # read before another connection (the database thread's, a mail thread's)
            # committed could not write at all (SQLITE_BUSY at once, no busy wait).
            lock_type="IMMEDIATE",
            pragmas={
                "journal_mode": "wal",
                # An acknowledged webhook must survive a power cut, not only a crash.
                "synchronous": "full",
                "busy_timeout": timeout_ms or 5000,
                "foreign_keys": 1,
            },
        )
    elif scheme in ("postgres", "postgresql"):
        if timeout_ms:
            for name, value in _libpq_bounds(timeout_ms).items():
                parsed.setdefault(name, value)
            BoundedWaits.set(timeout_ms / 1000)
        parsed.setdefault("connect_timeout", 3)
        db = ReconnectingPostgresqlDatabase(field_types=POSTGRES_FIELD_TYPES, **parsed)
    else:
        raise ValueError(
            f"DATABASE_URL must start with sqlite:// or postgresql://, got {scheme}://")
    database.initialize(db)
    return db


def lock_timeout_ms(timeout_ms):
    """A lock's wait, bounded below a statement's: a wait on another transaction's lock
    (or two transactions waiting on each other) ends as a conflict (55P03), run again,
    never as the statement timeout that says the database does not answer."""
    return max(1, timeout_ms // 2)


def _libpq_bounds(timeout_ms):
    return {"connect_timeout": max(2, math.ceil(timeout_ms / 1000)),
            "tcp_user_timeout": timeout_ms, "keepalives": 1, "keepalives_idle": 2,
            "keepalives_interval": 1, "keepalives_count": 2,
            "options": f"-c statement_timeout={timeout_ms} "
                       f"-c lock_timeout={lock_timeout_ms(timeout_ms)}"}


def is_postgres(db=None):
    target = db or database.obj
    return isinstance(target, PostgresqlDatabase)


class BaseModel(Model):
    # Peewee adds this primary key itself; declared, so that a type checker knows it.
    id = AutoField()
    created_at = UTCDateTimeField(default=utcnow)
    updated_at = UTCDateTimeField(default=utcnow)

    class Meta:
        database = database
        legacy_table_names = False


def database_default(sql):
    """A DEFAULT clause in the table itself: a peewee `default` is applied by peewee alone,
    and other systems insert orders with plain SQL naming only some columns."""
    return [SQL(f"DEFAULT {sql}")]


class OrderBase(BaseModel):
    """Columns shared by the four order tables. Other systems insert rows with only some
    of them, so every column but order_number is nullable or has a database default
    (migration 0006 adds those defaults to tables created before they were declared)."""

    # SQLite's CURRENT_TIMESTAMP is UTC text without a zone ("2026-11-22 03:14:57"), which
    # UTCDateTimeField reads as UTC; PostgreSQL's is a TIMESTAMPTZ.
    created_at = UTCDateTimeField(default=utcnow, constraints=database_default("CURRENT_TIMESTAMP"))
    updated_at = UTCDateTimeField(default=utcnow, constraints=database_default("CURRENT_TIMESTAMP"))
    order_number = TextField(unique=True)
    payment_status = TextField(default="pending_payment",
                               constraints=database_default("'pending_payment'"))
    notes = TextField(default="", constraints=database_default("''"))
    stripe_session_id = TextField(null=True)
    stripe_payment_intent_id = TextField(null=True, index=True)
    customer_email = TextField(null=True)
    customer_name = TextField(null=True)
    service_name = TextField(null=True)
    paid_at = UTCDateTimeField(null=True)
    parent_order_number = TextField(null=True)
    discount_code = TextField(null=True)
    # The order's document name in the workflow system, as its webhooks last gave it;
    # null until one arrives (calls about the order then name it by its order number).
    order_name = TextField(null=True)
    # What is known of the order's payment, fact by fact; payment_status is worked out of
    # them (domain.payments), whatever order the processor's events came in. Null until
    # the first fact: payment_received then also keeps what a status written before
    # these columns (or by another system) said. Amounts are in minor units of
    # payment_currency (ISO 4217); each *_as_of is when the fact was true at the
    # processor (its event's `created`, or when the processor was asked).
    payment_received = BooleanField(null=True)
    payment_amount = BigIntegerField(null=True)
    payment_currency = TextField(null=True)
    payment_failed_at = UTCDateTimeField(null=True)
    dispute_id = TextField(null=True)
    dispute_status = TextField(null=True)
    dispute_amount = BigIntegerField(null=True)
    dispute_as_of = UTCDateTimeField(null=True)
    refunded_charge = TextField(null=True)
    refunded_amount = BigIntegerField(null=True)
    refund_complete = BooleanField(null=True)
    refunded_as_of = UTCDateTimeField(null=True)

    kind = None

    def append_note(self, line):
        self.notes = f"{self.notes}\n{line}" if self.notes else line

    class Meta:
        # save() writes only the columns this instance changed, so two writers that change
        # different columns of one order (a webhook and the settlement job) both keep theirs.
        only_save_dirty = True


class FormationOrder(OrderBase):
    kind = "formation"

    class Meta:
        table_name = "formation_orders"


class ComplianceOrder(OrderBase):
    kind = "compliance"
    service_slug = TextField(null=True)
    stripe_subscription_id = TextField(null=True, index=True)
    subscription_status = TextField(null=True)
    cancelled_at = UTCDateTimeField(null=True)
    fulfillment_status = TextField(null=True)
    intake_reminders_sent = IntegerField(default=0, constraints=database_default("0"))
    intake_reminded_at = UTCDateTimeField(null=True)

    class Meta:
        table_name = "compliance_orders"


class BundleOrder(OrderBase):
    kind = "bundle"

    class Meta:
        table_name = "bundle_orders"


class CrtcOrder(OrderBase):
    kind = "canada_crtc"
    payment_method = TextField(null=True)
    funds_available = BooleanField(default=False, constraints=database_default("FALSE"))
    funds_available_at = UTCDateTimeField(null=True)
    # How often Frappe refused the funds action for this order, and when it last did:
    # a refused order goes to the back of the settlement batch (domain.settlement).
    funds_refusals = IntegerField(default=0, constraints=database_default("0"))
    funds_refused_at = UTCDateTimeField(null=True)
    total_cents = BigIntegerField(null=True)
    amb_annual_price_cents = BigIntegerField(null=True)
    # The ISO 4217 currency of total_cents and amb_annual_price_cents (cents: its minor
    # units), set by the shop with them (migration 0020).
    currency = TextField(default="USD", constraints=database_default("'USD'"))
    # The commission holdback: set once by crtc/delivered; released (the worker job sent)
    # or forfeited (a dispute before the release, with the reason), never both.
    delivered_at = UTCDateTimeField(null=True)
    holdback_ends_at = UTCDateTimeField(null=True)
    commission_released_at = UTCDateTimeField(null=True)
    commission_forfeited_at = UTCDateTimeField(null=True)
    commission_forfeit_reason = TextField(null=True)

    class Meta:
        table_name = "crtc_orders"
        indexes = ((("payment_status", "funds_available", "paid_at"), False),)


ORDER_MODELS = {m.kind: m for m in (FormationOrder, ComplianceOrder, BundleOrder, CrtcOrder)}


class TreasuryJob(BaseModel):
    order_id = TextField(unique=True)
    order_type = TextField()
    state = TextField(default="received")
    coin = TextField()
    amount_coin = ExactDecimalField(default=decimal.Decimal(0))
    # The invoice's fiat amount in the minor unit of its currency (ISO 4217: cents of USD,
    # yen, thousandths of KWD; the name is older than that rule); amount_usd_cents is the
    # same amount when that currency is USD, and null when it is not.
    fiat_currency = TextField(default="USD", constraints=database_default("'USD'"))
    amount_fiat_cents = BigIntegerField(default=0, constraints=database_default("0"))
    amount_usd_cents = BigIntegerField(null=True, default=0)
    idempotency_key = TextField()
    received_at = UTCDateTimeField(default=utcnow)
    # Its amounts and key come from a callback that listed no transaction (the fallback
    # txid): the first callback that lists them replaces them (domain.treasury).
    fallback = BooleanField(default=False, constraints=database_default("FALSE"))

    class Meta:
        table_name = "treasury_jobs"


class LedgerEntry(BaseModel):
    order_id = TextField(index=True)
    order_type = TextField()
    coin = TextField()
    movement_type = TextField(default="receive")
    amount_coin = ExactDecimalField(default=decimal.Decimal(0))
    # As on TreasuryJob: the transaction's fiat amount in the minor unit of the invoice's
    # currency, and in USD cents only when that currency is USD.
    fiat_currency = TextField(default="USD", constraints=database_default("'USD'"))
    amount_fiat_cents = BigIntegerField(default=0, constraints=database_default("0"))
    amount_usd_cents = BigIntegerField(null=True, default=0)
    # The invoice's balance, received under the fallback key (a callback that listed no
    # transaction): one such entry per order, replaced by the listed transactions'.
    fallback = BooleanField(default=False, constraints=database_default("FALSE"))
    provider = TextField()
    provider_ref = TextField()
    provider_status = TextField()
    state = TextField(default="confirmed")
    idempotency_key = TextField(unique=True)
    acquired_at = UTCDateTimeField(default=utcnow)
    notes = TextField(default="")

    class Meta:
        table_name = "ledger_entries"


class WebhookEvent(BaseModel):
    """The inbox: every accepted call, stored raw before it is handled.

    status: received (stored, not yet handled), processed, failed (handling raised; the
    scheduler retries it), dead (given up: by the retry policy after too many failures,
    or by an operator), rejected (malformed; kept with the reason), ignored (nothing to
    do for it).

    reconciled: not delivered by its sender but found by reconciliation (a workflow state
    change whose webhook never came, domain/reconcile.py) and handled as if it had come.

    given_up_by, given_up_at, given_up_reason: who gave the event up, when and why, when
    an operator did (ops.operator.give_up_events); it is then dead and final."""

    source = TextField()
    event_type = TextField()
    dedup_key = TextField()
    external_id = TextField(null=True)
    order_number = TextField(null=True, index=True)
    payload = TextField()
    status = TextField(default="received")
    attempts = IntegerField(default=0)
    last_error = TextField(null=True)
    next_attempt_at = UTCDateTimeField(null=True)
    received_at = UTCDateTimeField(default=utcnow)
    processed_at = UTCDateTimeField(null=True)
    # Nullable only so that adding it to a large table is one quick ALTER (migration 0016).
    reconciled = BooleanField(default=False, null=True, constraints=database_default("FALSE"))
    given_up_by = TextField(null=True)
    given_up_at = UTCDateTimeField(null=True)
    given_up_reason = TextField(null=True)
    # Not columns: the id of the earlier unfinished event of its order that the event
    # waits behind when it was stored, or None, set by engine.inbox on an event it
    # stores; and what it waits behind as the operator reads it (ops.operator.note_holds).
    held_behind: int | None
    held: str | None
    # Not a column: whether later events of its order are finished (a dead one; read by
    # ops.operator.event_with_effects for the console's replay).
    overtaken: bool

    class Meta:
        table_name = "webhook_events"
        indexes = (
            (("source", "dedup_key"), True),
            (("status", "next_attempt_at"), False),
            (("received_at",), False),
            # The console's event list: newest first under each filter, a page at a time
            # (keyset on received_at, id), at any size of the table.
            (("source", "received_at", "id"), False),
            (("event_type", "received_at", "id"), False),
            (("status", "received_at", "id"), False),
            (("external_id",), False),
        )


# An order's events still to be finished, in arrival order: "is an earlier event of this
# order unfinished?" (engine.inbox, its arrival-order rule) asked for every call stored
# and every event claimed, answered in one probe however many events the order has.
WebhookEvent.add_index(
    WebhookEvent.index(WebhookEvent.order_number, WebhookEvent.received_at, WebhookEvent.id,
                       name="webhook_events_unfinished_by_order")
    .where(WebhookEvent.status.in_(["received", "failed"])))


class Outbox(BaseModel):
    """An effect on another system, recorded in the same transaction as its cause.

    status: pending (to send at next_attempt_at), sent, dead (gave up; see last_error)."""

    event = ForeignKeyField(WebhookEvent, null=True, on_delete="SET NULL",
                            backref="effects", column_name="event_id")
    event_id: int | None  # the column itself, as peewee gives it
    # Not a column: whether an earlier row of its order must be sent first, set by
    # engine.outbox.note_whether_behind on the rows it is about to send.
    behind: bool
    kind = TextField()
    order_number = TextField(null=True, index=True)
    payload = TextField()
    idempotency_key = TextField(unique=True)
    status = TextField(default="pending")
    attempts = IntegerField(default=0)
    next_attempt_at = UTCDateTimeField(default=utcnow)
    last_error = TextField(null=True)
    sent_at = UTCDateTimeField(null=True)
    # The last attempt, written with its outcome; the database copies each into `attempts`.
    last_attempt_at = UTCDateTimeField(null=True)
    last_status_code = IntegerField(null=True)
    last_duration_ms = IntegerField(null=True)
    last_reply = TextField(null=True)

    class Meta:
        table_name = "outbox"
        indexes = (
            (("status", "next_attempt_at"), False),
            # The console's outbox list: the newest rows of a status (and destination).
            (("status", "id"), False),
            (("kind", "status", "id"), False),
        )


# Whether an earlier job or workflow action of the same order is still unsent, asked for
# every new effect and for every row the scheduler claims. The unsent rows are the few;
# with this index the answer is one probe, whatever the size of a backlog. Without it
# PostgreSQL, its statistics not yet caught up with a table that grew by thousands in
# an outage, answered through (kind, status, id): every earlier unsent row of the kind
# for every candidate, 2.2 s for one claim with 4,800 rows waiting.
Outbox.add_index(Outbox.index(Outbox.order_number, Outbox.kind, Outbox.id,
                              name="outbox_unsent_by_order")
                 .where(Outbox.status.in_(["pending", "waiting"])))

# The events operators gave up (the few): counted on their own, so the failures that
# await someone are the status index's counts less these, read from no event's row. An
# event stored has none, and costs this index nothing.
WebhookEvent.add_index(WebhookEvent.index(WebhookEvent.status, WebhookEvent.given_up_at,
                                          name="webhook_events_given_up")
                       .where(WebhookEvent.given_up_at.is_null(False)))




class Attempt(BaseModel):
    """One try at sending an outbox row: when, to which destination, the status code (none
    for a connection error or a mail server's refusal), how long it took, the error, a
    cleaned excerpt of the reply, and the row's status after it (sent, pending for a retry,
    dead, logged). Pruned after RETENTION_DAYS.

    Written by the database, not by the code: a trigger on outbox (ATTEMPT_TRIGGER, made
    by migration 0013) copies the row's last_* columns here whenever an UPDATE counts one
    more attempt, so the attempt costs no statement of its own, and no round trip, beside
    its outcome's."""

    outbox_id = BigIntegerField()
    destination = TextField()
    attempted_at = UTCDateTimeField()
    outcome = TextField()
    status_code = IntegerField(null=True)
    duration_ms = IntegerField(null=True)
    error = TextField(null=True)
    reply = TextField(null=True)

    class Meta:
        table_name = "attempts"
        indexes = ((("outbox_id", "id"), False), (("created_at",), False))


# An UPDATE of outbox that counts one more attempt is one attempt made (a retry put back
# in line sets the count to 0; a row waiting for its destination's configuration keeps it).
_ATTEMPT_COPIED = (
    "(outbox_id, destination, attempted_at, outcome, status_code, duration_ms, error, "
    "reply, created_at, updated_at) VALUES (NEW.id, NEW.kind, "
    "COALESCE(NEW.last_attempt_at, NEW.updated_at), NEW.status, NEW.last_status_code, "
    "NEW.last_duration_ms, NEW.last_error, NEW.last_reply, NEW.updated_at, NEW.updated_at)")
# The statements that make the trigger (each safe to run again), by database.
ATTEMPT_TRIGGER = {
    "postgres": (
        "CREATE OR REPLACE FUNCTION outbox_attempt() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN INSERT INTO attempts {_ATTEMPT_COPIED}; RETURN NULL; END $$",
        "DROP TRIGGER IF EXISTS outbox_attempt ON outbox",
        "CREATE TRIGGER outbox_attempt AFTER UPDATE ON outbox FOR EACH ROW "
        "WHEN (NEW.attempts > OLD.attempts) EXECUTE FUNCTION outbox_attempt()"),
    "sqlite": (
        "CREATE TRIGGER IF NOT EXISTS outbox_attempt AFTER UPDATE OF attempts ON outbox "
        "FOR EACH ROW WHEN NEW.attempts > OLD.attempts "
        f"BEGIN INSERT INTO attempts {_ATTEMPT_COPIED}; END",),
}

ALL_MODELS = [*ORDER_MODELS.values(), TreasuryJob, LedgerEntry, WebhookEvent, Outbox]
ATTEMPT_MODELS = [Attempt]



# Public endpoints (issue 6): "already filed" links, surveys and referral codes.

class SelfFiling(BaseModel):
    """A customer's "I already filed" click for one IFTA/UCR order and cycle; the first
    click's time is kept and reminders for that cycle stop."""

    kind = TextField()
    order_number = TextField()
    cycle = TextField()
    self_filed_at = UTCDateTimeField()

    class Meta:
        table_name = "self_filings"
        indexes = ((("kind", "order_number", "cycle"), True),)


class SurveyResponse(BaseModel):
    """The post-completion survey: one response per order."""

    order_number = TextField(unique=True)
    rating = IntegerField()
    comment = TextField(default="")

    class Meta:
        table_name = "survey_responses"


class ReferralCode(BaseModel):
    """A customer's referral code, written by the back office. The new customer gets
    percent_off; the referrer earns reward_cents per paid order that used the code."""

    code = TextField(unique=True)
    owner_email = TextField(index=True)
    percent_off = IntegerField()
    reward_cents = BigIntegerField(default=0)
    active = BooleanField(default=True)
    expires_at = UTCDateTimeField(null=True)

    class Meta:
        table_name = "referral_codes"


PUBLIC_MODELS = [SelfFiling, SurveyResponse, ReferralCode]


# Card processor (issue 3): the subscription cycles of compliance orders.

class SubscriptionCycle(BaseModel):
    """One paid renewal (Stripe invoice with billing_reason subscription_cycle) of a
    subscription, numbered 1, 2, ... in the order they were paid. Kept apart from the
    inbox, which is pruned, so the numbering survives."""

    subscription_id = TextField()
    invoice_id = TextField(unique=True)
    order_number = TextField()
    cycle = IntegerField()

    class Meta:
        table_name = "subscription_cycles"
        indexes = ((("subscription_id", "cycle"), True),)


CARD_MODELS = [SubscriptionCycle]


# The operator console (issue 16).

class ConsoleAction(BaseModel):
    """What an operator did in the console, kept for good: who (the name given at
    login), from which address, what (login, replay, retry...), on what, and how it went."""

    operator = TextField()
    address = TextField()
    action = TextField()
    target = TextField(default="")
    outcome = TextField(default="")

    class Meta:
        table_name = "console_actions"
        indexes = ((("created_at",), False),)


class ConsoleSession(BaseModel):
    """A console login, until it expires or is ended (logout, `receiver.py console
    logout-all`). The cookie carries a random token; only its SHA-256 is kept, so the
    table's contents open no session. `password_tag` names the CONSOLE_PASSWORD_HASH it
    was opened with: another hash ends it."""

    token_hash = TextField(unique=True)
    operator = TextField()
    password_tag = TextField()
    expires_at = UTCDateTimeField()
    ended_at = UTCDateTimeField(null=True)

    class Meta:
        table_name = "console_sessions"


CONSOLE_MODELS = [ConsoleAction, ConsoleSession]


# Reminders (issue 14): what was sent, keyed, so that nothing is sent twice.

class SentReminder(BaseModel):
    """One reminder sent, under a unique key: `mail|<customer>|<day>` for a customer's
    consolidated reminder e-mail of a day (in BUSINESS_TZ), and
    `<ifta|ucr>|<order>|<cycle>|<days before due>` for one filing reminder. Two runs, in
    one process or two, cannot both insert a key, so neither sends it twice."""

    key = TextField(unique=True)
    kind = TextField()
    customer_email = TextField()
    order_number = TextField(null=True)
    cycle = TextField(null=True)
    day = TextField()

    class Meta:
        table_name = "reminders_sent"


REMINDER_MODELS = [SentReminder]


# Reconciliation with the workflow system (issue 25).

class ReconcileRun(BaseModel):
    """Where reconciliation with Frappe got to, per doctype: `cursor` is the newest
    `modified` (Frappe's own text, in its time zone) it has looked at, `succeeded_at` when
    a run last finished, `last_error` why the last run did not, or what a finished one
    found wrong (its window met none of Frappe's changes), `newest_seen` the newest
    `modified` a run saw in Frappe (migration 0019)."""

    doctype = TextField(unique=True)
    cursor = TextField(null=True)
    succeeded_at = UTCDateTimeField(null=True)
    last_error = TextField(null=True)
    newest_seen = TextField(null=True)

    class Meta:
        table_name = "reconcile_runs"


RECONCILE_MODELS = [ReconcileRun]
