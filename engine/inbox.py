"""The inbox: every accepted call is stored raw before it is handled, once per dedup key.

The sender's order is an invariant of the inbox, kept in one place. Each event has the
place its plugin declares from the sender's record (plugins.registry.Placement): a
`stream` (a Frappe document's changes, an SHKeeper invoice's callbacks; none for a Stripe
fact, which folds in any order) and a `version` in it (Frappe's `modified`; without one,
the arrival time). An event of a stream is handed to its plugin only when every event of
its stream before it (by version, then arrival, then id) is finished (processed, ignored,
rejected, or dead: given up by the retry policy or an operator), and it is told of a later
one handled already (`Transaction.overtaken_by`): its plugin then treats it as history.
An event behind an unfinished one is `held`: it stays stored, unhandled and due, and is
handed over once it is the first unfinished event of its stream (`release`, by the process
that finished the one before it; the inbox retry otherwise). Streams never wait for each
other, nor do one source's events for another's. Whatever path hands an event over (the
call itself, the spool drain, the retry, a replay) and whatever went before it (a
failure, a crash mid-drain, a second process), its position is read in the unit that
handles it (`POSITION`), after the locks of that unit are taken.

Handling runs the event's plugin. A plain function runs inside one transaction with the
status change, so its database changes and outbox rows happen once or not at all; an
async plugin (one that must wait on another system between steps) runs outside it and
is written to be safe to run again. Outbox rows are sent after the commit.

Longer than most: storing, deduplicating, handling and retrying a call are one
mechanism, and its parts are read together.
"""
import asyncio
import datetime
import functools
import hashlib
import inspect
import logging
import math
import operator
import time
from typing import (Any, Awaitable, Callable, Iterable, NamedTuple, Sequence, TypeAlias,
                    TypedDict, Unpack, cast)

import peewee

from engine import lograte
from clients.http import error_text
from models import Outbox, WebhookEvent, is_postgres
from engine import commits, outbox, retry, spool
from engine.outbox import Overtaken
from engine.claims import CLAIM_BATCH, Kept, claim, lease
from engine.commits import Ahead, AheadStatement, AllowanceSpent, raise_if_conflict, savepoint
from engine.contracts import Accepted, EngineContext, Registry, Stored
from engine.spool import Entry
from engine.db import UNAVAILABLE, due_by, locked, why_unavailable
from engine.prepared import InsertMany, InsertOnce, Prepared, slot
# The status, and what `process` says, of a fact whose order is not known yet
# (`Effects.wait_for_order`): neither finished nor due, it waits for a link to its order
# (`_wait`).
from engine.store.intake import LINKS, WAITING, wait_key, waits_for
from engine.store.orders import OrderRef, ahead_of as orders_ahead
from engine.transaction import Transaction

log = logging.getLogger("receiver.events")

# A plugin: called with the context, the decoded payload and the event's transaction; an
# async one waits on other systems between its steps, outside a transaction.
Plugin: TypeAlias = Callable[[EngineContext, Any, Transaction], Awaitable[None] | None]
# What handles a call in the unit that stores it, and its payload if read already.
Handling: TypeAlias = tuple[Plugin, Any]
# How a call handled in the unit that stored it went: (outcome, its transaction with the
# effects asked for, when its handling started by time.monotonic).
Handled: TypeAlias = tuple[str, "Transaction | None", float]
# During an outage every call is spooled: one line per minute and reason, with a count.
SPOOLED = lograte.Repeats(log)

FINAL_STATUSES = ("processed", "ignored", "rejected", "dead")
AWAITING_HANDLING = ("received", "failed")
# What `process` and `accept` say of an event that waits behind an earlier one of its stream.
HELD = "held"
# The longest text a sender may put in a column we index (order numbers, external ids,
# event types, idempotency keys, dedup keys built from them). PostgreSQL refuses an index
# row past about 2,700 bytes; 255 characters of UTF-8 are at most 1,020. Longer values are
# refused where they are read, before they reach the inbox or the spool.
MAX_KEY_LENGTH = 255
# Orders whose drained calls are handled at once (each order's one after another).
DRAIN_CONCURRENCY = 50
# How many streams the inbox retry hands over side by side (`retry_due`).
RETRY_CONCURRENCY = DRAIN_CONCURRENCY
# How long an event whose stream another process's transaction had waits before it is
# handed over again (`_release_after`): longer than a turn takes to commit.
BUSY_STREAM_SECONDS = 0.2
# Of a call stored not to be handled, the bytes of its body kept (`kept_of`).
KEPT_OF_UNHANDLED = 16 * 1024

# The events stored while the spool held calls it could not add them to, by SPOOL_DIR:
# let go by this process's drain once the spool is empty (`_unpark`). Forgotten with the
# process: a lease after they were stored, the inbox retry takes them as it takes any.
_PARKED: dict[str, set[int]] = {}

# The claims whose handling the database cut short (`_fail`), by SPOOL_DIR: event id ->
# the lease its claim wrote. Given back at the next inbox retry that reaches the database
# (`_give_back`), so that the event, and its stream behind it, wait out the outage, not a
# whole lease. Forgotten with the process: then the lease runs out, as after a crash.
_CLAIMS_CUT_SHORT: dict[str, dict[int, datetime.datetime]] = {}

# A SPOOL_DIR that cannot be used stays so until fixed: said every 10 minutes, not at
# every tick of the drain.
SPOOL_UNUSABLE = spool.LastingProblem(logging.getLogger("receiver.spool"),
                                      datetime.timedelta(minutes=10))

_EARLIER = WebhookEvent.alias("earlier")
_LATER = WebhookEvent.alias("later")


def arrival_version(moment: datetime.datetime) -> str:
    """An arrival time (aware) as a version: fixed-width UTC text that sorts as time."""
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


def _place(row: Any) -> Any:
    """An event's place in its stream: its version, then its arrival, then its id."""
    return peewee.Tuple(row.version, row.received_at, row.id)


def _of_its_stream(other: Any, row: Any) -> peewee.Expression:
    """`other` is an event of `row`'s stream: never so for a row of no stream."""
    return (other.source == row.source) & (other.stream == row.stream)


def _literals(statuses: Sequence[str]) -> list[peewee.Node]:
    """Statuses as literals, not parameters: every parameter of a prepared insert must be a
    slot."""
    return [peewee.SQL(f"'{status}'") for status in statuses]


def first_unfinished_before(row: Any = WebhookEvent) -> peewee.Select:
    """The id of the first unfinished event of `row`'s stream placed before it: what `row`
    waits behind. `row`: the table (the row a select reads) or an alias of it. Nothing for
    a row of no stream."""
    return (_EARLIER.select(_EARLIER.id).where(
        _of_its_stream(_EARLIER, row),
        _EARLIER.status.in_(_literals(AWAITING_HANDLING)),
        _place(_EARLIER) < _place(row))
        .order_by(_EARLIER.version, _EARLIER.received_at, _EARLIER.id).limit(peewee.SQL("1")))


# What a later change's handling may end as and the row still be history: acted on, or
# recorded by its path's rule for a state its document had left when it was found (a
# Frappe change the workflow log found late). An ignored change of its own is history
# of a later processed one: counting it changes nothing.
HANDLED_LATER = ("processed", "ignored")


def _handled_later(column: peewee.Field) -> peewee.Select:
    """`column` of the latest-placed event of the row's stream handled (HANDLED_LATER) with
    a later version than the row's: what makes the row history."""
    return (_LATER.select(column).where(
        _of_its_stream(_LATER, WebhookEvent), _LATER.status.in_(_literals(HANDLED_LATER)),
        _LATER.version > WebhookEvent.version)
        .order_by(_LATER.version.desc(), _LATER.id.desc()).limit(peewee.SQL("1")))


def _others_unfinished() -> peewee.ColumnBase:
    """Whether another event of the row's stream is unfinished: once the row is finished,
    the first of them is handed over (`release`)."""
    return peewee.fn.EXISTS(_LATER.select(peewee.SQL("1")).where(
        _of_its_stream(_LATER, WebhookEvent), _LATER.status.in_(_literals(AWAITING_HANDLING)),
        _LATER.id != WebhookEvent.id))


def overtaken() -> peewee.ColumnBase:
    """Whether an event of the row's stream placed after it is finished: handling the row
    now would hand it over out of its stream's order (a dead event the retries or an
    operator gave up, which let the later ones go). Nothing for a row of no stream."""
    return peewee.fn.EXISTS(_LATER.select(peewee.SQL("1")).where(
        _of_its_stream(_LATER, WebhookEvent), _LATER.status.in_(FINAL_STATUSES),
        _place(_LATER) > _place(WebhookEvent)))


NEW_EVENT = InsertOnce(WebhookEvent)
EVENT_BY_KEY = Prepared(lambda: WebhookEvent.select().where(
    WebhookEvent.source == slot(WebhookEvent.source),
    WebhookEvent.dedup_key == slot(WebhookEvent.dedup_key)))
