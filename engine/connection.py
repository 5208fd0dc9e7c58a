"""The service's connection to its database: the Database classes every statement goes
through, chosen at start-up from DATABASE_URL by `open_database`, and how long any wait
on the database may last.

Every statement of the service passes one door (`ServiceDatabase`), which:
- counts it (/metrics' statements and round trips) and tells the test suite's thread
  check of it (`before_statement`);
- raises what the driver raised as DatabaseDown or StatementRefused (engine.errors),
  and refuses it at once while the circuit (engine.db.Circuit) says the database is
  down;
- tells the turn of every write peewee builds (`on_write`: engine.commits drops the
  rows it kept that the write may change);
- on PostgreSQL, in a turn that holds writes, holds the BEGIN and the writes whose
  result nobody reads (`HeldWrites`), and runs a statement compiled once by name, with
  its PREPARE sent with its first use on the connection (`PreparedOnConnection`).
Statements joined into one round trip are engine.joined's; bounded waits, `BoundedWaits`.
"""
import contextlib
import math
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import peewee
import psycopg2
import psycopg2.extensions
from peewee import InterfaceError, OperationalError, PostgresqlDatabase, SqliteDatabase
from playhouse.db_url import parse
from playhouse.shortcuts import ReconnectMixin

from models import POSTGRES_FIELD_TYPES, SQLITE_FIELD_TYPES, database
from engine.errors import Classified, DatabaseDown

if TYPE_CHECKING:
    from engine.db import Circuit

# peewee's own: what turns a driver's error into peewee's class of it (its stubs leave it
# out).
EXCEPTION_WRAPPER: Any = peewee.__exception_wrapper__  # type: ignore[attr-defined]
# Held before the PREPAREs of a session whose prepared statements are unknown, and
# counted among them (`PreparedOnConnection`).
DEALLOCATE = b"DEALLOCATE ALL"


class ServerSide(Protocol):
    """A statement compiled once, as PostgreSQL prepares it (engine.prepared.ServerSide)."""

    sql: str
    name: str
    execute: str

    def arguments(self, bound: list) -> list: ...

    def prepare_text(self, cursor: Any) -> bytes: ...


class HeldWrites:
    """The writes held in this thread (`ServiceDatabase.holding_writes`): a BEGIN and the
    writes whose result nobody reads, bound, waiting to go to the server in the same
    round trip as the next statement that is sent, or as the COMMIT. Only the database
    thread's turns hold any; a probe or a mail thread sends its statements as they come."""

    _local = threading.local()

    @classmethod
    def writes(cls) -> list[bytes] | None:
        """The writes held, None when this thread holds none."""
        held: list[bytes] | None = getattr(cls._local, "writes", None)
        return held

    @classmethod
    def take(cls) -> list[bytes] | None:
        """The writes held, no longer held (the caller sends them)."""
        held = cls.writes()
        if not held:
            return held
        cls._local.writes = []
        return held

    @classmethod
    @contextlib.contextmanager
    def holding(cls) -> Iterator[None]:
        cls._local.writes = []
        try:
            yield
        finally:
            cls._local.writes = None


class PreparedOnConnection:
    """Which statements compiled once (engine.prepared.ServerSide) a connection has
    prepared on the server. PREPARE is not undone by a rollback; a round trip that
    carried one and failed leaves unknown which ran, so the session's next PREPARE goes
    after a DEALLOCATE ALL, and the statements are prepared again as they are used."""

    def __init__(self, conn: object) -> None:
        self.conn = conn
        self.prepared: set[str] = set()
        # Held, not yet sent: names, and DEALLOCATE.
        self.preparing: list[str | bytes] = []
        self.deallocate = False

    def executing(self, prepared: ServerSide, held: list[bytes], cursor: Any) -> str:
        """The EXECUTE of `prepared`, its PREPARE held before it unless the connection
        has it (or is about to)."""
        if prepared.name in self.prepared or prepared.name in self.preparing:
            return prepared.execute
        if self.deallocate and DEALLOCATE not in self.preparing:
            held.append(DEALLOCATE)
            self.preparing.append(DEALLOCATE)
        held.append(prepared.prepare_text(cursor))
        self.preparing.append(prepared.name)
        return prepared.execute

    def sending(self) -> list[str | bytes]:
        """What is being prepared, as a round trip takes it to the server."""
        preparing, self.preparing = self.preparing, []
        return preparing

    def sent(self, preparing: list[str | bytes]) -> None:
        if DEALLOCATE in preparing:
            self.deallocate = False  # `prepared` is empty since it was set
        self.prepared.update(name for name in preparing if isinstance(name, str))

    def lost(self) -> None:
        """A round trip that carried a PREPARE failed: which of them ran is unknown."""
        self.deallocate, self.prepared = True, set()


