"""The outbox: effects on other systems, written in the transaction of their cause and
sent after it commits. A send that fails stays pending with its error and is retried
with backoff; a refusal that no retry can change, or too many attempts, makes it dead.

Longer than most: writing, claiming, ordering and sending effects are one mechanism,
and its parts are read together.
"""
import asyncio
import contextlib
import datetime
import functools
import hashlib
import json
import logging
import time
from typing import Any, Iterable, Iterator, NamedTuple, TypeVar

from peewee import SQL, Case, ColumnBase, Expression, Field, ModelAlias, ModelSelect, fn

from engine import lograte
from clients.http import Result
from models import POSTGRES_FIELD_TYPES, Outbox, WebhookEvent, is_postgres
from engine import commits, retry
from engine.claims import claim, lease
from engine.commits import Unit
from engine.contracts import EngineContext, SendOutcome
from engine.db import UNAVAILABLE, due_by
from engine.destinations import DESTINATION_OF, ORDERED_KINDS, Destination
from engine.prepared import InsertMany, InsertOnce, Prepared, slot, write_later

log = logging.getLogger("receiver.outbox")
REPEATS = lograte.Repeats(log)

# Keys of the admin e-mails that say a row or an event was given up; such an e-mail
# given up itself is only logged, not announced again.
ADMIN_NOTICE_PREFIX = "admin-notice-"
# A drain's batch records the outcomes of its finished sends this often.
RECORD_EVERY_SECONDS = 0.5
# The rows of a kind one claim of the scheduled sender takes. A backlog's claims, sends
# and outcomes share the loop and the database thread with the live calls: in batches
# of 50 rather than 100 (engine.claims.CLAIM_BATCH), a 30 s outage's backlog went out at
# 1,180 rather than 1,500 jobs a second on SQLite, and the live calls' p99 meanwhile rose
# x1.9 rather than x2.2-2.3 (docs/PERFORMANCE.md).
SEND_BATCH = 50
# Recorded in place of an outcome the database refused: the attempt still counts, so the
# row backs off and is given up in time instead of being sent again at every lease.
UNRECORDED = Result.failed("sent, but its outcome could not be recorded; sent again later")
# A sender holding at least this much less than a whole lease does not re-take the row
# (a write and a commit) before sending: the re-take would add too little to matter.
RETAKE_SLACK = datetime.timedelta(seconds=1)

# Rows made due in one statement when a destination is back (a bound on its parameters).
RELEASE_BATCH = 500

T = TypeVar("T")
NEW_EFFECT = InsertOnce(Outbox)
# A row is pending (to send at next_attempt_at) or waiting (its destination is not
# configured: it is sent once the service starts with it configured); either holds the
# later rows of its order and kind behind it.
UNSENT = ("pending", "waiting")


def _earlier_unsent_of(earlier: "type[Outbox] | ModelAlias[Outbox]", than: ColumnBase,
                       of_other_events: bool,
                       row: type[Outbox] | None = None) -> "ModelSelect[Outbox]":
    """A select, from `earlier` (Outbox or an alias of it), of an unsent row of the order
    and kind in the slots, written before the row whose id is `than`: of another event,
    or without one, when `of_other_events`. `row`: the table whose columns give the
    order, kind and event instead of the slots (the rows being inserted, in RETURNING),
    of another event only for a row that has one. The unsent statuses are literals, not
    parameters: every parameter of a prepared insert must be a slot."""
    order_number, kind, event = ((row.order_number, row.kind, row.event) if row is not None
                                 else (slot(Outbox.order_number), slot(Outbox.kind),
                                       slot(Outbox.event)))
    query = earlier.select(earlier.id).where(
        earlier.order_number == order_number, earlier.kind == kind,
        earlier.status.in_([SQL(f"'{status}'") for status in UNSENT]), earlier.id < than)
    if of_other_events:
        other = earlier.event.is_null() | (earlier.event != event)
        query = query.where(event.is_null() | other if row is not None else other)
    return query


def _earlier_unsent(of_other_events: bool) -> Prepared:
    """The earlier unsent row before the row whose id is in the slot `id`."""
    return Prepared(lambda: _earlier_unsent_of(Outbox, slot(Outbox.id), of_other_events)
                    .limit(1))


EARLIER_UNSENT = _earlier_unsent(of_other_events=False)
EARLIER_UNSENT_OF_OTHER_EVENTS = _earlier_unsent(of_other_events=True)


def _earlier_unsent_exists(of_other_events: bool,
                           row: type[Outbox] | None = None) -> ColumnBase:
    """`_earlier_unsent` as an expression of the row being inserted (in its RETURNING):
    whether an unsent row of its order and kind was written before it. `row`: as
    `_earlier_unsent_of`."""
    return fn.EXISTS(_earlier_unsent_of(Outbox.alias("earlier"), Outbox.id, of_other_events,
                                        row))


# NEW_EFFECT for a job or workflow action of an order: the insert also says whether it is
# behind an earlier unsent one (`note_whether_behind`), in the same round trip.
NEW_ORDERED_EFFECT = {
    of_other_events: InsertOnce(Outbox, also_returning=(
        ("behind", functools.partial(_earlier_unsent_exists, of_other_events)),))
    for of_other_events in (False, True)}