# An event's status and its position in its stream, its row locked: what it waits behind,
# the later event handled already (its id and type), whether others of its stream are
# unfinished. Read in the unit that hands it over, after that unit's locks (a payment's
# order row; the event's own row), so that a second process's commit before them is seen.
# The first key of a stream's advisory lock (`_stream_taken`): the two-key space, apart
# from the scheduler's one-key job locks.
STREAM_LOCKS = 0x5354


def _stream_taken() -> peewee.ColumnBase:
    """On PostgreSQL, whether the row's stream is taken by another transaction; taken for
    this one's otherwise, until it ends. Two processes storing events of one stream at
    the same moment would each read the stream before the other's insert is committed,
    and each hand its event over as if it were alone: the earlier change acted on after
    the later one. Tried, not waited for: a turn takes the streams of its units one
    after another, and two processes' turns waiting for each other's would be deadlocks
    under load (one turn in two, undone and run again: the held backlog's bench stopped
    handling). The event whose stream is taken waits, held, and is handed over again a
    moment later (`_release_after`). SQLite has one writer: never taken."""
    if not is_postgres():
        return peewee.SQL("0")
    stream = peewee.fn.hashtext(WebhookEvent.source.concat("\n").concat(WebhookEvent.stream))
    return ~peewee.fn.pg_try_advisory_xact_lock(STREAM_LOCKS, stream)


POSITION = Prepared(lambda: locked(
    WebhookEvent.select(WebhookEvent.status, first_unfinished_before(),
                        _handled_later(_LATER.id), _handled_later(_LATER.event_type),
                        _others_unfinished(), _stream_taken())
    .where(WebhookEvent.id == slot(WebhookEvent.id))))


class Position(NamedTuple):
    """Where an event stands in its stream when it is handed over (`POSITION`): `behind`
    an unfinished earlier event of its stream, or its stream `busy` in another process's
    transaction (`_stream_taken`); either way it waits (`waits`)."""
    status: str
    behind: int | None
    overtaken_by: Overtaken | None
    others_unfinished: bool
    busy: bool

    @property
    def waits(self) -> bool:
        return self.behind is not None or self.busy


def position(event: WebhookEvent) -> Position:
    """`POSITION` of `event`, in a unit; its stream taken for the unit's transaction, or
    found taken by another process's (`_stream_taken`)."""
    status, behind, later_id, later_type, others, busy = POSITION.execute(
        id=event.id).fetchone()
    overtaken_by = None if later_id is None else Overtaken(later_id, later_type)
    event.stream_was_busy = bool(busy)
    # The flag is what the finishing process needs to know: `_release_after`.
    event.others_unfinished = bool(others)
    return Position(status, behind, overtaken_by, bool(others), bool(busy))


# A held event: stored, unhandled, and due as soon as it is the first unfinished event
# of its stream (`_due`). One stored as processed, to be handled in the unit that stored
# it, is put back as received, its attempt not made.
HOLD = Prepared(lambda: WebhookEvent.update({
    WebhookEvent.status: peewee.Case(None, [(WebhookEvent.status == "processed", "received")],
                                     WebhookEvent.status),
    WebhookEvent.attempts: peewee.Case(None, [(WebhookEvent.status == "processed", 0)],
                                       WebhookEvent.attempts),
    WebhookEvent.processed_at: None,
    WebhookEvent.next_attempt_at: slot(WebhookEvent.next_attempt_at),
    WebhookEvent.updated_at: slot(WebhookEvent.updated_at),
}).where(WebhookEvent.id == slot(WebhookEvent.id)), on_server=True)
def _finishing(count_the_attempt: bool) -> Prepared:
    counted = {WebhookEvent.attempts: WebhookEvent.attempts + 1} if count_the_attempt else {}
    return Prepared(lambda: WebhookEvent.update({
        WebhookEvent.status: slot(WebhookEvent.status),
        WebhookEvent.processed_at: slot(WebhookEvent.processed_at),
        WebhookEvent.updated_at: slot(WebhookEvent.updated_at),
        WebhookEvent.last_error: slot(WebhookEvent.last_error),
        WebhookEvent.next_attempt_at: None, **counted,
    }).where(WebhookEvent.id == slot(WebhookEvent.id)), on_server=True)


FINISH = _finishing(count_the_attempt=True)
# For an event written as processed in the same transaction: its attempt is counted.
FINISH_COUNTED = _finishing(count_the_attempt=False)


class Notice(TypedDict):
    """An admin e-mail that belongs to a call (outbox.tell_admin's subject, template and
    variables)."""
    subject: str
    template: str
    variables: dict[str, Any]


class CallFields(TypedDict, total=False):
    """What a call may carry besides its source, event type, dedup key and payload."""
    external_id: str | None
    order_number: str | None
    # "received" to be handled; "rejected" or "ignored" to be kept as it is.
    status: str
    last_error: str | None
    # Earlier dedup keys of the same call (a workflow call's dedup window).
    also_known_as: Sequence[str]
    # Earlier dedup keys as a range: every key from the first to the last, both included,
    # in the index's order. Read as one range of the (source, dedup_key) index instead of
    # one look-up per key, for keys no other call's key sorts among (a workflow body's
    # hourly keys). Spooled calls written before it lack it.
    also_known_between: tuple[str, str] | None
    # Written when the call is first stored, whichever way (the spool drain too).
    notice: Notice | None
    # Found by the reconciliation with Frappe, not delivered (domain/reconcile.py).
    reconciled: bool
    # Its place in its sender's record (plugins.registry.Placement): the stream whose
    # events wait for each other (None: it waits for nothing), and its version there
    # (None: its arrival).
    stream: str | None
    version: str | None


async def record(ctx: EngineContext, source: str, event_type: str, dedup_key: str,
                 payload: str | bytes, **fields: Unpack[CallFields]) -> Stored | None:
    """Store the call (in the database thread); return (event, created). A known dedup
    key, or one of `also_known_as` or `also_known_between` (earlier keys of the same
    call), returns the first copy.

    While the database is unavailable, or calls that came earlier wait in the spool, the
    call is appended to the spool instead and None is returned: it is durable, and the
    spool drain will store and handle it. If even the spool cannot be written, the
    database error propagates (503)."""
    call = _call(ctx, source, event_type, dedup_key, payload, **fields)
    where = _behind_the_spool(ctx, call)
    if where is JOINED:
        return None
    try:
        return await _store_now(ctx, call, parked=where is PARKED)
    except UNAVAILABLE as unavailable:
        _spool(ctx, call, unavailable)
        return None


def store(ctx: EngineContext, source: str, event_type: str, dedup_key: str,
          payload: str | bytes, **fields: Unpack[CallFields]) -> Stored:
    """`record` inside a unit of work that goes on with the event: (event, created); the
    database errors propagate."""
    return _store(ctx, _call(ctx, source, event_type, dedup_key, payload, **fields))


async def accept(ctx: EngineContext, source: str, event_type: str, dedup_key: str,
                 payload: str | bytes, in_background: bool = False,
                 send_within: float | None = None,
                 orders: Sequence[OrderRef] = (),
                 **fields: Unpack[CallFields]) -> Accepted:
    """The request path's way in: store the call as `record` does and, when it is new,
    handle it (after the answer, when `in_background`). Returns (event, created,
    outcome); the outcome is None when the call was not handled here.

    With `send_within` (seconds), the effects of a call handled here are waited on for
    that long at most once committed: sends still in flight go on after the return, and
    record their outcomes as usual.

    A plain plugin runs in the same unit of the group commit (engine.commits) as the
    storing: one transaction, one turn of the loop. Should the plugin raise, the event
    stays stored and is recorded as failed, in that transaction too.

    A call whose fact another finder may have stored under a key of its own (its
    plugin's `Placement.found_otherwise`: a workflow change its document's log found
    first) is looked for so too, in the storing's transaction when no key of the call is
    stored: it is then that event's copy, as it is when the spool drain stores it.

    `orders`: the orders its plugin's handling reads (a plugin's `orders_of`), read for
    the turn's units together, beside its event's insert (engine.store.orders)."""
    call = _call(ctx, source, event_type, dedup_key, payload, **fields)
    where = _behind_the_spool(ctx, call)
    if where is JOINED:
        return Accepted(None, False, None)
    if where is PARKED:
        return await _accept_parked(ctx, call)
    handled_by = _found_otherwise(ctx, call)
    new_event = (_NewEvent(ctx, call, handle_now=not in_background)
                 if handled_by is None and not call["also_known_as"] else None)
    try:
        event, created, handled = await _store_and_handle_together(
            ctx, call, not in_background, handled_by, new_event, orders_ahead(orders))
    except AllowanceSpent:
        raise  # a background run's own limit, not an outage: the run finds the call again
    except UNAVAILABLE as unavailable:
        _spool(ctx, call, unavailable)
        return Accepted(None, False, None)
    if handled is not None:
        return await _handled_here(ctx, event, created, handled, send_within)
    return await _handle_stored(ctx, event, created, in_background)


