"""What a database error means: the database is down (wait it out), the statement is
refused (it would be refused again), or two transactions conflict (run the unit again).

The service's database classes (engine.connection) raise every driver error as
DatabaseDown or StatementRefused by `is_down`, whatever class the driver chose: code
that waits out an outage catches OperationalError and InterfaceError
(engine.db.UNAVAILABLE), and must never wait out a refusal, nor refuse in an outage.
"""
import contextlib
import threading
from types import TracebackType
from typing import Iterator, Literal, Protocol

from peewee import DatabaseError, InterfaceError, OperationalError, PeeweeException

# What counts as "the database is down": the errors worth waiting out, as opposed to a
# statement the database refuses and will refuse again (a value past PostgreSQL's index
# row limit, SQLSTATE 54000, which psycopg2 raises as OperationalError). PostgreSQL's by
# SQLSTATE: connection (08), conflict (40, the group commit runs the unit again),
# insufficient resources (53: too many connections, disk full), lock timeout (55P03, a
# conflict too), statement timeout or shutdown (57: 57014, 57P01-57P05), system error
# (58), read-only (25006, a standby after a failover), idle session ended (25P03).
DOWN_SQLSTATE_CLASSES = ("08", "40", "53", "57", "58")
DOWN_SQLSTATES = ("55P03", "25006", "25P03")
# SQLite's by primary result code: BUSY (the busy timeout ran out), LOCKED, NOMEM,
# READONLY, IOERR, FULL, CANTOPEN, PROTOCOL.
DOWN_SQLITE_CODES = frozenset((5, 6, 7, 8, 10, 13, 14, 15))

# SQLSTATE class 40 (a deadlock, 40P01, or a serialization failure) and 55P03 (a lock
# waited for past lock_timeout: another process's transaction holds it, or each waits on
# the other): conflicts, which the group commit runs again; the database is up.
CONFLICT_CLASS = "40"
LOCK_NOT_AVAILABLE = "55P03"


class DatabaseDown(OperationalError):
    """The database cannot be reached or written now; the same statement may work later."""


class StatementRefused(DatabaseError):
    """The database answered and refused this statement; it would refuse it again."""


class MaintenanceCutShort(StatementRefused):
    """A statement of maintenance work (`maintenance()`: retention's deletes) that did not
    finish: timed out, or met the database down. Not an outage: it opens no circuit, and
    the maintenance tries again later; a database that really is down is found by the
    calls that need it."""


class Tripped(Protocol):
    """What is told of every DatabaseDown (engine.db.Circuit)."""

    def trip(self, failure: BaseException) -> None: ...


_maintenance = threading.local()


@contextlib.contextmanager
def maintenance() -> Iterator[None]:
    """The statements run inside are maintenance (in the thread that runs them): a long
    prune must never be taken for the database going down and send every call to the
    spool."""
    _maintenance.active = True
    try:
        yield
    finally:
        _maintenance.active = False


def is_conflict(failure: BaseException) -> bool:
    """peewee keeps the driver's error as `orig`; psycopg2's carries the SQLSTATE."""
    driver_error = getattr(failure, "orig", None)
    sqlstate = str(getattr(driver_error, "pgcode", "") or "")
    return sqlstate.startswith(CONFLICT_CLASS) or sqlstate == LOCK_NOT_AVAILABLE


def is_down(exc: BaseException) -> bool:
    """Whether a driver error (as peewee raised it) means the database is unavailable.

    An error without a code from the server is the client's own (connection refused,
    reset, timed out): down. One with a code is down only if the code says so."""
    driver_error = getattr(exc, "orig", None)
    sqlstate = getattr(driver_error, "pgcode", None)
    if sqlstate:
        return bool(sqlstate.startswith(DOWN_SQLSTATE_CLASSES) or sqlstate in DOWN_SQLSTATES)
    sqlite_code = getattr(driver_error, "sqlite_errorcode", None)
    if sqlite_code is not None:
        return sqlite_code & 0xFF in DOWN_SQLITE_CODES
    return isinstance(exc, (OperationalError, InterfaceError))


class Classified:
    """Re-raises a database error raised inside as DatabaseDown or StatementRefused
    (MaintenanceCutShort inside `maintenance()`); tells `circuit` (if any) of a
    DatabaseDown. A class, not a generator: it wraps every statement."""

    def __init__(self, circuit: Tripped | None) -> None:
        self.circuit = circuit

    def __enter__(self) -> "Classified":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> Literal[False]:
        if exc is None or not isinstance(exc, PeeweeException) or isinstance(
                exc, StatementRefused) or getattr(exc, "orig", None) is None:
            return False
        driver_error = getattr(exc, "orig")
        if not is_down(exc):
            if not isinstance(exc, (OperationalError, InterfaceError)):
                return False
            raise StatementRefused(driver_error, *exc.args).with_traceback(traceback) from None
        if getattr(_maintenance, "active", False) and not is_conflict(exc):
            raise MaintenanceCutShort(driver_error, *exc.args).with_traceback(
                traceback) from None
        if self.circuit is not None:
            self.circuit.trip(exc)
        if isinstance(exc, DatabaseDown):
            return False
        raise DatabaseDown(driver_error, *exc.args).with_traceback(traceback) from None