# The effects asked for in a turn whose like statements go together (`_TurnEffects`):
# each with whether an unsent row stored before the turn holds it behind (of another
# event, for a row that has one: as NEW_ORDERED_EFFECT says). The rows of the same
# statement are not seen: `_TurnEffects` looks at the turn's own.
NEW_EFFECTS = InsertMany(Outbox, returning=lambda: (
    Outbox.id, Outbox.idempotency_key, _earlier_unsent_exists(True, row=Outbox)))


def _update_of(*fields: Field) -> Prepared:
    return Prepared(lambda: Outbox.update({field: slot(field) for field in fields})
                    .where(Outbox.id == slot(Outbox.id)), on_server=True)


# What each outcome of a send writes. An outcome that counts an attempt writes the
# attempt too (LAST_ATTEMPT): the database copies it into `attempts` (models.Attempt).
LAST_ATTEMPT = (Outbox.last_attempt_at, Outbox.last_status_code, Outbox.last_duration_ms,
                Outbox.last_reply)
WAITING = _update_of(Outbox.status, Outbox.last_error, Outbox.updated_at)
SENT = _update_of(Outbox.status, Outbox.sent_at, Outbox.last_error, Outbox.attempts,
                  Outbox.updated_at, *LAST_ATTEMPT)
GIVEN_UP = _update_of(Outbox.status, Outbox.last_error, Outbox.attempts, Outbox.updated_at,
                      *LAST_ATTEMPT)
RETRY = _update_of(Outbox.last_error, Outbox.next_attempt_at, Outbox.attempts,
                   Outbox.updated_at, *LAST_ATTEMPT)


def stable_key(*parts: object) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:40]


# Until effects were named (docs/DECISIONS.md, "Effects are named"), an effect without
# a key was keyed by its position among the effects its event's handling asked for. Rows
# stored so are still recognised, kind by kind, when their event is handled again (a
# retry, a replay): this many positions are looked at, more than any handling asks for.
POSITIONS_RECOGNISED = 64


def positional_key(event: WebhookEvent, kind: str, position: int) -> str:
    """The key an effect of `event` had when effects were keyed by position."""
    return f"{kind}-{stable_key(event.source, event.dedup_key, kind, position)}"


def _positional_rows(event: WebhookEvent) -> dict[str, list[int]]:
    """The positions of the event's rows stored under positional keys, by kind."""
    keys = {(row.kind, row.idempotency_key) for row in Outbox.select(
        Outbox.kind, Outbox.idempotency_key).where(Outbox.event == event.id)}
    return {kind: [position for position in range(POSITIONS_RECOGNISED)
                   if (kind, positional_key(event, kind, position)) in keys]
            for kind in {kind for kind, _ in keys}}


class Overtaken(NamedTuple):
    """A later event of an event's stream, handled before it (engine.inbox.Position)."""
    id: int
    event_type: str