async def _accept_parked(ctx: EngineContext, call: Entry) -> Accepted:
    """`accept` for a call the spool could not take while calls wait there: stored, and
    handled once the spool is drained (`_store_now`)."""
    try:
        event, created = await _store_now(ctx, call, parked=True)
    except UNAVAILABLE as unavailable:
        _spool(ctx, call, unavailable)
        return Accepted(None, False, None)
    return Accepted(event, created, None)


async def _store_and_handle_together(
        ctx: EngineContext, call: Entry, handle_now: bool,
        handled_by: Callable[[], WebhookEvent | None] | None, new_event: "_NewEvent | None",
        ahead: Sequence[Ahead]) -> tuple[WebhookEvent, bool, Handled | None]:
    """(event, created, how its handling here went or None): the call stored and handled
    in one unit (`_store_and_handle`). Should the handling go wrong beyond recording its
    own failure, taking the storing with it, the call is stored alone, not handled (it is
    handled once stored, `_handle_stored`). The database's errors propagate."""
    if new_event is not None:
        ahead = (new_event, *ahead)
    try:
        event, created, handled = await ctx.commits.run(functools.partial(
            _store_and_handle, ctx, call, handle_now, handled_by, new_event), ahead)
    except UNAVAILABLE:
        raise
    except Exception:
        log.exception("%s %s: storing and handling it together failed; storing it alone",
                      call["source"], call["event_type"])
        alone = new_event and _NewEvent(ctx, call, handle_now=False)
        event, created = await ctx.commits.run(functools.partial(
            _store, ctx, call, handled_by=handled_by, ahead=alone),
            () if alone is None else (alone,))
        return event, created, None
    return event, created, handled


async def _handled_here(ctx: EngineContext, event: WebhookEvent, created: bool,
                        handled: Handled, send_within: float | None) -> Accepted:
    """`accept` for a call handled in the unit that stored it: its effects sent (waited
    on for `send_within` seconds at most), its outcome reported; the events of its stream
    waiting behind it handed over."""
    outcome, effects, started = handled
    if effects is not None:
        await _deliver(ctx, effects.rows, send_within)
        _hand_over_woken(ctx, effects)
    _report(ctx, event, outcome, started)
    await _release_after(ctx, event, outcome)
    return Accepted(event, created, outcome)


async def _handle_stored(ctx: EngineContext, event: WebhookEvent, created: bool,
                         in_background: bool) -> Accepted:
    """`accept` for a call stored and not handled in its unit: a new one awaiting its
    handling is handled now (after the answer, when `in_background`)."""
    if not created or event.status not in AWAITING_HANDLING:
        return Accepted(event, created, None)
    if in_background:
        ctx.background(process(ctx, event))
        return Accepted(event, created, None)
    return Accepted(event, created, await process(ctx, event))


async def _deliver(ctx: EngineContext, rows: list[Outbox], within: float | None) -> None:
    if within is None or not rows:
        await deliver_committed(ctx, rows)
        return
    # Kept by the context, so shutdown waits for the sends that outlive the request.
    sending = ctx.background(deliver_committed(ctx, rows))
    done, _ = await asyncio.wait({sending}, timeout=within)
    if done:
        sending.result()


def _store_and_handle(ctx: EngineContext, call: Entry, handle_now: bool,
                      handled_by: Callable[[], WebhookEvent | None] | None = None,
                      ahead: "_NewEvent | None" = None
                      ) -> tuple[WebhookEvent, bool, Handled | None]:
    """(event, created, (outcome, effects, started) or None when not handled).

    A new call of no stream whose plugin runs here (`_plain_handling`) is stored as
    `processed`, what the plugin's success makes it, in the same transaction: the row is
    written once, and updated only when the handling ends otherwise (rejected, failed, or
    the plugin raised). One of a stream is stored as received, so that the turn's other
    events of its stream, whose units may run before or after its own, see it unfinished
    until it is; its position is read before its plugin runs (`POSITION`). `ahead`: the
    call's event, inserted ahead of the turn's units (`_NewEvent`) when it is done."""
    registry = ctx.plugins[call["source"]]
    handling = (ahead.handling if ahead is not None and ahead.done
                else _handling_here(registry, call, handle_now))
    event, created = _store(ctx, call, as_processed=_stored_processed(call, handling),
                            handled_by=handled_by, ahead=ahead)
    if not created or handling is None:
        return event, created, None
    started = event.handling_began = time.monotonic()
    overtaken_by = None
    if event.stream is not None:
        placed = position(event)
        if placed.waits:
            _hold(ctx, event)
            return event, created, (HELD, None, started)
        # SQLite's unit holds the one write lock from its store's look on (BEGIN
        # IMMEDIATE): nothing committed between. PostgreSQL's may have met another's
        # commit of a copy since that look, before its stream was taken.
        copy = _copy_handled(ctx, event) if is_postgres() and handled_by else None
        if copy is not None:
            return event, created, (_finish_as_copy(ctx, event, copy), None, started)
        overtaken_by = placed.overtaken_by
    plugin, payload = handling
    # The row counts the attempt under way; should it fail, `_record_failure` counts it
    # from the attempts made before.
    event.attempts = 0
    try:
        with savepoint():
            if payload is None:  # a plain plugin's: unreadable, the handling fails
                payload = registry.decode(event.payload)
            outcome, effects = _run_plain(ctx, event, plugin, payload, first_handling=True,
                                          overtaken_by=overtaken_by)
    except Exception as exc:
        raise_if_conflict(exc)
        log.exception("%s event #%s (%s) failed", event.source, event.id, event.event_type)
        _record_failure(ctx, event, f"{type(exc).__name__}: {exc}")
        outcome, effects = "failed", None
    return event, created, (outcome, effects, started)


def _stored_processed(call: Entry, handling: Handling | None) -> bool:
    """Whether a new call is written as processed, to be handled in the unit that stores
    it (`_store_and_handle`)."""
    return handling is not None and call.get("stream") is None


def _hold(ctx: EngineContext, event: WebhookEvent) -> None:
    """`event` waits behind an earlier event of its stream: stored, not handled, and due
    as soon as it is the first unfinished event of its stream (`_due`)."""
    now = ctx.clock()
    HOLD.execute_later(id=event.id, next_attempt_at=now, updated_at=now)
    if event.status == "processed":  # as stored to be handled in its unit
        event.status, event.attempts = "received", 0
    event.processed_at, event.next_attempt_at = None, now


def _handling_here(registry: Registry, call: Entry, handle_now: bool) -> Handling | None:
    """`_plain_handling`, for a call to be handled now and stored as received."""
    if not handle_now or call["status"] != "received":
        return None
    return _plain_handling(registry, call)


def _plain_handling(registry: Registry, call: Entry) -> Handling | None:
    """(what handles `call` in the unit that stores it, its payload if read already), or
    None when the call is handled once stored, by `process`. A plain plugin handles it
    (its payload read where it runs); an async plugin's `plainly(payload)` does, when it
    has one and the call needs no other system (the payload it was given is kept, not
    read twice)."""
    plugin = registry.get(call["event_type"])
    if plugin is None:
        return None
    if not _is_async(plugin):
        return plugin, None
    plainly = getattr(plugin, "plainly", None)
    if plainly is None:
        return None
    try:
        payload = registry.decode(call["payload"])
        handle = plainly(payload)
    except Exception:  # unreadable: handled once stored, which records why
        return None
    return None if handle is None else (handle, payload)


def _call(ctx: EngineContext, source: str, event_type: str, dedup_key: str,
          payload: str | bytes, external_id: str | None = None,
          order_number: str | None = None, status: str = "received",
          last_error: str | None = None, also_known_as: Sequence[str] = (),
          also_known_between: tuple[str, str] | None = None,
          notice: Notice | None = None, reconciled: bool = False,
          stream: str | None = None, version: str | None = None) -> Entry:
    """`notice`: an admin notice (subject, template, variables) that belongs to the call,
    written when it is first stored, whichever way (the spool drain too). `reconciled`:
    found by the reconciliation with Frappe, not delivered (domain/reconcile.py).
    `stream`, `version`: its place (CallFields); a call of a stream without a version of
    its sender's is placed by its arrival, stamped now and kept in the spool line."""
    if status != "received":
        payload = kept_of(payload)
    if isinstance(payload, bytes):
        payload = payload.decode("utf-8", "replace")
    received_at = ctx.clock()
    if stream is not None and version is None:
        version = arrival_version(received_at)
    return {"source": source, "event_type": event_type, "dedup_key": dedup_key,
            "reconciled": reconciled, "stream": _storable(stream),
            "version": _storable(version),
            "also_known_as": list(also_known_as),
            "also_known_between": also_known_between and list(also_known_between),
            "external_id": _storable(external_id),
            "order_number": _storable(order_number), "status": status,
            "last_error": last_error and error_text(last_error),
            "payload": _storable(payload), "notice": notice,
            "received_at": received_at}