class ServiceDatabase(peewee.Database):
    """The door every statement of the service passes (above); mixed into the Database
    classes below, before peewee's own."""

    circuit: "Circuit | None" = None
    # Statements asked of the database by this process, BEGIN, COMMIT and ROLLBACK
    # included (/metrics' receiver_database_statements).
    statements = 0
    # Times this process waited for the server's answer (/metrics'
    # receiver_database_round_trips): the statements less those sent with another.
    round_trips = 0
    # Whether the driver sends several statements in one round trip: psycopg2 does
    # (one string, the last statement's result kept); sqlite3 runs one per call, and an
    # embedded database has no round trip to save. Writes are held and statements
    # prepared on the server only where it does: sqlite3 keeps its own cache of
    # compiled statements.
    sends_several_at_once = False
    # Called before every statement, when set: the test suite's thread check
    # (tests/door.py) refuses one not run through the door (engine.commits).
    before_statement: Callable[[str], None] | None = None
    # Told of the model of every write peewee builds and runs (Model.save and create,
    # update, insert, delete; None for a table of no model), when set: engine.commits
    # drops the rows kept for the turn that the write may change.
    on_write: Callable[[Any], None] | None = None
    if TYPE_CHECKING:  # peewee's own, which its stubs leave out
        _state: Any

        def _log_query(self, sql: Any, params: Any) -> None: ...

        def _connect(self) -> Any: ...

    def execute(self, query: Any, **context_options: Any) -> Any:
        if self.on_write is not None and isinstance(query, peewee._WriteQuery):
            self.on_write(getattr(query, "model", None))
        return super().execute(query, **context_options)

    def execute_sql(self, sql: Any, params: Any = None) -> Any:
        self._asked(sql)
        with self._guarded():
            held = HeldWrites.take()
            self.round_trips += 1
            if held:
                self._log_query(sql, params)
                return self._send_held([*held, self._text_of(sql, params)])
            return super().execute_sql(sql, params)

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        self._asked("BEGIN")
        with self._guarded():
            held = HeldWrites.writes()
            if held is not None and not args and not kwargs and self._may_hold_begin():
                if self.is_closed():
                    # Now: connecting later, inside the transaction, would reset
                    # peewee's count of the transactions open.
                    self.connect()
                held.append(b"BEGIN")
                return None
            self.round_trips += 1
            return super().begin(*args, **kwargs)

    def rollback(self) -> Any:
        self.statements += 1
        held = HeldWrites.take()
        book = getattr(self._state, "on_server", None)
        if book is not None:
            book.preparing = []  # held and never sent, if there were any
        if held and held[0] == b"BEGIN":
            return None  # the transaction never reached the server: nothing to undo
        self.round_trips += 1
        return super().rollback()

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        with self._guarded():
            return super().connect(*args, **kwargs)

    def commit(self) -> Any:
        self.statements += 1
        held = HeldWrites.take()
        if held == [b"BEGIN"]:
            return None  # nothing was asked in the transaction
        self.round_trips += 1
        # Not refused while the circuit is open: a transaction begun before is ended.
        with Classified(self.circuit):
            if held:
                self._send_held([*held, b"COMMIT"])
                return None
            return super().commit()

    @contextlib.contextmanager
    def holding_writes(self) -> Iterator[None]:
        """Held writes (`HeldWrites`, PostgreSQL only) for the code inside, in this
        thread; all are sent by the time it ends with a COMMIT or ROLLBACK, which the
        caller's transaction does. A held write that fails is raised by the statement it
        went with or by the COMMIT, which the group commit takes as the turn failing
        (engine.commits)."""
        if not self.sends_several_at_once:
            yield
            return
        with HeldWrites.holding():
            yield

    def write_later(self, sql: str, params: Any = None,
                    prepared: ServerSide | None = None) -> None:
        """`execute_sql` for a write whose cursor nobody reads: held, while holding, to
        be sent with the next statement. `prepared`: as `execute_prepared`."""
        held = HeldWrites.writes()
        if held is None:
            self.execute_sql(sql, params)
            return
        self._asked(sql)
        self._log_query(sql, params)
        with self._guarded():
            if prepared is not None:
                sql, params = self._executing(prepared, held), prepared.arguments(params)
            held.append(self._text_of(sql, params))

    def execute_prepared(self, prepared: ServerSide, params: list[Any]) -> Any:
        """`execute_sql` of a statement compiled once (engine.prepared.ServerSide): the
        server parses and plans a statement sent as text every time, which costs about
        as much as running it. By name, prepared on the server with its first use on the
        connection (in the same round trip), in a turn that holds writes on a database
        that sends several statements at once; as text otherwise."""
        held = HeldWrites.writes()
        if held is None:
            return self.execute_sql(prepared.sql, params)
        self._asked(prepared.sql)
        with self._guarded():
            execute = self._text_of(self._executing(prepared, held), prepared.arguments(params))
            self.round_trips += 1
            self._log_query(prepared.sql, params)
            return self._send_held([*(HeldWrites.take() or []), execute])

    def _executing(self, prepared: ServerSide, held: list[bytes]) -> str:
        """`PreparedOnConnection.executing` for the database's own connection, which is
        open: its BEGIN is held or sent."""
        state = self._state
        book: PreparedOnConnection | None = getattr(state, "on_server", None)
        if book is None or book.conn is not state.conn:
            book = state.on_server = PreparedOnConnection(state.conn)
        return book.executing(prepared, held, self.cursor())

    def _asked(self, sql: Any) -> None:
        self.statements += 1
        if self.before_statement is not None:
            self.before_statement(sql)

    def _text_of(self, sql: Any, params: Any) -> bytes:
        with EXCEPTION_WRAPPER:
            text: bytes = self.cursor().mogrify(sql, params or ())
            return text

    def _send_held(self, statements: list[bytes]) -> Any:
        """Several statements, already bound, in one round trip: the last one's cursor."""
        book: PreparedOnConnection | None = getattr(self._state, "on_server", None)
        preparing = book.sending() if book is not None else []
        try:
            with EXCEPTION_WRAPPER:
                cursor = self.cursor()
                cursor.execute(b"; ".join(statements))
        except BaseException:
            if book is not None and preparing:
                book.lost()
            raise
        if book is not None and preparing:
            book.sent(preparing)
        return cursor

    def _may_hold_begin(self) -> bool:
        return True

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        circuit = self.circuit
        if circuit is not None and circuit.is_open and not circuit.lets_through():
            raise DatabaseDown(f"the database is down ({circuit.reason}); not tried until "
                               "a probe finds it back")
        with Classified(circuit):
            yield