class Effects:
    """What one event asks of other systems, collected inside the event's transaction.

    Every effect is named, so that handling the same event again adds nothing, whatever
    order the handling asks in: by its `purpose` among its event's effects (the key is
    derived from the event, the kind and the purpose), or by its own `key` where the
    effect belongs to something wider than one event (one alert per paid order, say) or
    has no event. Asking twice for one purpose in one handling is a mistake, and raises.

    `first_handling`: the event was stored in this same unit of work, so none of its
    effects can be stored yet (the rows stored before effects were named are not looked
    for). `for_scheduler`: nobody sends the rows once committed; they are written due at
    once, for the scheduled sender.

    In a turn whose like statements go together (engine.commits.together) the effects
    are written at the turn's end, with the turn's others, in one statement: `rows` has
    them from then on, before the COMMIT (what it is in a unit is not read before)."""

    def __init__(self, ctx: EngineContext, event: WebhookEvent | None = None,
                 first_handling: bool = False, for_scheduler: bool = False) -> None:
        self.ctx = ctx
        self.event = event
        self.for_scheduler = for_scheduler
        # The rows added (Outbox instances, as written): `deliver` sends them once committed.
        self.rows: list[Outbox] = []
        # The keys derived from purposes in this handling, to refuse a purpose asked twice.
        self.named: list[str] = []
        # Counts every effect asked for, as the positional keys did.
        self.position = 0
        # The event's rows stored under positional keys, by kind, and those an effect of
        # this handling has been recognised as (read once, when first needed).
        self.positional: dict[str, list[int]] | None = (
            {} if first_handling or event is None else None)
        self.recognised: set[tuple[str, int]] = set()
        self.retry_reason: str | None = None
        # Set by `reject`: the event is refused for good, with this reason.
        self.rejection: str | None = None
        # Set by `record_only`: the event is kept, not acted on, for this reason.
        self.recorded_only: str | None = None
        # Set by the inbox before the plugin runs: a later event of the event's stream
        # handled already, which makes this one history to its plugin.
        self.overtaken_by: Overtaken | None = None
        # Set by `wait_for_order`: the event is a fact whose order is not known yet, kept
        # waiting with the ids that will find it, for this reason.
        self.waiting_for: tuple[str, ...] | None = None
        self.waiting_reason: str | None = None
        # The ids of orders linked by this handling that waiting facts were woken for
        # (engine.store.payments.wake_facts): the inbox handles those once committed.
        self.woken: list[str] = []

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """A part of the handling that may fail alone: its database changes and the
        effects it asked for are undone together, and the exception propagates."""
        rows_before, named_before = len(self.rows), len(self.named)
        try:
            with commits.savepoint():
                yield
        except BaseException:
            del self.rows[rows_before:]
            del self.named[named_before:]
            raise

    async def transaction(self, work: Unit[T]) -> T:
        """Run `work()` in a transaction shared with concurrent requests (engine.commits)
        and return what it returns once committed; if it raises, the effects it asked for
        are undone with its changes."""
        rows_before, named_before, position_before = (
            len(self.rows), len(self.named), self.position)
        recognised_before = set(self.recognised)
        retry_before, rejection_before = self.retry_reason, self.rejection
        recorded_before = self.recorded_only
        waiting_before = self.waiting_for, self.waiting_reason, list(self.woken)

        def run_from_the_state_before() -> T:  # a unit may be run again (engine.commits)
            del self.rows[rows_before:]
            del self.named[named_before:]
            self.position, self.recognised = position_before, set(recognised_before)
            self.retry_reason, self.rejection = retry_before, rejection_before
            self.recorded_only = recorded_before
            self.waiting_for, self.waiting_reason = waiting_before[:2]
            self.woken = list(waiting_before[2])
            return work()
        try:
            return await self.ctx.commits.run(run_from_the_state_before)
        except Exception:
            del self.rows[rows_before:]
            del self.named[named_before:]
            raise

    def retry_later(self, reason: str) -> None:
        """Keep what the handling has done so far, and handle the event again later (it
        ends `failed` with a retry time instead of `processed`)."""
        self.retry_reason = reason

    def reject(self, reason: str) -> None:
        """The event asks for something that cannot be (a move its order cannot make):
        it ends `rejected` with the reason, and what the handling asked for is kept (a
        plugin that rejects asks for nothing first)."""
        self.rejection = reason

    def record_only(self, reason: str) -> None:
        """The event is a fact kept for the record, not acted on (a state change older
        than one already handled): it ends `ignored` with the reason; what the handling
        asked for is kept (a notice to the administrator, say)."""
        self.recorded_only = reason

    def wait_for_order(self, reason: str, ids: Iterable[str]) -> None:
        """The event is a fact about an order not known yet: it ends `waiting`, with the
        reason and the ids (`kind:id`, engine.store.payments.wait_key) whose link to an
        order will find it, and is handled again when one of them is linked (`woken`),
        or looked at again after CARD_FACT_WAIT_ALERT_MINUTES. What the handling asked
        for is kept (a plugin that waits asks for nothing first)."""
        self.waiting_reason = reason
        self.waiting_for = tuple(dict.fromkeys(ids))

    def add(self, kind: str, payload: dict[str, Any], purpose: str | None = None,
            key: str | None = None, order_number: str | None = None) -> None:
        """Write one effect, named by `purpose` (among its event's effects) or by `key`,
        unless it is stored already."""
        position, self.position = self.position, self.position + 1
        if key is None:
            key = self._named_key(kind, purpose)
            if self._stored_by_position(kind, position):
                return
        now = self.ctx.clock()
        values = dict(
            event=self.event.id if self.event else None, kind=kind,
            order_number=order_number, payload=json.dumps(payload), idempotency_key=key,
            # While the cause's own request sends the row, the scheduler leaves it alone.
            next_attempt_at=now if self.for_scheduler else now + lease(self.ctx),
            created_at=now, updated_at=now)
        if commits.together():
            commits.at_turn_end(_TurnEffects, _TurnEffects).asked.append((self, values))
            return
        row = _insert_effect(values)
        if row is not None:
            self.rows.append(row)

    def _named_key(self, kind: str, purpose: str | None) -> str:
        if self.event is None or not purpose:
            raise TypeError(f"a {kind} effect needs a key, or a purpose among its event's")
        event = self.event
        key = f"{kind}-{stable_key(event.source, event.dedup_key, kind, 'for', purpose)}"
        if key in self.named:
            raise ValueError(f"two {kind} effects of one event for the same purpose "
                             f"{purpose!r}")
        self.named.append(key)
        return key

    def _stored_by_position(self, kind: str, position: int) -> bool:
        """Whether the event has a row of this kind stored under a positional key that no
        other effect of this handling was recognised as: the one of this position if
        there is one (the handling asks in the order it did then), else the first."""
        if self.positional is None and self.event is not None:
            self.positional = _positional_rows(self.event)
        stored = [at for at in (self.positional or {}).get(kind, ())
                  if (kind, at) not in self.recognised]
        if not stored:
            return False
        self.recognised.add((kind, position if position in stored else stored[0]))
        return True


    def job(self, action: str, payload: dict[str, Any], purpose: str | None = None,
            key: str | None = None) -> None:
        self.add("job", {"action": action, "payload": payload}, purpose, key,
                 payload.get("order_number"))

    def workflow_action(self, doctype_setting: str, name: str, action: str,
                        purpose: str | None = None, key: str | None = None,
                        order_number: str | None = None) -> None:
        """The action on the document `name` of the doctype the setting
        `doctype_setting` names (`workflow_doctype`): the row keeps the setting, and the
        doctype it names when written for the record; the send reads it anew
        (`action_doctype`), so a misspelled doctype fixed and the service restarted is
        enough for `outbox retry` to send the action right."""
        self.add("workflow_action", {
            "doctype": getattr(self.ctx.settings, doctype_setting),
            "doctype_setting": doctype_setting, "name": name, "action": action},
            purpose, key, order_number)

    def email(self, to: Iterable[str], subject: str, template: str,
              purpose: str | None = None, key: str | None = None,
              order_number: str | None = None, **variables: Any) -> None:
        """Render `template`.txt and .html now, so what is sent is what was true then."""
        env = self.ctx.templates
        text = env.get_template(f"{template}.txt").render(**variables)
        html = env.get_template(f"{template}.html").render(**variables)
        self.add("email", {"to": list(to), "subject": subject, "text": text, "html": html},
                 purpose, key, order_number)

    def alert(self, text: str, purpose: str | None = None, key: str | None = None,
              order_number: str | None = None) -> None:
        self.add("alert", {"text": text}, purpose, key, order_number)