def kept_of(payload: str | bytes) -> str | bytes:
    """What is kept of a call stored not to be handled (rejected, or ignored as it came):
    the body whole up to KEPT_OF_UNHANDLED bytes, else that much of it with its size and
    SHA-256, enough to tell what came and to match it to the sender's own log. A sender
    posting large bodies that are never handled (500 malformed callbacks of 200 KB, each
    with the right key) would otherwise fill the database at the rate it can post."""
    raw = payload.encode("utf-8") if isinstance(payload, str) else payload
    if len(raw) <= KEPT_OF_UNHANDLED:
        return payload
    head = raw[:KEPT_OF_UNHANDLED].decode("utf-8", "ignore")
    return (f"{head}\n[cut: the first {KEPT_OF_UNHANDLED} of {len(raw)} bytes kept; "
            f"sha256 {hashlib.sha256(raw).hexdigest()}]")


def _storable(text: str | None) -> str | None:
    """PostgreSQL text cannot hold NUL. A raw NUL is not valid JSON, and no order number
    has one, so it is kept as U+FFFD rather than failing the whole call."""
    return text.replace("\x00", "\ufffd") if isinstance(text, str) else text


# Where `_behind_the_spool` puts a call.
JOINED = "joined the spool"
PARKED = "parked"


def spool_holds_calls(ctx: EngineContext) -> bool:
    """Whether calls wait in the spool: a call accepted now joins them (`_behind_the_spool`),
    to be stored and handled by the drain after them."""
    return spool.backlog(ctx.settings.spool_dir)


def _behind_the_spool(ctx: EngineContext, call: Entry) -> str | None:
    """Arrival order (engine.spool): while calls wait in the spool, this one joins them
    there, to be stored and handled after them (JOINED). When they wait there and the
    spool cannot take this one (a full disk), it is PARKED: stored in the database and
    not handled until the spool is drained, so that the calls before it are stored
    first and it waits behind those of its stream (`_store_now`). None when nothing
    waits."""
    if not spool_holds_calls(ctx):
        return None
    try:
        spool.append(ctx.settings.spool_dir,
                     {**call, "received_at": call["received_at"].isoformat()})
    except OSError:
        SPOOLED.exception(("unwritable",), "calls wait in the spool, and it cannot be "
                          "written: new calls are stored and handled after them")
        return PARKED
    SPOOLED.warning(("behind",), "calls wait in the spool: new calls join them")
    return JOINED


async def _store_now(ctx: EngineContext, call: Entry, parked: bool) -> Stored:
    """Store the call; a `parked` one with a lease, so that the inbox retry leaves it to
    the spool drain, which lets it go once the spool is empty (`_unpark`). The drain may
    never come (the process stops): it is handled a lease later all the same, behind
    whatever of its stream the drain has stored by then."""
    if not parked:
        return await ctx.commits.run(functools.partial(_store, ctx, call))
    stored = await ctx.commits.run(functools.partial(
        _store, ctx, call, next_attempt_at=ctx.clock() + lease(ctx)))
    if stored.created:
        _PARKED.setdefault(ctx.settings.spool_dir, set()).add(stored.event.id)
    return stored


async def drain_spool(ctx: EngineContext) -> int:
    """Move every spooled call into the inbox, and handle the ones new to it, file by
    file, until no call waits (calls that come meanwhile join the spool behind them).

    Returns the number of calls read from the spool."""
    read = 0
    # The calls stored hold their leases from then until each is handled: a call may
    # wait behind others, and its handling take long.
    async with _kept(ctx) as kept:
        async def store(call: Entry) -> Stored:
            stored = await ctx.db(functools.partial(store_spooled, ctx, call))
            if stored.created:
                kept.hold(stored.event)
            return stored
        while True:
            try:
                now_read = await spool.store_all(
                    ctx.settings.spool_dir, store,
                    functools.partial(_handle_drained, ctx, kept))
            except spool.Unusable as exc:
                SPOOL_UNUSABLE.warn(ctx.clock(), str(exc))
                return read
            read += now_read
            if not spool_holds_calls(ctx):
                await _unpark(ctx)
                return read
            if not now_read:
                return read


async def _unpark(ctx: EngineContext) -> None:
    """The calls parked while the spool could not take them (`_store_now`), due now that
    the calls before them are stored: each stream's handled in its order (`release`)."""
    parked = _PARKED.pop(ctx.settings.spool_dir, None)
    if not parked:
        return
    try:
        streams = await ctx.db(functools.partial(_make_due, ctx, sorted(parked)))
    except UNAVAILABLE:
        _PARKED.setdefault(ctx.settings.spool_dir, set()).update(parked)
        raise
    for source, stream in streams:
        await release(ctx, source, stream)


def _make_due(ctx: EngineContext, event_ids: list[int]) -> list[tuple[str, str]]:
    """The received events of `event_ids` due now; the streams they belong to (source,
    stream), in the order of their first event."""
    now = ctx.clock()
    (WebhookEvent.update(next_attempt_at=now, updated_at=now)
     .where(WebhookEvent.id.in_(event_ids), WebhookEvent.status == "received").execute())
    rows = (WebhookEvent.select(WebhookEvent.source, WebhookEvent.stream)
            .where(WebhookEvent.id.in_(event_ids), WebhookEvent.stream.is_null(False))
            .order_by(WebhookEvent.received_at, WebhookEvent.id))
    return list(dict.fromkeys((row.source, row.stream) for row in rows
                              if row.stream is not None))


async def _handle_drained(ctx: EngineContext, kept: Kept, drained: spool.Drained) -> None:
    """Before the spool file goes: should telling the administrator fail (the database
    gone again), the next drain finds the file and the quarantined calls again.

    Each stream's calls are handled one after another in the order they came, so that
    few wait behind the one before it (they would be held, and let go when that one
    ends); different streams' side by side (DRAIN_CONCURRENCY at once), or the drain would
    fall behind the calls that join the spool meanwhile. The order itself is the
    invariant's (`POSITION`), whatever the drain does."""
    if drained.quarantined:
        await ctx.db(functools.partial(_tell_admin_quarantined, ctx, drained.quarantined))
    by_stream: dict[object, list[WebhookEvent]] = {}
    for event in drained.created:
        stream = (event.source, event.stream) if event.stream else ("no stream", event.id)
        by_stream.setdefault(stream, []).append(event)
    room = asyncio.Semaphore(DRAIN_CONCURRENCY)

    async def in_turn(events: list[WebhookEvent]) -> None:
        async with room:
            for event in events:
                await process(ctx, event, kept)
                kept.let_go(event)
    await asyncio.gather(*(in_turn(events) for events in by_stream.values()))


def _tell_admin_quarantined(ctx: EngineContext, calls: list[Entry]) -> None:
    for call in calls:
        _tell_admin_of(ctx, call)


def _tell_admin_of(ctx: EngineContext, call: Entry) -> None:
    """Once per call (keyed by its dedup key): it was acknowledged, and nothing will
    handle it unless someone does. A quarantined line may lack any field."""
    source = str(call.get("source") or "unknown")
    identity = call.get("raw_base64") or f"{source}\n{call.get('dedup_key')}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:32]
    outbox.tell_admin(
        ctx, f"quarantined-{key}", f"Spooled {source} call quarantined", "call_quarantined",
        source=source, event_type=str(call.get("event_type") or "-")[:80],
        order=str(call.get("order_number") or "-")[:80],
        received_at=call.get("received_at"), reason=call["unstorable"],
        payload=str(call.get("payload") or call.get("raw") or "")[:4000])


def store_spooled(ctx: EngineContext, call: Entry) -> Stored:
    """Store a call read back from the spool; the database errors propagate.

    Its received_at may be older than a lease (the outage lasted): leased from now, so
    the inbox retry leaves it to the drain that handles it next. A copy of a fact another
    finder stored meanwhile (`_found_otherwise`) is that fact's duplicate, as on the
    request path."""
    return _store(ctx, call, next_attempt_at=ctx.clock() + lease(ctx),
                  handled_by=_found_otherwise(ctx, call))


def _found_otherwise(ctx: EngineContext,
                     call: Entry) -> Callable[[], WebhookEvent | None] | None:
    """What finds, in the storing's transaction, the event another finder stored for the
    call's fact under a key of its own, as its plugin declares it
    (`Placement.found_otherwise`); None when only the call's keys find it."""
    registry = ctx.plugins.get(call["source"])
    finder = (None if registry is None
              else registry.found_otherwise(call["event_type"], call["payload"]))
    if finder is None:
        return None
    return lambda: next(iter(finder(Transaction(ctx))), None)


def _copy_handled(ctx: EngineContext, event: WebhookEvent) -> WebhookEvent | None:
    """Another event of `event`'s fact, stored under a key of its own and handled already
    (`Placement.found_otherwise`), read in the unit that hands `event` over, its stream
    taken (`POSITION`). Two processes may each store their copy of one fact before the
    other's is committed (a Frappe change's webhook in one, its workflow log's entry in
    the other), neither finding the other's: the one handled second is then a copy,
    whose effects went out with the first."""
    registry = ctx.plugins.get(event.source)
    finder = None if registry is None else registry.found_otherwise(event.event_type,
                                                                    event.payload)
    if finder is None:
        return None
    return next((copy for copy in finder(Transaction(ctx, event))
                 if copy.id != event.id and copy.status in HANDLED_LATER), None)


