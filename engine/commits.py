"""Group commit: every unit of work runs in one database thread, in turns that share
one transaction and one commit.

The contract, for a caller of `GroupCommit.run(unit, ahead)` (the one door,
`ctx.db(unit)`):

- `unit()` is plain synchronous code that reads and writes the database and builds
  values. It runs in `DATABASE_THREAD`, in the next turn: the units asked for while a
  turn runs go together into the next one. `run` returns what the unit returned once the
  turn's COMMIT is done: nothing is acknowledged before it is durable. The IOLoop never
  waits on the database; a unit leaves the loop's state (destinations, timers, tasks) to
  its caller.
- A unit may run more than once. A turn runs first without savepoints; should a unit (or
  a part of one that may fail alone, `savepoint()`) raise, the turn is rolled back and
  run again with a savepoint around each unit and part, so that only what failed is
  undone and the others commit. A conflict with another process (a deadlock, a lock
  waited on past lock_timeout: engine.errors.is_conflict) runs the unit again in the next
  turn, up to MAX_CONFLICTS times, and opens no circuit. A unit therefore only reads,
  writes and builds values; code in one that catches database errors lets a conflict
  through (`raise_if_conflict`); what it counts or sets off goes through `on_commit`.
- A call's waits on the database are bounded in all (`budget`: past it OverBudget, a
  DatabaseDown), a background run's by its `allowance` (AllowanceSpent, which opens no
  circuit).

On PostgreSQL a turn run without savepoints also saves round trips; the run with
savepoints, and SQLite, which has no round trip to save, do neither. Its writes whose
result nobody reads are held and go with the next statement or the COMMIT
(engine.connection.HeldWrites); what its units ask to have done ahead (`Ahead`: a call's
event, the orders its plugin reads) is done for all of them in one statement before they
run (engine.joined); the writes they leave for the turn's end (`at_turn_end`: their
effects) go in one statement before the COMMIT. Why one thread, and what each of these
saved: docs/DECISIONS.md and docs/PERFORMANCE.md.
"""
import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import threading
import time
from typing import Callable, Iterator, NamedTuple, Self, Sequence, TypeVar

from peewee import DatabaseError

from models import database
from engine import joined
from engine.connection import ServiceDatabase
from engine.errors import DatabaseDown, is_conflict

T = TypeVar("T")
Kept = TypeVar("Kept")
Ending = TypeVar("Ending", bound=Callable[[], object])
# A unit of work: plain synchronous code, called with no arguments in the database thread
# inside a turn's transaction, safe to run again from its start (above); what it returns
# is handed to its caller once committed.
Unit = Callable[[], T]

MAX_CONFLICTS = 5
# Turns run by this process (/metrics' receiver_database_turns): beside the statement
# count, the round trips a turn costs on PostgreSQL.
turns_run = 0
# Runs every turn of every GroupCommit in the process, one at a time.
DATABASE_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="database")

# False while a turn runs without savepoints.
_with_savepoints = contextvars.ContextVar("with_savepoints", default=True)
# The time on the database left to the call being served, if it has a budget (`budget`).
_budget: contextvars.ContextVar["TimeLeft | None"] = contextvars.ContextVar(
    "budget", default=None)
# The time on the database left to the background run being done, if it has one
# (`allowance`).
_allowance: contextvars.ContextVar["TimeLeft | None"] = contextvars.ContextVar(
    "allowance", default=None)
# Set in the database thread while it runs a turn: the thread check (`in_a_turn`).
_turn = threading.local()