def _ordered(values: dict[str, Any]) -> bool:
    return values["order_number"] is not None and values["kind"] in ORDERED_KINDS


def _insert_effect(values: dict[str, Any]) -> Outbox | None:
    """The row written, `behind` set; None when its key is stored already."""
    ordered = _ordered(values)
    insert = NEW_ORDERED_EFFECT[values["event"] is not None] if ordered else NEW_EFFECT
    row = insert.row(**values)
    if row is not None:
        row.behind = bool(getattr(row, "behind", False))
    return row


class _TurnEffects:
    """The effects asked for in a turn whose like statements go together, written when
    its units are done (engine.commits.at_turn_end): what each row's own insert would
    have come to, in one statement."""

    def __init__(self) -> None:
        self.asked: list[tuple[Effects, dict]] = []

    def __call__(self) -> None:
        if len(self.asked) == 1:
            effects, values = self.asked[0]
            row = _insert_effect(values)
            if row is not None:
                effects.rows.append(row)
            return
        inserted = {key: (row_id, behind) for row_id, key, behind
                    in NEW_EFFECTS.rows([values for _, values in self.asked])}
        # The ordered rows written so far in this statement: (order, kind, event) each.
        written: list[tuple] = []
        for effects, values in self.asked:
            new = inserted.pop(values["idempotency_key"], None)
            if new is None:
                continue
            row = NEW_EFFECTS.written(new[0], values)
            row.behind = False
            if _ordered(values):
                mine, event = (values["order_number"], values["kind"]), values["event"]
                row.behind = new[1] or any(
                    (order, kind) == mine and (event is None or other != event)
                    for order, kind, other in written)
                written.append((*mine, event))
            effects.rows.append(row)


# Each sender calls `await confirm_held()` right before its request goes out: it raises
# _TakenElsewhere when another sender has claimed the row meanwhile.

async def _send_job(ctx: EngineContext, payload: dict[str, Any], row: Outbox,
                    confirm_held: "_LeaseCheck") -> Result:
    await confirm_held()
    return await ctx.worker.dispatch(payload["action"], payload["payload"], row.idempotency_key)


def action_doctype(settings: Any, payload: dict[str, Any]) -> str:
    """The doctype a workflow action goes to: what its setting says now. Rows written
    before the setting was kept name WORKFLOW_DOCTYPE's (every action is on it)."""
    return str(getattr(settings, payload.get("doctype_setting", "workflow_doctype")))


async def _send_workflow_action(ctx: EngineContext, payload: dict[str, Any], row: Outbox,
                                confirm_held: "_LeaseCheck") -> Result:
    await confirm_held()
    return await ctx.workflow.apply_action(action_doctype(ctx.settings, payload),
                                           payload["name"], payload["action"])


async def _send_email(ctx: EngineContext, payload: dict[str, Any], row: Outbox,
                      confirm_held: "_LeaseCheck") -> Result:
    if not ctx.mailer.configured:  # only logged, on the loop
        await confirm_held()
        return await ctx.mailer.send(payload["to"], payload["subject"], payload["text"],
                                     payload.get("html"), key=row.idempotency_key)
    # Confirmed from the mail thread: a message may wait for a thread longer than a lease.
    return await ctx.mailer.send(payload["to"], payload["subject"], payload["text"],
                                 payload.get("html"), before=confirm_held.in_thread,
                                 key=row.idempotency_key)


async def _send_alert(ctx: EngineContext, payload: dict[str, Any], row: Outbox,
                      confirm_held: "_LeaseCheck") -> Result:
    await confirm_held()
    return await ctx.telegram.send(payload["text"])


SENDERS = {
    "job": _send_job,
    "workflow_action": _send_workflow_action,
    "email": _send_email,
    "alert": _send_alert,
}


class _LeaseCheck:
    """The last check before a row's request goes out: the sender still holds the row
    (its lease is about whole, or re-taking it succeeds), else _TakenElsewhere."""

    def __init__(self, ctx: EngineContext, row: Outbox) -> None:
        self.ctx, self.row = ctx, row
        self.loop = asyncio.get_running_loop()

    async def __call__(self) -> None:
        """On the loop: a re-take is a write, made in the database thread."""
        if not _lease_ample(self.ctx, self.row):
            self._held(await self.ctx.commits.run(functools.partial(
                _retake, self.ctx, self.row.id, self.row.next_attempt_at)))

    def in_thread(self) -> None:
        """In a mail thread: the re-take is asked of the loop, and made in the database
        thread like any other write; the mail thread waits for it."""
        if not _lease_ample(self.ctx, self.row):
            asyncio.run_coroutine_threadsafe(self(), self.loop).result()

    def _held(self, held_until: datetime.datetime | None) -> None:
        if held_until is None:
            raise _TakenElsewhere
        self.row.next_attempt_at = held_until