def _finish_as_copy(ctx: EngineContext, event: WebhookEvent, copy: WebhookEvent) -> str:
    """`event` finished as `copy`'s duplicate: recorded, nothing sent, nobody told."""
    reason = f"the same fact as event #{copy.id}, handled first: nothing sent again"
    log.info("%s event #%s (%s): %s", event.source, event.id, event.event_type, reason)
    _finish(ctx, event.id, "ignored", reason)
    event.status = "ignored"
    return "ignored"


def _store(ctx: EngineContext, call: Entry,
           next_attempt_at: datetime.datetime | None = None,
           as_processed: bool = False,
           handled_by: Callable[[], WebhookEvent | None] | None = None,
           ahead: "_NewEvent | None" = None) -> Stored:
    """`as_processed`: the caller handles the call in this same transaction, and stored
    so it needs no UPDATE when that goes well (`_store_and_handle`). `handled_by`: what
    finds the event another finder stored for the call's fact (`_found_otherwise`).
    `ahead`: the call's event, inserted with the turn's others when it is done."""
    source, event_type = call["source"], call["event_type"]
    known = _EarlierKeys(call["also_known_as"], call.get("also_known_between"))
    existing = None
    if handled_by is not None:  # asked only when no key of the call is stored
        existing = known.first_stored(source) or handled_by()
    if existing is None:
        if ahead is not None and ahead.done:
            event = ahead.event
        else:
            event = (known.new_event_unless() if handled_by is None else NEW_EVENT).row(
                **known.slots(), **_event_values(ctx, call, as_processed, next_attempt_at))
        if event is not None:
            if call.get("notice"):
                _tell_admin_notice(ctx, event, call["notice"])
            return Stored(event, True)
        existing = known.first_stored(source) or find(ctx, source, call["dedup_key"])
        # The insert found a key taken, in this transaction: the row is there to read.
        assert existing is not None
    ctx.metrics.event_duplicate(source, event_type)
    # A run of the reconciliation finds every change of its window again, each run: its
    # own count says so (`reconcile.Counts.already`), not a line per change.
    log.log(logging.DEBUG if call.get("reconciled") else logging.INFO,
            "duplicate %s event %s (%s) ignored; first stored as #%s",
            source, event_type, call["external_id"] or call["dedup_key"], existing.id)
    return Stored(existing, False)


def _event_values(ctx: EngineContext, call: Entry, as_processed: bool,
                  next_attempt_at: datetime.datetime | None = None) -> dict[str, Any]:
    """The columns of a call's new event."""
    now = ctx.clock()
    return dict(
        source=call["source"], event_type=call["event_type"], dedup_key=call["dedup_key"],
        external_id=call["external_id"],
        order_number=call["order_number"], payload=call["payload"],
        status="processed" if as_processed else call["status"],
        processed_at=now if as_processed else None, attempts=1 if as_processed else 0,
        last_error=call["last_error"],
        received_at=call["received_at"], next_attempt_at=next_attempt_at,
        reconciled=bool(call.get("reconciled")), stream=call.get("stream"),
        version=_version_of(call), created_at=now, updated_at=now)


def _version_of(call: Entry) -> str | None:
    """A call's version; for one of a stream spooled before calls had one, its arrival."""
    if call.get("version") is None and call.get("stream") is not None:
        return arrival_version(call["received_at"])
    return call.get("version")


_KNOWN = WebhookEvent.alias("known")
# The new events of a turn (`_NewEvent`): each unless an event of its source is stored
# under a key of its dedup window (`first` to `last`, both NULL for a call without one).
# Inserted in the order of their keys, not of their arrival: two processes' turns holding
# copies of the same calls that came in different orders would otherwise each wait for
# the other's uncommitted key. The order of calls answered together is no order their
# senders could see (`_NewEvent`).
NEW_EVENTS = InsertMany(
    WebhookEvent, returning=lambda: (WebhookEvent.id, WebhookEvent.source,
                                     WebhookEvent.dedup_key),
    in_order_of=("source", "dedup_key"),
    extra={"first": WebhookEvent.dedup_key, "last": WebhookEvent.dedup_key},
    unless=lambda batch: batch("first").is_null() | ~peewee.fn.EXISTS(
        _KNOWN.select(peewee.SQL("1")).where(
            _KNOWN.source == batch("source"),
            _KNOWN.dedup_key.between(batch("first"), batch("last")))))


class _NewEvent(Ahead):
    """A call's event, inserted ahead of its turn's units together with the other calls'
    of the turn (engine.commits.Ahead): one statement instead of one round trip each.
    For a call whose earlier keys, if any, are one range, and not a late workflow call
    (`handled_by` reads before the insert). Once done, `event` is the new row, or None
    when a key of the call was stored already (the unit finds that row, as its own
    insert would have); `handling` is what handles the call in its unit.

    The insert of each row does not see the rows of the same statement: copies of one
    call in one turn under the same key are kept once by the unique key, but a copy whose
    dedup window holds another's key (they came either side of the hour) would not be
    seen, so a turn with such a pair inserts none of its events together. Which of two
    copies answered together is the first one kept is no order their senders could see.
    Nor do they see the events the turn's other units store after them, so no such unit
    may store a key a batched row's window holds: a late workflow call is stored under
    its change's key, the calls `record` and `store` keep have no window, and the spool
    drain stores its calls while live calls wait behind the spool. (When the spool
    cannot be written, live calls go to the database ahead of those it holds, and
    arrival order, dedup window included, is given up already: said in the log.)"""

    writes = True

    def __init__(self, ctx: EngineContext, call: Entry, handle_now: bool) -> None:
        self.ctx, self.call, self.handle_now = ctx, call, handle_now
        self.event: WebhookEvent | None = None
        self.handling: Handling | None = None

    @classmethod
    def statements(cls, items: list["_NewEvent"]) -> list[AheadStatement]:
        if _windows_overlap([item.call for item in items]):
            return []
        rows = []
        for item in items:
            registry = item.ctx.plugins[item.call["source"]]
            item.handling = _handling_here(registry, item.call, item.handle_now)
            first, last = item.call.get("also_known_between") or (None, None)
            rows.append({**_event_values(item.ctx, item.call,
                                         _stored_processed(item.call, item.handling)),
                         "first": first, "last": last})

        def take(names: list[str], returned: list[tuple]) -> None:
            inserted = {(source, key): event_id for event_id, source, key in returned}
            for item, values in zip(items, rows):
                event_id = inserted.pop((values["source"], values["dedup_key"]), None)
                item.event = (None if event_id is None
                              else NEW_EVENTS.written(event_id, values))
                item.done = True
        return [NEW_EVENTS.ahead_rows(rows, take)]


def _windows_overlap(calls: list[Entry]) -> bool:
    """Whether one call's dedup key lies in another's window (a key equal to another's
    is the unique key's to keep once)."""
    ranged = [call for call in calls if call.get("also_known_between")]
    for call in ranged:
        first, last = call["also_known_between"]
        if any(other["source"] == call["source"] and other["dedup_key"] != call["dedup_key"]
               and first <= other["dedup_key"] <= last for other in calls):
            return True
    return False


def _tell_admin_notice(ctx: EngineContext, event: WebhookEvent, notice: Notice) -> None:
    outbox.tell_admin(ctx, f"event-notice-{event.id}", notice["subject"], notice["template"],
                      event_id=event.id,
                      received_at=event.received_at.isoformat(timespec="seconds"),
                      **notice["variables"])


def _spool(ctx: EngineContext, call: Entry, unavailable: Exception) -> None:
    try:
        spool.append(ctx.settings.spool_dir,
                     {**call, "received_at": call["received_at"].isoformat()})
    except OSError as unwritable:
        SPOOLED.exception(("unwritable", lograte.key_of(unwritable)),
                          "database unavailable (%s) and the spool cannot be written either",
                          why_unavailable(unavailable))
        raise unavailable from None
    reason = why_unavailable(unavailable)
    SPOOLED.warning(("spooled", reason), "database unavailable (%s): calls spooled", reason)
    log.debug("%s event %s spooled", call["source"], call["event_type"])


def find(ctx: EngineContext, source: str, dedup_key: str) -> WebhookEvent | None:
    return EVENT_BY_KEY.first(source=source, dedup_key=dedup_key)