class BoundedWaits:
    """How long the service's loop may wait on the database: every wait of psycopg2's
    (connecting, a statement, a commit) goes through `wait`, which gives up after
    `seconds`. libpq's own timeouts cannot do that alone: a frozen server (a hung host, a
    partition whose packets are dropped by a proxy that still answers TCP) leaves a
    connection open and silent, and psycopg2 would block the IOLoop on it for good. On
    giving up psycopg2 closes that connection; the next statement opens a new one."""

    seconds: float | None = None

    @classmethod
    def wait(cls, conn: Any) -> None:
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
    def set(cls, seconds: float) -> None:
        cls.seconds = seconds
        psycopg2.extensions.set_wait_callback(cls.wait)

    @classmethod
    @contextlib.contextmanager
    def lifted(cls) -> Iterator[None]:
        seconds, cls.seconds = cls.seconds, None
        try:
            yield
        finally:
            cls.seconds = seconds


class ClassifiedSqliteDatabase(ServiceDatabase, SqliteDatabase):
    """SQLite, its errors sorted into down and refused."""

    def probe(self) -> None:
        """Raise unless the file can be written now: a connection of its own (any thread)
        takes the write lock, within the busy timeout, and lets it go."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        finally:
            conn.close()

    @contextlib.contextmanager
    def unbounded(self) -> Iterator[None]:
        """Nothing to lift: the busy timeout is the only wait."""
        yield


class ReconnectingPostgresqlDatabase(ServiceDatabase, ReconnectMixin, PostgresqlDatabase):
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

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        # A connection psycopg2 found broken is replaced before the transaction.
        if self._connection_broken():
            self.close()
        return super().begin(*args, **kwargs)

    def rollback(self) -> Any:
        if self._connection_broken():
            return None  # the server ended the transaction with the connection
        return super().rollback()

    def _may_hold_begin(self) -> bool:
        """Not when the server has said something unasked since its last answer: most
        likely that it ended the session (a restart, a failover, an administrator).
        The BEGIN then goes alone, and ReconnectMixin replaces the connection if it
        fails, as it would have without held writes; held, it would fail inside the
        transaction, where a reconnect may not be made."""
        if self.is_closed():
            return True
        readable, _, _ = select.select([self._state.conn.fileno()], [], [], 0)
        return not readable

    def _connection_broken(self) -> bool:
        return not self.is_closed() and bool(self._state.conn.closed)

    def session_apart(self) -> Any:
        """A connection of its own (any thread), in autocommit, bounded like every other
        wait, that neither the circuit nor the held writes know of: for what must hold a
        session (scheduler.AdvisoryLock). The caller closes it."""
        return self._connect()

    def probe(self) -> None:
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
    def unbounded(self) -> Iterator[None]:
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


# What `open_database` makes.
OpenDatabase = ClassifiedSqliteDatabase | ReconnectingPostgresqlDatabase


def sqlite_file(url: str) -> str | None:
    """The file a sqlite:/// URL names; None for PostgreSQL or an in-memory database."""
    if url.split(":", 1)[0] != "sqlite":
        return None
    path: str = parse(url)["database"]
    return None if path == ":memory:" else path