class _TakenElsewhere(Exception):
    """Another sender claimed the row after this one was given it."""


async def send(ctx: EngineContext, row: Outbox, live: bool = False) -> SendOutcome:
    """Send one outbox row and record the outcome; returns the Result, or None when
    another sender took the row over before it went out (that one sends it). `live`: the
    request that caused the row sends it, in the share of calls in flight kept for such
    sends (engine.destinations)."""
    result = await _attempt(ctx, row, live)
    if result is not None:
        try:
            await ctx.commits.run(functools.partial(record_outcome, ctx, row, result))
        except UNAVAILABLE:
            raise
        except Exception:
            log.exception("outbox %s %s: its outcome could not be recorded", row.id, row.kind)
            await ctx.commits.run(functools.partial(
                record_outcome, ctx, row, UNRECORDED))
    return result


async def _attempt(ctx: EngineContext, row: Outbox, live: bool = False) -> SendOutcome:
    """`send` without recording the outcome: the Result, or None."""
    destination = ctx.destinations.of(row.kind)
    row.last_attempt_at, started = ctx.clock(), time.monotonic()
    try:
        async with destination.slot(live):
            # Timed from the request going out, not from the wait for a free connection.
            row.last_attempt_at, started = ctx.clock(), time.monotonic()
            result = await SENDERS[row.kind](ctx, json.loads(row.payload), row,
                                             _LeaseCheck(ctx, row))
    except _TakenElsewhere:
        log.info("outbox %s %s not sent here: another sender has taken it", row.id, row.kind)
        return None
    except UNAVAILABLE:
        raise  # the lease could not be re-taken, so nothing was sent
    except Exception as exc:
        # A row whose sender raises would otherwise stay pending for good and hold up
        # its order's later effects. Only the type is kept: an exception's text may
        # quote a URL with a token in it.
        log.exception("outbox %s %s: its sender raised", row.id, row.kind)
        result = Result.failed(f"{type(exc).__name__} raised while sending", retryable=False)
    row.last_duration_ms = round((time.monotonic() - started) * 1000)
    row.last_status_code = result.status or None
    row.last_reply = result.reply or None
    destination.observe(result, row.id)
    return result


def _last_attempt(row: Outbox) -> dict[str, Any]:
    """The values of LAST_ATTEMPT for a row `_attempt` has tried."""
    return {field.name: getattr(row, field.name) for field in LAST_ATTEMPT}


def _lease_ample(ctx: EngineContext, row: Outbox) -> bool:
    """The row's lease has about a whole lease left (it was created or claimed a moment
    ago), and that is more than a send may take: a request that waits for a free
    connection and then for its answer (one outbound timeout each)."""
    left = row.next_attempt_at - ctx.clock()
    send_at_most = datetime.timedelta(seconds=2 * ctx.settings.outbound_timeout_seconds)
    return left >= lease(ctx) - RETAKE_SLACK and left > send_at_most + RETAKE_SLACK


def _retake(ctx: EngineContext, row_id: int,
            held: datetime.datetime) -> datetime.datetime | None:
    """Push the row's lease one lease ahead, if it still holds the lease `held` this
    sender was given: the new lease's end, or None when another sender has claimed it
    since (a send that waited for a mail thread or on a slow peer past its lease), so
    the row goes out once. It changes nothing but the database: run again (its turn
    undone), it finds the row as it was."""
    now = ctx.clock()
    held_until = now + lease(ctx)
    taken = (Outbox.update(next_attempt_at=held_until, updated_at=now)
             .where(Outbox.id == row_id, Outbox.status == "pending",
                    Outbox.next_attempt_at == held).execute())
    return held_until if taken else None


def record_outcomes(ctx: EngineContext, rows: list[Outbox],
                    results: list[SendOutcome]) -> None:
    """A batch's outcomes in one unit: the rows sent in one statement (a drain sends
    hundreds a second, and one statement each would hold the database thread, and the
    live requests' turns behind it, for as long), the others one by one."""
    sent = [row for row, result in zip(rows, results)
            if result is not None and result.configured and result.ok and not result.logged]
    if sent:
        now = ctx.clock()
        write_later(Outbox.update(status="sent", sent_at=now, last_error=None,
                                  attempts=Outbox.attempts + 1, updated_at=now,
                                  **{field.name: _by_row(field, sent)
                                     for field in LAST_ATTEMPT})
                    .where(Outbox.id.in_([row.id for row in sent])))
        for row in sent:
            ctx.metrics.effect_sent(row.kind, "sent")
    recorded = set(sent)
    for row, result in zip(rows, results):
        if result is not None and row not in recorded:
            try:
                with commits.savepoint():
                    record_outcome(ctx, row, result)
            except Exception as failure:  # the others' outcomes are kept all the same
                commits.raise_if_conflict(failure)
                log.exception("outbox %s %s: its outcome could not be recorded", row.id,
                              row.kind)
                record_outcome(ctx, row, UNRECORDED)