class _EarlierKeys:
    """A call's earlier dedup keys (`also_known_as`, `also_known_between`), and the
    statements that look them up. Each statement is built once per number of keys and
    whether there is a range: building one anew cost more than running it
    (docs/PERFORMANCE.md)."""

    _first_stored: dict[tuple[int, bool], Prepared] = {}
    _new_event_unless: dict[tuple[int, bool], InsertOnce] = {}

    def __init__(self, keys: Sequence[str], between: Sequence[str] | None) -> None:
        self.keys = keys
        self.between = between
        self.shape = (len(keys), between is not None)

    def slots(self) -> dict[str, str]:
        """The keys, by the slots of the statements' names (key0 and on, first, last)."""
        named = {f"key{n}": key for n, key in enumerate(self.keys)}
        if self.between is not None:
            named["first"], named["last"] = self.between
        return named

    def first_stored(self, source: str) -> WebhookEvent | None:
        """The first event of `source` stored under any of the keys, in one query; None
        when there is none."""
        if self.shape == (0, False):
            return None
        statement = self._first_stored.get(self.shape)
        if statement is None:
            statement = self._first_stored[self.shape] = Prepared(functools.partial(
                _first_stored_under, *self.shape))
        return statement.first(source=source, **self.slots())

    def new_event_unless(self) -> InsertOnce:
        """NEW_EVENT, unless an event is stored under one of the keys: the dedup window's
        read and the insert in one statement."""
        if self.shape == (0, False):
            return NEW_EVENT
        statement = self._new_event_unless.get(self.shape)
        if statement is None:
            statement = self._new_event_unless[self.shape] = InsertOnce(
                WebhookEvent, unless=functools.partial(
                    _stored_under, *self.shape, peewee.SQL("1")))
        return statement


def _first_stored_under(count: int, ranged: bool) -> "peewee.ModelSelect[WebhookEvent]":
    return _stored_under(count, ranged).order_by(WebhookEvent.id).limit(1)


def _stored_under(count: int, ranged: bool,
                  *columns: peewee.Node) -> "peewee.ModelSelect[WebhookEvent]":
    """The events of the source in the slot stored under one of `count` keys (slots key0
    and on) or, when `ranged`, under a key from the slot `first` to the slot `last`."""
    key = WebhookEvent.dedup_key
    under = [key.in_([slot(key, f"key{n}") for n in range(count)])] if count else []
    if ranged:
        under.append(key.between(slot(key, "first"), slot(key, "last")))
    return WebhookEvent.select(*columns).where(
        WebhookEvent.source == slot(WebhookEvent.source), functools.reduce(operator.or_, under))


async def process(ctx: EngineContext, event: WebhookEvent, kept: Kept | None = None) -> str:
    """Handle a stored event once, unless an earlier event of its stream is unfinished
    (HELD: it stays stored and due, and is handed over in its turn). Never raises: a
    failure is logged and recorded on the event, which the scheduler retries with backoff.
    One log line per event says how it went, keyed by the event's id. Once it is
    finished, the events of its stream waiting behind it are handled (`release`).

    The event's lease is kept while it is handled, by `kept` when the caller keeps it
    already, so no other process takes it however long the handling lasts."""
    outcome = await _process(ctx, event, kept)
    await _release_after(ctx, event, outcome)
    return outcome


async def _release_after(ctx: EngineContext, event: WebhookEvent, outcome: str) -> int:
    """`release` the stream of an event just finished when others of its stream wait
    (`Position.others_unfinished`, read when it was handed over; unknown: looked at);
    how many it handled. Whichever process held them, the one that finishes the event
    before them hands them over, at once. Never raises for the database.

    An event held because another process's transaction had its stream
    (`Position.busy`) is handed over again a moment later, once that one is committed,
    here: the other could not see it to release it."""
    if _again_soon(ctx, event, outcome):
        return 0
    if (outcome in FINAL_STATUSES and event.stream is not None
            and getattr(event, "others_unfinished", True)):
        try:
            return await release(ctx, event.source, event.stream)
        except UNAVAILABLE as exc:
            # Finished and committed all the same: the inbox retry hands the next over.
            log.warning("the events after event #%s not handed over, the database is "
                        "unavailable: %s", event.id, why_unavailable(exc))
    return 0


def _again_soon(ctx: EngineContext, event: WebhookEvent, outcome: str) -> bool:
    """Whether `event` was held because another process's transaction had its stream
    (`Position.busy`): then it is handed over again a moment later (`_release_soon`)."""
    if outcome != HELD or not getattr(event, "stream_was_busy", False):
        return False
    ctx.background(_release_soon(ctx, event))
    return True


async def _release_soon(ctx: EngineContext, event: WebhookEvent) -> None:
    await asyncio.sleep(BUSY_STREAM_SECONDS)
    assert event.stream is not None  # only an event of a stream is held
    try:
        await release(ctx, event.source, event.stream)
    except UNAVAILABLE as exc:
        log.warning("event #%s not handed over again, the database is unavailable: %s",
                    event.id, why_unavailable(exc))


async def release(ctx: EngineContext, source: str, stream: str) -> int:
    """Hand the first unfinished event of the stream to its plugin while it is due (a held
    event is; a failed one whose retry time has not come holds the rest), one after
    another; returns how many. What finishing an event of the stream calls for
    (`process`); the inbox retry does the same for every stream (`_due`)."""
    handled = 0
    while True:
        events = await claim(ctx, WebhookEvent, _due(ctx) & (WebhookEvent.source == source)
                             & (WebhookEvent.stream == stream), limit=1)
        if not events:
            return handled
        handled += 1
        outcome = await _process(ctx, events[0])
        _again_soon(ctx, events[0], outcome)
        if outcome not in FINAL_STATUSES or not events[0].others_unfinished:
            return handled


async def _process(ctx: EngineContext, event: WebhookEvent, kept: Kept | None = None) -> str:
    """`process` without `release`."""
    started = event.handling_began = time.monotonic()
    if kept is None:
        async with _kept(ctx, event):
            outcome = await _handle(ctx, event)
    else:
        outcome = await _handle(ctx, event)
    _report(ctx, event, outcome, started)
    return outcome


def _kept(ctx: EngineContext, *events: WebhookEvent) -> Kept:
    return Kept(ctx, WebhookEvent.status.in_(AWAITING_HANDLING), events)


def _report(ctx: EngineContext, event: WebhookEvent, outcome: str, started: float) -> None:
    seconds = time.monotonic() - started
    ctx.metrics.event_handled(event, outcome, seconds)
    log.info("event #%s %s %s %s %.1fms", event.id, event.source, event.event_type, outcome,
             1000 * seconds, extra={"event_id": event.id, "source": event.source,
                                    "event_type": event.event_type,
                                    "external_id": event.external_id,
                                    "outcome": outcome, "ms": round(1000 * seconds, 1)})


async def _handle(ctx: EngineContext, event: WebhookEvent) -> str:
    if event.status not in AWAITING_HANDLING:
        # Stored as rejected (malformed) or already settled: kept as it is, reason included.
        return event.status
    registry = ctx.plugins[event.source]
    plugin = registry.get(event.event_type)
    try:
        payload = registry.decode(event.payload)
        if plugin is None:
            await ctx.commits.run(functools.partial(_finish, ctx, event.id, "ignored"))
            return "ignored"
        if _is_async(plugin):
            tx = Transaction(ctx, event)
            if event.stream is not None:
                placed = await ctx.commits.run(functools.partial(_placed_for_handling, ctx,
                                                                 event))
                if placed is None or placed.waits:
                    return event.status if placed is None else HELD
                tx.overtaken_by = placed.overtaken_by
            await plugin(ctx, payload, tx)
            outcome = await ctx.commits.run(functools.partial(_conclude, ctx, event, tx))
        else:
            outcome, asked = await ctx.commits.run(
                functools.partial(_handle_in_transaction, ctx, event, plugin, payload),
                orders_ahead(registry.orders_of(event.event_type, payload)))
            if asked is None:
                return outcome
            tx = asked
    except Exception as exc:
        log.exception("%s event #%s (%s) failed", event.source, event.id, event.event_type)
        await _fail(ctx, event, f"{type(exc).__name__}: {exc}")
        return "failed"
    await deliver_committed(ctx, tx.rows)
    _hand_over_woken(ctx, tx)
    return outcome


def _hand_over_woken(ctx: EngineContext, effects: outbox.Effects) -> None:
    """The facts a committed handling woke (it linked their order to one of the ids they
    wait for): handled now, in the background, not at the inbox retry's next run."""
    if effects.woken:
        ctx.background(handle_woken(ctx, list(effects.woken)))


async def handle_woken(ctx: EngineContext, ids: Sequence[str]) -> int:
    """Hand the due facts waiting for one of `ids` to their plugins, one after another;
    how many. Never raises for the database: the inbox retry takes what is left.

    Those waiting for one of them are made due again first, now that the link is
    committed: one whose wait was written in the linking turn after the wake in it, which
    could not see it, is found so."""
    handled = 0
    # Held, it goes with the claim's read: no round trip of its own.
    wake: Callable[[], None] | None = functools.partial(
        Transaction(ctx).wake_facts_later, ids, ctx.clock())
    try:
        while True:
            events = await claim(ctx, WebhookEvent, _due(ctx) & waits_for(ids), limit=1,
                                 making_due=wake)
            wake = None
            if not events:
                return handled
            await _process(ctx, events[0])
            handled += 1
    except UNAVAILABLE as exc:
        log.warning("facts woken for %s not handled, the database is unavailable: %s",
                    ", ".join(ids), why_unavailable(exc))
    return handled