class Ahead:
    """What a unit asks to have done before the turn's units run, together with what the
    turn's other units ask (above). `statements(items)`, a class method, gives the
    statements that do it for every item of its class in the turn (`AheadStatement`),
    each with what takes its rows and sets `done` on the items it did; none when they
    cannot be done together. The turn's statements of every kind go to the database as
    one, in the units' transaction, when the turn's units ask for two items or more. A
    unit whose item is not done (alone in its turn with nothing else asked, or in a run
    with savepoints, or on SQLite) does the work itself. Done ahead, an item's work is
    seen by the units asked for before it: it must come to what the units' own
    statements would have come to in some order of the turn's units, which were asked for
    together (the order of calls answered together is no order their senders could
    see). What a unit finds may be the item's (`done` and what it set) or kept for the
    turn (`for_this_turn`).

    The turn's statements of every kind are the parts of one statement (engine.joined),
    which PostgreSQL runs in an order it does not promise, all with one snapshot. So no
    kind may read a table another kind's statement writes (it would not see the write),
    and the kinds' locks may be taken in any order: where another process's turn takes
    them the other way round, the deadlock, or the lock waited for past lock_timeout, is
    a conflict, and the units are run again (above). The rows a kind keeps for the turn
    are kept after every write ahead is told to the turn (`wrote`), so no kind may write
    a table whose rows another keeps either. A kind that `writes` is put first, so that
    in practice a turn inserts its events before it locks its orders, as a unit alone
    does, which makes such deadlocks rarer; when it gives no statement (its items cannot
    go together), the other kinds are left to the units too, for the same reason.

    A kind `together_with` another has its items given to that one's `statements`, with
    that kind's own: what must be done in one statement, such as rows locked in one
    order whichever kind of item asked for them."""

    done = False
    writes = False
    together_with: type["Ahead"] | None = None

    @classmethod
    def statements(cls, items: list[Self]) -> list["AheadStatement"]:
        raise NotImplementedError


class AheadStatement(NamedTuple):
    """A statement an `Ahead` kind asks for: its SQL and bound values as the driver takes
    them, a select or a write with RETURNING, and `take(names, rows)`, called with its
    column names and rows once it has run."""

    sql: str
    params: list
    take: Callable[[list[str], list[tuple]], None]


class OverBudget(DatabaseDown):
    """The call being served spent its budget waiting on the database: taken for an
    outage (a webhook is spooled, a page answers 503, the circuit opens)."""


class AllowanceSpent(DatabaseDown):
    """A background run spent its allowance of time on the database (`allowance`): it
    stops there. Not taken for an outage: the circuit stays as it is, and a call is not
    spooled for it."""


class TimeLeft:
    """Seconds of waiting on the database left to a call (its budget) or to a background
    run (its allowance). Only those waits use it up: the time a call spends on other
    systems (a send, a password check, a processor's API) is not the database's. The
    tasks a call gathers share it, and waits they make at once count once: it is the
    time during which the call was waiting on the database."""

    def __init__(self, seconds: float) -> None:
        self.left = seconds
        self._waits = 0
        self._since = 0.0

    def at(self, now: float) -> float:
        """What is left at `now`, the waits under way counted up to it."""
        return self.left - (now - self._since if self._waits else 0.0)

    def wait_started(self, now: float) -> None:
        if not self._waits:
            self._since = now
        self._waits += 1

    def wait_ended(self, now: float) -> None:
        self._waits -= 1
        if not self._waits:
            self.left -= now - self._since


@contextlib.contextmanager
def allowance(seconds: float) -> Iterator[None]:
    """The waits of every `GroupCommit.run` of the code inside, added up, may come to
    `seconds`; the one that would pass that raises AllowanceSpent. Unlike `budget`, only
    the time waiting on the database counts (not a run's calls to other systems), and the
    circuit is left alone: a background run that had its share of the database thread
    (shared with the request path) says nothing about the database being down, which
    the statements' own bound (DATABASE_TIMEOUT_MS) and the calls' budgets find."""
    token = _allowance.set(TimeLeft(seconds))
    try:
        yield
    finally:
        _allowance.reset(token)


@contextlib.contextmanager
def budget(seconds: float | None) -> Iterator[None]:
    """Every `GroupCommit.run` of the code inside (the task and what it awaits, not the
    background work it starts) must be answered within `seconds` of waiting, all of
    them together: a database slow on each reply must not hold a call for many times the
    per-statement bound. Only the waits on the database count (`TimeLeft`): a call that
    waited on a slow peer before its next statement has not found the database slow.
    `None`: no budget (the scheduler's jobs, background work)."""
    token = _budget.set(None if seconds is None else TimeLeft(seconds))
    try:
        yield
    finally:
        _budget.reset(token)


def set_budget(seconds: float) -> None:
    """`budget` for the rest of the current task (an inbound call's handler)."""
    _budget.set(TimeLeft(seconds))