def _by_row(field: Field, rows: list[Outbox]) -> ColumnBase:
    """Each row's own value of `field`, chosen by its id, for one UPDATE of them all."""
    case = Case(Outbox.id, [(row.id, field.db_value(getattr(row, field.name)))
                            for row in rows])
    if is_postgres():
        # PostgreSQL types a CASE of text (or only NULL) parameters as text, which a
        # timestamp or integer column refuses.
        return case.cast(POSTGRES_FIELD_TYPES.get(field.field_type, field.field_type))
    return case


def record_outcome(ctx: EngineContext, row: Outbox, result: Result) -> None:
    now = ctx.clock()
    if not result.configured:
        # Nothing was tried: the effect waits for its peer to be configured, without
        # using up its attempts; `release_waiting` makes it due when it is.
        WAITING.execute_later(id=row.id, status="waiting", last_error=result.error,
                              updated_at=now)
        log.warning("outbox %s %s waits for its destination: %s", row.id, row.kind,
                    result.error)
        return
    attempts = row.attempts + 1
    if result.logged:
        # The settings say to log such effects (no Telegram, no SMTP): final, and the
        # row says that it was not sent, and why.
        GIVEN_UP.execute_later(id=row.id, status="logged", last_error=result.error,
                               attempts=attempts, updated_at=now, **_last_attempt(row))
        ctx.metrics.effect_sent(row.kind, "logged")
    elif result.ok:
        SENT.execute_later(id=row.id, status="sent", sent_at=now, last_error=None,
                           attempts=attempts, updated_at=now, **_last_attempt(row))
        ctx.metrics.effect_sent(row.kind, "sent")
    elif not result.retryable or retry.outbox(ctx.settings).gives_up(attempts):
        GIVEN_UP.execute_later(id=row.id, status="dead", last_error=result.error,
                               attempts=attempts, updated_at=now, **_last_attempt(row))
        ctx.metrics.effect_sent(row.kind, "dead")
        log.error("outbox %s %s dead after %d attempt(s): %s",
                  row.id, row.kind, attempts, result.error)
        if not row.idempotency_key.startswith(ADMIN_NOTICE_PREFIX):
            # What the destination's check finds to fix (Frappe: its Workflow read
            # permission) is said with it: often why a refusal could not be read back.
            tell_admin(ctx, f"outbox-{row.id}", f"Outbox effect #{row.id} given up",
                       "outbox_dead", row=row, attempts=attempts, error=result.error,
                       warnings=ctx.destinations.of(row.kind).warnings)
    else:
        RETRY.execute_later(id=row.id, last_error=result.error,
                            next_attempt_at=now + retry.outbox(ctx.settings).delay(attempts),
                            attempts=attempts, updated_at=now, **_last_attempt(row))
        ctx.metrics.effect_sent(row.kind, "retry")
        # A peer that is down fails every effect alike: one line, then a count.
        REPEATS.warning((row.kind, result.error), "outbox %s %s failed (attempt %d), will "
                        "retry: %s", row.id, row.kind, attempts, result.error)


async def deliver(ctx: EngineContext, rows: list[Outbox]) -> list[SendOutcome]:
    """Send the rows an Effects has just added, once committed, concurrently; each outcome
    is recorded, none raises. They are as written: nobody else sends a row during the
    lease it was created with (or claimed, for rows read back).

    Not sent here, and left to the scheduled sender: a job or workflow action whose order
    still has an earlier one of its kind unsent (from an earlier event), so that each
    order's jobs, and its actions, keep the order they were caused in; and a row whose
    destination is down (it goes out once a probe finds the destination back), unless
    it is the time for a probe: then the row is that probe."""
    if not rows:
        return []
    rows = sorted(rows, key=lambda row: row.id)
    unknown = [row for row in rows if getattr(row, "behind", None) is None]
    if unknown:  # rows read back, not written by an Effects
        await ctx.commits.run(lambda: [note_whether_behind(row) for row in unknown])
    # A row whose destination is not configured is "sent" all the same: nothing goes
    # out, and it is recorded as waiting, not as pending behind the earlier one.
    queued = [row for row in rows if not _sendable_now(ctx, row)]
    if queued:
        await ctx.commits.run(functools.partial(_hand_to_scheduler, ctx,
                                                [row.id for row in queued]))
    return await asyncio.gather(*(
        send(ctx, row, live=True) for row in rows if row not in queued))


def _sendable_now(ctx: EngineContext, row: Outbox) -> bool:
    destination = ctx.destinations.of(row.kind)
    if not destination.configured:
        return True  # nothing goes out: it is recorded as waiting, behind nothing
    if row.behind:
        return False
    return destination.up or destination.take_probe()


def note_whether_behind(row: Outbox) -> Outbox:
    """Set `row.behind`: whether an earlier job or workflow action of its order is still
    unsent (from an earlier event), so that this one must wait for the scheduled sender.
    Read in the transaction that writes the row (Effects.add), in the database thread,
    so the loop that sends it after the commit asks the database nothing."""
    row.behind = False
    if row.order_number is None or row.kind not in ORDERED_KINDS:
        return row
    if row.event_id is None:
        earlier = EARLIER_UNSENT.first(order_number=row.order_number, kind=row.kind, id=row.id)
    else:
        earlier = EARLIER_UNSENT_OF_OTHER_EVENTS.first(
            order_number=row.order_number, kind=row.kind, id=row.id, event=row.event_id)
    row.behind = earlier is not None
    return row