async def deliver_committed(ctx: EngineContext, rows: list[Outbox]) -> None:
    """Send effects whose cause is committed; never raises. Whatever happens while they
    are sent or their outcome recorded (the database gone, a statement refused), the call
    is durable and its answer stands: the effects are left to the scheduled sender, which
    takes them after their lease."""
    try:
        await outbox.deliver(ctx, rows)
    except UNAVAILABLE as exc:
        log.warning("%d effect(s) left to the scheduled sender, the database is "
                    "unavailable: %s", len(rows), why_unavailable(exc))
    except Exception:
        log.exception("%d effect(s) left to the scheduled sender", len(rows))


def _handle_in_transaction(ctx: EngineContext, event: WebhookEvent, plugin: Plugin,
                           payload: Any) -> tuple[str, Transaction | None]:
    """(outcome, the effects asked for); (status, None) when another handling had
    already settled the event, (HELD, None) when it waits behind an earlier one."""
    placed = _placed_for_handling(ctx, event)
    if placed is None:
        return event.status, None
    if placed.waits:
        return HELD, None
    return _run_plain(ctx, event, plugin, payload, overtaken_by=placed.overtaken_by)


def _placed_for_handling(ctx: EngineContext, event: WebhookEvent) -> Position | None:
    """The event's position (`POSITION`), held so (`_hold`) when it waits behind an
    earlier one of its stream; None when another handling has finished it meanwhile, or
    it is finished now as the copy of a fact handled already (`_copy_handled`):
    `event.status` says how."""
    placed = position(event)
    if placed.status in FINAL_STATUSES:
        event.status = placed.status
        return None
    if placed.waits:
        _hold(ctx, event)
        return placed
    copy = _copy_handled(ctx, event)
    if copy is not None:
        _finish_as_copy(ctx, event, copy)
        return None
    return placed


def _run_plain(ctx: EngineContext, event: WebhookEvent, plugin: Plugin, payload: Any,
               first_handling: bool = False,
               overtaken_by: Overtaken | None = None) -> tuple[str, Transaction]:
    """`first_handling`: the event was stored in this same unit (as processed when it is
    of no stream: `_stored_processed`). `overtaken_by`: a later event of its stream
    handled already (`Position`)."""
    tx = Transaction(ctx, event, first_handling)
    tx.overtaken_by = overtaken_by
    plugin(ctx, payload, tx)
    stored_processed = first_handling and event.stream is None
    return _conclude(ctx, event, tx, stored_processed=stored_processed), tx


def _is_async(plugin: object) -> bool:
    """An async plugin waits on other systems between its steps, outside a transaction."""
    return inspect.iscoroutinefunction(plugin) or inspect.iscoroutinefunction(
        getattr(plugin, "__call__", None))


def _conclude(ctx: EngineContext, event: WebhookEvent, effects: outbox.Effects,
              stored_processed: bool = False) -> str:
    """Processed; rejected with the reason when the plugin refused the event (no retry
    could change that); or, when the plugin kept part of its work and asked for the rest
    later, failed with a retry time, in the same transaction as that work.
    `stored_processed`: the event was written as processed in this transaction."""
    if effects.rejection:
        log.warning("%s event #%s (%s) rejected: %s", event.source, event.id,
                    event.event_type, effects.rejection)
        _finish(ctx, event.id, "rejected", effects.rejection, counted=stored_processed)
        return "rejected"
    if effects.recorded_only:
        log.warning("%s event #%s (%s) recorded, not handled: %s", event.source, event.id,
                    event.event_type, effects.recorded_only)
        _finish(ctx, event.id, "ignored", effects.recorded_only, counted=stored_processed)
        return "ignored"
    if effects.waiting_for is not None:
        _wait(ctx, event, effects.waiting_reason or "its order is not known yet",
              effects.waiting_for, effects)
        return WAITING
    if effects.retry_reason:
        log.warning("%s event #%s (%s) partly handled, retried later: %s", event.source,
                    event.id, event.event_type, effects.retry_reason)
        _record_failure(ctx, event, effects.retry_reason)
        return "failed"
    if not stored_processed:
        _finish(ctx, event.id, "processed")
    return "processed"


def _wait(ctx: EngineContext, event: WebhookEvent, reason: str, ids: Sequence[str],
          effects: outbox.Effects) -> None:
    """The fact waits for its order, with the ids that will find it: handled again when
    one of them is linked to an order (engine.store.intake.wake_facts), or looked at
    again after CARD_FACT_WAIT_ALERT_MINUTES, when the administrator is told, once, of a
    fact that has waited longer. A wait is no failure: its attempts are not counted.

    One of them linked by this process while the fact was handled (`LINKS`): its handling
    may have looked before the link was committed, and the link's wake before this wait
    was written. It is due at once instead, handed over again once this is committed."""
    now = ctx.clock()
    minutes = ctx.settings.card_fact_wait_alert_minutes
    waiting_for = " ".join(ids)
    keys = [*ids, *([wait_key("order", event.order_number)] if event.order_number else [])]
    if LINKS.since(keys, getattr(event, "handling_began", math.inf)):
        (WebhookEvent.update(status="received", waiting_for=waiting_for,
                             attempts=event.attempts, last_error=error_text(reason),
                             processed_at=None, updated_at=now, next_attempt_at=now)
         .where(WebhookEvent.id == event.id).execute())
        effects.woken.extend(ids)
        log.info("%s event #%s (%s): its order was linked while it was handled (%s); "
                 "handled again", event.source, event.id, event.event_type, waiting_for)
        return
    (WebhookEvent.update(status=WAITING, waiting_for=waiting_for, attempts=event.attempts,
                         last_error=error_text(reason), processed_at=None, updated_at=now,
                         next_attempt_at=now + datetime.timedelta(minutes=minutes))
     .where(WebhookEvent.id == event.id).execute())
    log.info("%s event #%s (%s) waits for its order (%s): %s", event.source, event.id,
             event.event_type, waiting_for or "nothing to find it by", reason)
    if now - event.received_at >= datetime.timedelta(minutes=minutes):
        outbox.tell_admin(
            ctx, f"fact-waiting-{event.id}", f"Event #{event.id} ({event.event_type}) waits "
            f"for its order", "fact_waiting", event=event, reason=reason,
            waiting_for=waiting_for, minutes=minutes,
            since=event.received_at.isoformat(timespec="seconds"))


def _finish(ctx: EngineContext, event_id: int, status: str, error: str | None = None,
            counted: bool = False) -> None:
    """`counted`: the row already counts this attempt (written as processed)."""
    now = ctx.clock()
    (FINISH_COUNTED if counted else FINISH).execute_later(
        id=event_id, status=status, processed_at=now, updated_at=now,
        last_error=error and error_text(error))


async def _fail(ctx: EngineContext, event: WebhookEvent, error: str) -> None:
    """Record the failure; should the database refuse that, the attempt is recorded all
    the same with a reason of our own, so the event still backs off and is given up in
    time instead of being handled again at every lease."""
    try:
        await ctx.commits.run(functools.partial(_record_failure, ctx, event, error))
        return
    except UNAVAILABLE:
        log.warning("could not record the failure of event #%s, the database is "
                    "unavailable; it is retried once the database answers", event.id)
        if event.next_attempt_at is not None:
            _CLAIMS_CUT_SHORT.setdefault(ctx.settings.spool_dir, {})[event.id] = \
                event.next_attempt_at
        return
    except Exception as refused:  # a driver refuses some values with its own errors
        log.exception("could not record the failure of event #%s", event.id)
        unrecorded = f"its failure could not be recorded: {type(refused).__name__}"
    try:
        await ctx.commits.run(functools.partial(_record_failure, ctx, event, unrecorded))
    except Exception:
        log.exception("could not record the failure of event #%s; it stays %s",
                      event.id, event.status)


def _record_failure(ctx: EngineContext, event: WebhookEvent, error: str) -> None:
    """Failed with a retry time; dead, with one admin e-mail, once the retry policy gives
    up (engine.retry). An event made due meanwhile (its order came in while it was
    handled: domain.intake) stays due: what it waited for may be there now."""
    now = ctx.clock()
    attempts = event.attempts + 1
    error = error_text(error)
    policy = retry.inbox(ctx.settings)
    if policy.gives_up(attempts):
        _give_up(ctx, event, attempts, error)
        return
    next_attempt_at = now + policy.delay(attempts)
    if _made_due_meanwhile(event, now):
        next_attempt_at = now
    (WebhookEvent.update(status="failed", attempts=attempts, updated_at=now, last_error=error,
                         processed_at=None, next_attempt_at=next_attempt_at)
     .where(WebhookEvent.id == event.id).execute())


def _made_due_meanwhile(event: WebhookEvent, now: datetime.datetime) -> bool:
    """Whether the event's next try was moved to now or before by someone else while it
    was handled: it is no longer the lease (or the nothing) its handling holds."""
    current = WebhookEvent.select(WebhookEvent.next_attempt_at).where(
        WebhookEvent.id == event.id).scalar()
    current = WebhookEvent.next_attempt_at.python_value(current)
    return current is not None and current != event.next_attempt_at and current <= now