def open_database(url: str, timeout_ms: int | None = None) -> OpenDatabase:
    """Create the Database for `url` (sqlite:///path or postgresql://...) and bind the
    models to it (models.database).

    With `timeout_ms` (the service's DATABASE_TIMEOUT_MS), every wait on the database is
    bounded by it: on PostgreSQL the connect timeout (libpq's minimum is 2 s),
    tcp_user_timeout, TCP keepalives (a dead idle connection is found in about 4 s), the
    statement timeout and BoundedWaits, and a lock's wait by half of it
    (`lock_timeout_ms`); on SQLite the busy timeout. Without it (the operator's
    commands) only the connect timeout is bounded, and SQLite waits 5 s for a lock.
    Parameters in the URL's query string win."""
    parsed = parse(url)
    scheme = url.split(":", 1)[0]
    db: OpenDatabase
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


def lock_timeout_ms(timeout_ms: int) -> int:
    """A lock's wait, bounded below a statement's: a wait on another transaction's lock
    (or two transactions waiting on each other) ends as a conflict (55P03), run again,
    never as the statement timeout that says the database does not answer."""
    return max(1, timeout_ms // 2)


def _libpq_bounds(timeout_ms: int) -> dict[str, object]:
    return {"connect_timeout": max(2, math.ceil(timeout_ms / 1000)),
            "tcp_user_timeout": timeout_ms, "keepalives": 1, "keepalives_idle": 2,
            "keepalives_interval": 1, "keepalives_count": 2,
            "options": f"-c statement_timeout={timeout_ms} "
                       f"-c lock_timeout={lock_timeout_ms(timeout_ms)}"}