def _hand_to_scheduler(ctx: EngineContext, row_ids: list[int]) -> None:
    now = ctx.clock()
    Outbox.update(next_attempt_at=now, updated_at=now).where(Outbox.id.in_(row_ids)).execute()


def _due(now: datetime.datetime, kinds: Iterable[str]) -> Expression:
    """Pending rows of these kinds whose time has come; a job or workflow action only
    when no earlier row of its order and kind is unsent (a dead one holds nothing)."""
    earlier = Outbox.alias("earlier")
    unsent_before = earlier.select(earlier.id).where(
        earlier.order_number == Outbox.order_number, earlier.kind == Outbox.kind,
        earlier.status.in_(UNSENT), earlier.id < Outbox.id)
    return ((Outbox.status == "pending") & due_by(Outbox.next_attempt_at, now)
            & Outbox.kind.in_(kinds)
            & (Outbox.kind.not_in(ORDERED_KINDS) | ~fn.EXISTS(unsent_before)))


# Rows read for a probe of a destination whose effects all wait on a backoff: the first
# of them not held by a send is taken.
PROBE_CANDIDATES = 20


async def _claim_due(ctx: EngineContext) -> list[Outbox]:
    """The due rows of the destinations that are up, SEND_BATCH of each kind at most,
    and one row of each destination that is down and due for a probe. Each kind's rows
    are claimed apart (in one turn): the (kind, status, id) index gives one kind's
    oldest first, where rows of several kinds would all be read and sorted, a backlog's
    too (docs/PERFORMANCE.md)."""
    now = ctx.clock()
    destinations = ctx.destinations
    rows: list[Outbox] = []
    up = destinations.kinds(lambda destination: destination.up)
    for claimed in await asyncio.gather(*(claim(ctx, Outbox, _due(now, [kind]), SEND_BATCH)
                                          for kind in up)):
        rows += claimed
    for kind in destinations.kinds(lambda destination: destination.take_probe()):
        probe = await claim(ctx, Outbox, _due(now, [kind]), limit=1)
        if not probe:
            # Every row on a retry's backoff (they failed as it went down): the probe is
            # the first of them in line, or the destination would stay down, back or not,
            # until a backoff ends; not one a send holds, which would go out twice.
            later = now + datetime.timedelta(seconds=retry.outbox(ctx.settings).cap_seconds)
            backed_off = await ctx.commits.run(functools.partial(
                _backed_off, ctx, _due(later, [kind]), limit=PROBE_CANDIDATES))
            if backed_off:
                probe = await claim(ctx, Outbox, _due(later, [kind])
                                    & (Outbox.id == backed_off[0]), limit=1)
        rows += probe
    return rows


async def send_due(ctx: EngineContext) -> int:
    """The scheduled sender: claim the due rows, send them, and go on while sends succeed
    (the next effect of an order becomes due when the one before it is sent). Returns the
    number sent. Waiting rows whose destination is configured now (the service was
    started with it) are made due first.

    A backlog (a destination back after an outage) is sent in one run, without waiting
    for the next tick between batches: as fast as the destination's calls in flight
    allow. The run ends when nothing is due or a whole batch failed (the destination is
    unwell again: its backoff and probes take over). A destination found back (by a
    probe of this run, say) has its effects on a backoff made due first: back means
    sent, not each at its own retry time. A destination whose sends have all failed for
    OUTBOUND_DOWN_AFTER_SECONDS is taken for down after the run's sends."""
    await ctx.commits.run(functools.partial(release_waiting, ctx))
    sent = 0
    while True:
        await _release_those_back(ctx)
        rows = await _claim_due(ctx)
        if not rows:
            break
        results = await _send_batch(ctx, rows)
        succeeded = sum(1 for result in results if result is not None and result.ok)
        sent += succeeded
        if not succeeded:
            break
    # After the sends: one that went through shows the destination well.
    for destination in ctx.destinations:
        destination.down_if_failing_too_long()
    return sent


async def _release_those_back(ctx: EngineContext) -> None:
    """The effects on a backoff of every destination found back since (by a probe of this
    run, say) made due now, so they go in this same run."""
    back = [destination for destination in ctx.destinations if destination.back]
    if back:
        kinds = ctx.destinations.kinds(lambda destination: destination in back)
        await ctx.commits.run(functools.partial(release_backed_off, ctx, kinds))
        for destination in back:
            destination.back = False


async def _send_batch(ctx: EngineContext, rows: list[Outbox]) -> list[SendOutcome]:
    """Send claimed rows concurrently, recording the outcomes of those finished every
    RECORD_EVERY_SECONDS in one unit (so a slow send holds back no other row's record
    past its lease); their Results. A send that raises (the database gone while it
    re-took its lease) is raised once the others' outcomes are recorded."""
    attempts = {asyncio.ensure_future(_attempt(ctx, row)): row for row in rows}
    pending, failure = set(attempts), None
    try:
        while pending:
            done, pending = await asyncio.wait(pending, timeout=RECORD_EVERY_SECONDS)
            finished = [attempt for attempt in done if attempt.exception() is None]
            failure = failure or next(
                (attempt.exception() for attempt in done if attempt.exception()), None)
            if finished:
                await ctx.commits.run(functools.partial(
                    record_outcomes, ctx, [attempts[attempt] for attempt in finished],
                    [attempt.result() for attempt in finished]))
    finally:
        for attempt in pending:  # only when recording failed: the database is gone
            attempt.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    if failure is not None:
        raise failure
    return [attempt.result() for attempt in attempts]