def _give_up(ctx: EngineContext, event: WebhookEvent, attempts: int, error: str) -> None:
    now = ctx.clock()
    (WebhookEvent.update(status="dead", attempts=attempts, updated_at=now, last_error=error,
                         processed_at=None, next_attempt_at=None)
     .where(WebhookEvent.id == event.id).execute())
    log.error("%s event #%s (%s) dead after %d attempts: %s",
              event.source, event.id, event.event_type, attempts, error)
    outbox.tell_admin(
        ctx, f"event-{event.id}", f"Webhook event #{event.id} given up",
        "event_dead", event=event, attempts=attempts, error=error)


async def retry_due(ctx: EngineContext) -> int:
    """Claim the events due for handling one at a time, CLAIM_BATCH at most per run, and
    hand each over at once, with the events of its stream waiting behind it (`release`),
    up to RETRY_CONCURRENCY side by side; returns how many were handled.

    One at a time, so that each lease covers the one handling it was taken for: events
    claimed together and handled one after another would see their leases run out behind
    a slow one (balance.available's settlements, a Stripe lookup), and another process
    take them too. The one being handled keeps its lease however long it takes (`process`).

    Side by side: each event claimed is the first unfinished one of its stream (`_due`),
    so no two of one stream are handled at once, and a backlog held behind a cut, over
    many streams, drains at the pace the group commit takes their units rather than one
    stream after another (as the spool drain does, `_handle_drained`).

    Due: as `_due` says; the waiting facts whose time to be looked at again has come, and
    the claims whose handling the database cut short (`_CLAIMS_CUT_SHORT`), are made due
    first. A run that handled a whole batch is followed by the next at once
    (`stopped_at_its_batch`), in whichever process takes the job's lock then."""
    await ctx.db(functools.partial(Transaction(ctx).wake_facts_to_look_at, ctx.clock()))
    cut_short = _CLAIMS_CUT_SHORT.pop(ctx.settings.spool_dir, None)
    if cut_short:
        await ctx.db(functools.partial(_give_back, ctx, cut_short))
    room = asyncio.Semaphore(RETRY_CONCURRENCY)
    handing: list[asyncio.Future[int]] = []

    async def hand_over(event: WebhookEvent) -> int:
        try:
            outcome = await _process(ctx, event)
            return 1 + await _release_after(ctx, event, outcome)
        finally:
            room.release()
    try:
        while len(handing) < CLAIM_BATCH:
            await room.acquire()
            try:
                events = await claim(ctx, WebhookEvent, _due(ctx), limit=1)
            except BaseException:
                room.release()
                raise
            if events:
                handing.append(asyncio.ensure_future(hand_over(events[0])))
                continue
            room.release()
            under_way = [future for future in handing if not future.done()]
            if not under_way:
                break
            # An event that ends failed or dead lets the next of its stream be due: looked
            # for again once one of those under way ends.
            await asyncio.wait(under_way, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # What was handed over is finished, whatever stopped the claims.
        done = await asyncio.gather(*handing, return_exceptions=True)
    failures = [result for result in done if isinstance(result, BaseException)]
    if failures:
        raise failures[0]
    await ctx.db(functools.partial(tell_of_long_holds, ctx))
    return sum(cast(list[int], done))


def stopped_at_its_batch(handled: int) -> bool:
    """Whether a run of `retry_due` that handled `handled` events may have stopped at its
    batch, with events still due: the scheduler runs it again at once. A tick between
    runs left the last streams' first events of a backlog held behind a cut due for
    minutes at the default tick (docs/PERFORMANCE.md, "The held backlog after a cut")."""
    return handled >= CLAIM_BATCH


def _give_back(ctx: EngineContext, claims: dict[int, datetime.datetime]) -> None:
    """Make the events of `claims` due now, each only while its row still holds the lease
    its claim wrote and awaits its handling: one another process has claimed since, or
    whose handling has settled, is left as it is."""
    now = ctx.clock()
    for event_id, lease_until in claims.items():
        WebhookEvent.update(next_attempt_at=now, updated_at=now).where(
            WebhookEvent.id == event_id, WebhookEvent.next_attempt_at == lease_until,
            WebhookEvent.status.in_(AWAITING_HANDLING)).execute()


class Hold(NamedTuple):
    """What a held event waits behind: the first unfinished event of its stream before it,
    that event's status and its last error (why it is not finished)."""
    behind: int
    status: str
    reason: str | None


def holds(event_ids: Sequence[int]) -> dict[int, Hold]:
    """What each of `event_ids` that waits behind an earlier event of its stream waits
    behind (the console, the command line); the others are not in it. In a unit."""
    if not event_ids:
        return {}
    # (id, what it waits behind or None) rows: peewee's types know rows of models only.
    rows = cast(Iterable[tuple[int, int | None]], WebhookEvent.select(
        WebhookEvent.id, first_unfinished_before()).where(
            WebhookEvent.id.in_(list(event_ids)),
            WebhookEvent.status.in_(AWAITING_HANDLING)).tuples())
    behind = {event_id: first for event_id, first in rows if first is not None}
    earlier = {row.id: row for row in WebhookEvent.select(
        WebhookEvent.id, WebhookEvent.status, WebhookEvent.last_error)
        .where(WebhookEvent.id.in_(list(set(behind.values()))))}
    return {event_id: Hold(first, earlier[first].status, earlier[first].last_error)
            for event_id, first in behind.items() if first in earlier}


def held_count() -> tuple[int, datetime.datetime | None]:
    """How many events wait behind an earlier one of their order, and when the first of
    them came (None when none). In a unit."""
    # One (count, the earliest received_at as the database gives it) row.
    count, since = cast(tuple[int, object], WebhookEvent.select(
        peewee.fn.COUNT(WebhookEvent.id), peewee.fn.MIN(WebhookEvent.received_at))
        .where(WebhookEvent.status.in_(AWAITING_HANDLING),
               peewee.fn.EXISTS(first_unfinished_before())).tuples().get())
    return count, WebhookEvent.received_at.python_value(since)


def _held_long(ctx: EngineContext) -> list[Any]:
    """The streams whose first held event has waited longer than INBOX_HOLD_ALERT_MINUTES:
    rows with the columns `source`, `stream`, `order_number` (one of the stream's), `since`
    and `waiting`, which peewee's types, knowing a model's own columns only, cannot say."""
    since = ctx.clock() - datetime.timedelta(minutes=ctx.settings.inbox_hold_alert_minutes)
    held = (WebhookEvent.select(WebhookEvent.source, WebhookEvent.stream,
                                peewee.fn.MIN(WebhookEvent.order_number).alias("order_number"),
                                peewee.fn.MIN(WebhookEvent.received_at).alias("since"),
                                peewee.fn.COUNT(WebhookEvent.id).alias("waiting"))
            .where(WebhookEvent.status.in_(AWAITING_HANDLING),
                   peewee.fn.EXISTS(first_unfinished_before()))
            .group_by(WebhookEvent.source, WebhookEvent.stream)
            .having(peewee.fn.MIN(WebhookEvent.received_at) <= since))
    return list(held)


def tell_of_long_holds(ctx: EngineContext) -> int:
    """Tell the administrator, once for each event that holds them, of the streams whose
    events have waited behind it for longer than INBOX_HOLD_ALERT_MINUTES; how many
    streams. In a unit (the inbox retry's run)."""
    told = 0
    for row in _held_long(ctx):
        first = (WebhookEvent.select().where(
            WebhookEvent.source == row.source, WebhookEvent.stream == row.stream,
            WebhookEvent.status.in_(AWAITING_HANDLING))
            .order_by(WebhookEvent.version, WebhookEvent.received_at, WebhookEvent.id)
            .first())
        if first is None:
            continue
        since = WebhookEvent.received_at.python_value(row.since)
        outbox.tell_admin(
            ctx, f"order-held-{first.id}", f"Order {row.order_number}: events wait behind "
            f"event #{first.id}", "order_held", order=row.order_number, event=first,
            waiting=row.waiting, since=since.isoformat(timespec="seconds"),
            minutes=ctx.settings.inbox_hold_alert_minutes)
        told += 1
    return told


def _due(ctx: EngineContext) -> peewee.Expression:
    """The events to hand to their plugins now: each the first unfinished event of its
    stream (or of no stream), and either held (due since it was held), stored but left
    unhandled for a whole lease (the process that took it died, or its claim lapsed), or
    failed with its retry time come."""
    now = ctx.clock()
    received = (WebhookEvent.status == "received") & (
        due_by(WebhookEvent.next_attempt_at, now)
        | (WebhookEvent.next_attempt_at.is_null()
           & (WebhookEvent.received_at <= now - lease(ctx))))
    retry = (WebhookEvent.status == "failed") & due_by(WebhookEvent.next_attempt_at, now)
    return (received | retry) & ~peewee.fn.EXISTS(first_unfinished_before())