def without_budget() -> contextvars.Context:
    """A copy of the current context with no budget: for work that outlives the call
    (asyncio.create_task(..., context=without_budget()))."""
    context = contextvars.copy_context()
    context.run(_budget.set, None)
    context.run(_allowance.set, None)
    return context


def in_a_turn() -> bool:
    """Whether this thread is running a turn of the group commit right now."""
    return getattr(_turn, "running", False)


def on_commit(callback: Callable[[], object]) -> None:
    """Call `callback()` once the current unit's changes are committed, and never if they
    are undone: what counts them (the metrics) counts each once, although a turn may
    run a unit twice. Outside a turn: now."""
    if in_a_turn():
        _turn.on_commit.append(callback)
    else:
        callback()


def together() -> bool:
    """Whether this thread runs a turn whose like statements go together (above): a unit
    may then leave its writes for the turn's end (`at_turn_end`)."""
    return (in_a_turn() and not _with_savepoints.get()
            and database.sends_several_at_once)


def at_turn_end(key: object, make: Callable[[], Ending]) -> Ending:
    """The callable run at the end of the current turn (`together()` must be true),
    before its COMMIT, under `key`: made by `make()` the first time the turn asks for it,
    the same one after that. Should it raise, the turn is undone as if a unit had."""
    return _made(_turn.at_end, key, make)


def for_this_turn(key: object, make: Callable[[], Kept]) -> Kept:
    """What the current turn keeps under `key` (`together()` must be true): made by
    `make()` the first time the turn asks for it, the same after that, gone with the
    turn (and with a run of it undone)."""
    return _made(_turn.kept, key, make)


# The turn keeps the rows of a model read ahead under (_ROWS, model) (`keep_rows`).
_ROWS = object()
# What `take_row` returns for a key under which no row is kept.
NOT_KEPT = object()


def keep_rows(model: type, rows: dict) -> None:
    """Rows of `model` read ahead (an `Ahead`'s), kept for the current turn
    (`together()` must be true) under keys of the reader's choosing; None for a row
    found absent. Each is taken once (`take_row`): the unit that takes it may change
    it. A write to `model`'s table drops those it may change (`wrote`), so a row taken
    is the one the unit's own read would have found."""
    for_this_turn((_ROWS, model), dict).update(rows)


def take_row(model: type, key: object) -> object:
    """The row of `model` kept for this turn under `key`, no longer kept; NOT_KEPT
    when there is none (not read ahead, taken already, or dropped by a write)."""
    if not together():
        return NOT_KEPT
    rows = _turn.kept.get((_ROWS, model))
    return NOT_KEPT if not rows else rows.pop(key, NOT_KEPT)


def wrote(model: type | None, row_id: object = None) -> None:
    """Told of every write to a table, before it is sent (engine.prepared, and
    engine.connection.ServiceDatabase for what peewee builds): the rows of that model kept for
    the turn that it may change are dropped, so a later read goes to the database.
    `row_id`: the write changes that row alone (by its primary key). `model` None: a
    write to a table of no model, which drops every row kept."""
    if not in_a_turn() or not _turn.kept:
        return
    if model is None:
        for key in [key for key in _turn.kept if isinstance(key, tuple) and key[0] is _ROWS]:
            del _turn.kept[key]
        return
    rows = _turn.kept.get((_ROWS, model))
    if not rows:
        return
    if row_id is None:
        rows.clear()
        return
    for key in [key for key, row in rows.items()
                if row is not None and row.get_id() == row_id]:
        del rows[key]


# What peewee builds and runs is told to the turn too (ServiceDatabase.on_write).
ServiceDatabase.on_write = staticmethod(wrote)


def _made(store: dict, key: object, make: Callable[[], Kept]) -> Kept:
    """`store[key]`, made by `make()` if it is not there yet."""
    made = store.get(key)
    if made is None:
        made = store[key] = make()
    return made


def _counted_so_far() -> int:
    return len(_turn.on_commit) if in_a_turn() else 0


def _forget_since(kept: int) -> None:
    if in_a_turn():
        del _turn.on_commit[kept:]


class _TimedOut(Exception):
    """Set on a unit's future when its caller's budget or allowance runs out first."""