def release_waiting(ctx: EngineContext) -> int:
    """Make due now every waiting row whose destination is configured now: one update on
    the status index, finding rows only after a start with a new setting. Returns how
    many."""
    kinds = ctx.destinations.kinds(lambda destination: destination.configured)
    if not kinds:
        return 0
    now = ctx.clock()
    released = (Outbox.update(status="pending", next_attempt_at=now, updated_at=now)
                .where(Outbox.status == "waiting", Outbox.kind.in_(kinds)).execute())
    if released:
        log.info("outbox: %d waiting effect(s) due now, their destination is configured",
                 released)
    return released


def _backed_off(ctx: EngineContext, condition: Expression,
                limit: int | None = None) -> list[int]:
    """The ids, oldest first, of the pending rows meeting `condition` that wait on a
    retry's backoff, not on a send: a row a sender holds (claimed or re-taken, or written
    by a request that sends it) has its next try exactly one lease after its last update,
    and may be mid-send."""
    now = ctx.clock()
    held = lease(ctx)
    rows = (Outbox.select(Outbox.id, Outbox.next_attempt_at, Outbox.updated_at)
            .where(condition, Outbox.status == "pending", Outbox.next_attempt_at > now)
            .order_by(Outbox.id).limit(limit))
    return [row.id for row in rows if row.next_attempt_at - row.updated_at != held]


def release_backed_off(ctx: EngineContext, kinds: list[str]) -> int:
    """A destination found back: its effects waiting on a retry's backoff
    (`_backed_off`) are made due now (they go in this run, each order's in its sequence,
    `_due`), not each at its own time up to hours later. Returns how many."""
    now = ctx.clock()
    waiting = _backed_off(ctx, Outbox.kind.in_(kinds))
    for start in range(0, len(waiting), RELEASE_BATCH):
        (Outbox.update(next_attempt_at=now, updated_at=now)
         .where(Outbox.id.in_(waiting[start:start + RELEASE_BATCH])).execute())
    if waiting:
        log.info("outbox: %d effect(s) waiting on a retry made due now, their destination "
                 "is back", len(waiting))
    return len(waiting)


def tell_admin(ctx: EngineContext, key: str, subject: str, template: str,
               **variables: Any) -> None:
    """One e-mail to the administrator, keyed so it exists once; the scheduled sender
    sends it on its next run. Without ADMIN_EMAIL it is only logged."""
    admin = ctx.settings.admin_email
    if not admin:
        log.error("no ADMIN_EMAIL to tell: %s", subject)
        return
    Effects(ctx, for_scheduler=True).email([admin], subject, f"email/{template}",
                                           key=ADMIN_NOTICE_PREFIX + key, title=subject,
                                           **variables)


# An outage is told once however many processes saw it: keyed by when it began, to this.
OUTAGE_KEY_MINUTES = 10


def tell_destination_went(ctx: EngineContext, destination: Destination, up: bool,
                          down_since: datetime.datetime | None) -> None:
    """An alert and an e-mail to the administrator when a destination goes down, and
    when it is back, each by the channels that are not the one down (a Telegram down is
    told by mail, a mail server down on Telegram). Written in the background; keyed by
    the outage's start to OUTAGE_KEY_MINUTES, so that the processes that each saw it go
    tell it once."""
    began = down_since if up else destination.down_since
    if began is None:
        return
    bucket = began.replace(minute=began.minute - began.minute % OUTAGE_KEY_MINUTES,
                           second=0, microsecond=0)
    name = destination.name
    if up:
        minutes = max(1, round((ctx.clock() - began).total_seconds() / 60))
        subject = (f"Destination {name} is up again after {minutes} min: its waiting "
                   "effects are being sent")
    else:
        subject = f"Destination {name} is down: its effects wait"
    key = f"destination-{'up' if up else 'down'}-{name}-{bucket:%Y%m%dT%H%M}"

    def tell() -> None:
        if name != DESTINATION_OF["email"]:
            tell_admin(ctx, key, subject, "destination_went", destination=name, up=up,
                       since=began.isoformat(timespec="seconds"),
                       reason=destination.down_because or "")
        if name != DESTINATION_OF["alert"]:
            Effects(ctx, for_scheduler=True).alert(subject, key=f"alert-{key}")
    ctx.background(ctx.db(tell))


def tell_credentials_refused(ctx: EngineContext, destination: Destination) -> None:
    """One e-mail to the administrator each time a destination starts refusing our
    credentials (engine.destinations), written in the background."""
    started = ctx.clock().strftime("%Y%m%dT%H%M%S")
    subject = f"Destination {destination.name} refuses our credentials"
    ctx.background(ctx.db(functools.partial(
        tell_admin, ctx, f"credentials-refused-{destination.name}-{started}", subject,
        "credentials_refused", destination=destination.name,
        reason=destination.credentials_refused)))