def _time_out(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(_TimedOut())


class _PartFailed(BaseException):
    """A part that may fail alone failed in a turn run without savepoints. Not an
    Exception: the unit's own handler for the part's failure must not take it for that
    failure, which it will see when the turn runs again with savepoints."""


class _TurnUndone(Exception):
    """A unit raised in a turn run without savepoints; the turn was rolled back."""


@contextlib.contextmanager
def savepoint() -> Iterator[None]:
    """A part of a unit of work that may fail alone: if it raises, its changes are undone
    and the exception propagates to the unit, which goes on. Outside a turn, or in a turn
    run with savepoints, it takes one; otherwise its failure has the turn run again so."""
    if _with_savepoints.get():
        kept = _counted_so_far()
        try:
            with database.atomic():
                yield
        except BaseException:
            _forget_since(kept)
            raise
        return
    try:
        yield
    except Exception as failure:
        raise _PartFailed from failure


# A unit waiting for its turn: the unit, its caller's future, the conflicts it met, what it
# asks to have done ahead.
Waiting = tuple[Unit, "asyncio.Future", int, Sequence[Ahead]]
# What a unit came to in its turn: its result, or what it raised.
Outcome = tuple[object, BaseException | None]


class GroupCommit:
    def __init__(self) -> None:
        self._waiting: list[Waiting] = []
        self._turn_running = False

    async def run(self, unit: Unit[T], ahead: Sequence[Ahead] = ()) -> T:
        """Run `unit()` in a transaction shared with the other units of this turn; return
        what it returns, or raise what it raised, once the transaction is committed.
        `ahead`: what the unit asks to have done before the turn's units run (`Ahead`).

        Within a `budget`, once it is spent OverBudget is raised and the circuit opens;
        within an `allowance`, once it is spent AllowanceSpent is raised, and the circuit
        is left alone. Either way a unit not started yet is then never run (one already
        running in the thread may still commit: a caller that spools on OverBudget stores
        a copy the inbox's dedup key recognises)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._enqueue(unit, future, conflicts=0, ahead=ahead)
        budgeted, allowed = _budget.get(), _allowance.get()
        if budgeted is None and allowed is None:
            return await future
        started = time.monotonic()
        budget_now = float("inf") if budgeted is None else budgeted.at(started)
        allowed_now = float("inf") if allowed is None else allowed.at(started)
        counted = [left for left in (budgeted, allowed) if left is not None]
        for left in counted:
            left.wait_started(started)
        # A timer, not asyncio.wait_for: this is every request's path, and wait_for
        # with the shield it would need costs about 25 µs of the loop per call.
        timer = loop.call_later(min(budget_now, allowed_now), _time_out, future)
        try:
            return await future
        except _TimedOut:
            if allowed_now < budget_now:
                raise AllowanceSpent("the run spent its allowance of time on the "
                                     "database") from None
            failure = OverBudget("the database did not answer within the call's budget")
            circuit = getattr(database.obj, "circuit", None)
            if circuit is not None:
                circuit.trip(failure)
            raise failure from None
        finally:
            timer.cancel()
            ended = time.monotonic()
            for left in counted:
                left.wait_ended(ended)

    def _enqueue(self, unit: Unit, future: asyncio.Future, conflicts: int,
                 ahead: Sequence[Ahead]) -> None:
        self._waiting.append((unit, future, conflicts, ahead))
        if not self._turn_running:
            self._turn_running = True
            # At the loop's next turn: the units asked for until then join this one.
            asyncio.get_running_loop().call_soon(self._start_turn)

    def _start_turn(self) -> None:
        # A unit whose caller has given up (its budget ran out) is not run.
        batch = [waiting for waiting in self._waiting if not waiting[1].done()]
        self._waiting = []
        if not batch:
            self._turn_running = False
            return
        turn = asyncio.get_running_loop().run_in_executor(
            DATABASE_THREAD, _run_batch, [(unit, ahead) for unit, _, _, ahead in batch])
        turn.add_done_callback(functools.partial(self._finish_turn, batch))

    def _finish_turn(self, batch: list[Waiting], turn: asyncio.Future) -> None:
        try:
            outcomes = turn.result()
        except BaseException as error:  # the thread could not run the turn at all
            outcomes = [(None, error)] * len(batch)
        for (unit, future, conflicts, ahead), (result, failure) in zip(batch, outcomes):
            if future.done():  # its caller gave up meanwhile
                continue
            if failure is None:
                future.set_result(result)
            elif is_conflict(failure) and conflicts < MAX_CONFLICTS:
                self._waiting.append((unit, future, conflicts + 1, ahead))
            else:
                future.set_exception(failure)
        if self._waiting:
            self._start_turn()
        else:
            self._turn_running = False


def _run_batch(units: list[tuple[Unit, Sequence[Ahead]]]) -> list[Outcome]:
    """In the database thread: each unit's (result, failure), committed together."""
    global turns_run
    turns_run += 1
    _turn.running = True
    try:
        try:
            return _run_turn(units, with_savepoints=False)
        except _TurnUndone:
            return _run_turn(units, with_savepoints=True)
    except Exception as failure:  # the commit itself, or the connection, failed
        return [(None, failure)] * len(units)
    finally:
        _turn.running = False


def _run_turn(units: list[tuple[Unit, Sequence[Ahead]]],
              with_savepoints: bool) -> list[Outcome]:
    """Each unit's (result, failure), all in one transaction. Without savepoints any
    unit's failure rolls back the turn and raises _TurnUndone."""
    token = _with_savepoints.set(with_savepoints)
    _turn.on_commit, _turn.at_end, _turn.kept = [], {}, {}
    for _, ahead in units:  # what a turn undone did ahead is undone with it
        for item in ahead:
            item.done = False
    try:
        if with_savepoints:
            with database.atomic():
                outcomes = [_attempt(unit) for unit, _ in units]
        else:
            outcomes = _run_plain(units)
    finally:
        _with_savepoints.reset(token)
    for callback in _turn.on_commit:
        callback()
    return outcomes


def _run_plain(units: list[tuple[Unit, Sequence[Ahead]]]) -> list[Outcome]:
    """The turn without savepoints, its writes held (engine.connection.HeldWrites): on
    PostgreSQL the BEGIN goes with the first statement, and the writes nobody reads the
    result of go with the next statement or the COMMIT; its units' like statements go
    together (`Ahead`, `at_turn_end`). A held write fails in whatever statement it was
    sent with, a unit's or the COMMIT: either undoes the turn, and the run with
    savepoints (holding nothing) finds which unit it was."""
    try:
        with database.holding_writes(), database.atomic():
            try:
                if database.sends_several_at_once:
                    _run_ahead([item for _, ahead in units for item in ahead])
                outcomes: list[Outcome] = [(unit(), None) for unit, _ in units]
                for ending in _turn.at_end.values():
                    ending()
                return outcomes
            except (Exception, _PartFailed) as failure:
                raise _TurnUndone from failure
    except DatabaseDown:
        raise
    except DatabaseError as failure:  # the COMMIT, with the writes held for it
        raise _TurnUndone from failure


def _run_ahead(items: list[Ahead]) -> None:
    """The items of every kind in one statement, where there are two or more: one item
    alone is left to its unit, whose own statement costs the same round trip."""
    if len(items) < 2:
        return
    by_kind: dict[type[Ahead], list[Ahead]] = {}
    for item in items:
        by_kind.setdefault(type(item).together_with or type(item), []).append(item)
    statements: list[AheadStatement] = []
    for kind in sorted(by_kind, key=lambda kind: not kind.writes):
        asked = kind.statements(by_kind[kind])
        if kind.writes and not asked:
            # Its writes are left to the units: so are the reads, which would otherwise
            # take their locks before the writes (`Ahead`: fewer deadlocks).
            return
        statements += asked
    if not statements:
        return
    returned = joined.rows_of_each(database, [(statement.sql, statement.params)
                                              for statement in statements])
    for statement, (names, rows) in zip(statements, returned):
        statement.take(names, rows)


def _attempt(unit: Unit) -> Outcome:
    kept = _counted_so_far()
    try:
        with database.atomic():
            return unit(), None
    except Exception as failure:
        _forget_since(kept)
        return None, failure


def raise_if_conflict(failure: BaseException) -> None:
    """For code that handles a database error itself: a conflict is not its to handle,
    the unit it runs in is run again."""
    if is_conflict(failure):
        raise failure
