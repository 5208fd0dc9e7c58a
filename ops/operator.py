"""What the operator's command line does, apart from printing: find events and outbox
rows, replay events, put dead effects back in line.

Replay runs an event through `engine.inbox.process` again, the same path a webhook
takes. What it can and cannot redo:
- a `received` or `failed` event is handled as if it had just arrived, and so is a `dead`
  one (given up after too many failures) with its attempts counted afresh;
- a fact `waiting` for its order is looked for again now (the operator imported the
  order, or fixed its link): handled if its order is found, waiting again, for the same
  ids, if not;
- a `processed`, `ignored` or `rejected` event, or one an operator gave up (final, with
  who, when and why: `give_up_events`), is handled again only when forced; its
  database changes are made again (the order operations are idempotent: a paid order
  stays paid once) and every effect it asks for is deduplicated by its idempotency key,
  so nothing that is already in the outbox is sent a second time;
- an effect that was sent, or that died, is not sent again by a replay: `outbox retry`
  puts a dead one back in line (or a waiting or pending one, due now); nothing undoes an
  effect another system received.

Every action on rows, the console's and the command line's alike, keeps one rule
(`not_in_flight`): a row a process may be working on right now is left as it is.
"""
import dataclasses
import datetime
import functools
from typing import Any, Callable, Optional, Sequence

import peewee
from peewee import Value

from models import ConsoleAction, Outbox, WebhookEvent
from engine import inbox
from engine.claims import lease
from engine.contracts import EngineContext
from engine.destinations import DESTINATION_OF

EVENT_SOURCES = ("workflow", "card", "crypto")
EVENT_STATUSES = ("received", "held", "processed", "failed", "waiting", "dead", "rejected",
                  "ignored")
# What each status says, for the lists' legend (the console's events page).
EVENT_STATUS_MEANINGS = {
    "received": "stored, its handling under way or due now",
    "held": "stored, waiting behind an earlier event of its order that is not finished: "
            "handled when that one is handled or given up",
    "processed": "handled: its effects are in the outbox",
    "failed": "its handling failed; tried again at its next attempt, with a growing wait",
    "waiting": "a payment fact whose order is not known yet: handled as soon as one of "
               "its ids is linked to an order",
    "dead": "given up, by the retries or by an operator (who, when and why on its page)",
    "rejected": "refused as it came (malformed, or a move its order cannot make): final, "
                "the reason is its last error",
    "ignored": "kept, not acted on: no handler for its type, history older than a change "
               "handled, or a copy of one handled; the reason is its last error",
}
# An event as the operator reads it: stored and awaiting its handling behind an unfinished
# earlier event of its stream (`note_holds`). No status of the row's: it ends when that one
# does, with no write.
HELD = "held"
OUTBOX_STATUSES = ("pending", "waiting", "sent", "logged", "dead")
# Where effects go, by the one name the operator meets everywhere (the console, this
# command line, /metrics, /readyz, the settings WORKER_URL, WORKFLOW_URL, TELEGRAM_*,
# SMTP_URL): worker, workflow, telegram, smtp. The outbox keeps each effect's kind (job,
# workflow_action, alert, email), one kind per destination; no page and no command shows it.
DESTINATIONS = tuple(DESTINATION_OF.values())
KIND_OF = {destination: kind for kind, destination in DESTINATION_OF.items()}
# What `outbox retry --STATUS` may put back in line, due now.
RETRYABLE_OUTBOX_STATUSES = ("dead", "waiting", "pending")
# Handled without --force: the event never got through. A dead or forced one is reopened
# first, since handling skips events in a final status; so is a waiting fact
# (`_look_again`), which handling skips too.
UNFINISHED = ("received", "failed")
FAILURES = ("failed", "dead")
# What an operator may give up: a failure, or a fact whose order will never come (a
# test-mode event, an order deleted in the shop).
GIVEN_UP_FROM = (*FAILURES, inbox.WAITING)


class NotFound(Exception):
    """No row has that id."""


class Refused(Exception):
    """The operation would do something the operator did not ask for; the message says
    what to add to ask for it."""


def note_holds(events: list[WebhookEvent]) -> list[WebhookEvent]:
    """Set each event's `held`: what it waits behind, as the operator reads it ("held
    behind event #12 (failed: ...)"), or None. In a unit."""
    found = inbox.holds([event.id for event in events])
    for event in events:
        hold = found.get(event.id)
        event.held = hold and held_text(hold)
    return events


def held_text(hold: inbox.Hold) -> str:
    why = f"{hold.status}: {hold.reason}" if hold.reason else hold.status
    return f"held behind event #{hold.behind} ({why})"


def status_is(status: str) -> peewee.Expression:
    """Events of `status` as the lists show it: `held` ones (HELD) apart from the received
    and failed ones they are rows of."""
    behind = peewee.fn.EXISTS(inbox.first_unfinished_before())
    if status == HELD:
        return WebhookEvent.status.in_(inbox.AWAITING_HANDLING) & behind
    if status in inbox.AWAITING_HANDLING:
        return (WebhookEvent.status == status) & ~behind
    return WebhookEvent.status == status


def list_events(source: str | None = None, status: str | None = None,
                since: datetime.datetime | None = None,
                until: datetime.datetime | None = None,
                limit: int = 50) -> list[WebhookEvent]:
    """The newest events first, filtered; `since` inclusive, `until` exclusive; each with
    what it is held behind (`note_holds`)."""
    query = WebhookEvent.select()
    if source:
        query = query.where(WebhookEvent.source == source)
    if status:
        query = query.where(status_is(status))
    if since:
        query = query.where(WebhookEvent.received_at >= since)
    if until:
        query = query.where(WebhookEvent.received_at < until)
    return note_holds(list(query.order_by(WebhookEvent.received_at.desc(),
                                          WebhookEvent.id.desc()).limit(limit)))


def source_of(event: WebhookEvent) -> str:
    """The event's source, and how it came when not from its sender."""
    return f"{event.source} (reconciled)" if event.reconciled else event.source


def get_event(event_id: int) -> WebhookEvent:
    event = WebhookEvent.get_or_none(WebhookEvent.id == event_id)
    if event is None:
        raise NotFound(f"no event #{event_id}")
    return event


def event_with_effects(event_id: int) -> tuple[WebhookEvent, list[Outbox]]:
    """(the event, with what it is held behind (`note_holds`) and whether later events
    of its stream overtook it (`overtaken`: a replay would be out of sequence), its
    outbox rows); NotFound when there is no such event."""
    [event] = note_holds([get_event(event_id)])
    event.overtaken = event.status == "dead" and _overtaken(event)
    return event, list(Outbox.select().where(Outbox.event == event.id).order_by(Outbox.id))


async def replay(ctx: EngineContext, event_id: int, force: bool = False) -> str:
    """Handle one event again; returns the outcome (processed, failed, ignored...)."""
    event = await ctx.db(functools.partial(_to_replay, ctx, event_id, force))
    return await inbox.process(ctx, event)


def _to_replay(ctx: EngineContext, event_id: int, force: bool) -> WebhookEvent:
    event = get_event(event_id)
    if event.status == inbox.WAITING:
        event = _look_again(ctx, event)
    if event.status not in UNFINISHED:
        if not force and event.given_up_at:
            raise Refused(f"event #{event.id} was given up by {event.given_up_by} at "
                          f"{format_time(event.given_up_at)} UTC ({event.given_up_reason}); "
                          "add --force to handle it again")
        if not force and event.status not in FAILURES:
            raise Refused(f"event #{event.id} is {event.status}; add --force to handle "
                          "it again (its effects are not sent twice)")
        if not force and _overtaken(event):
            raise Refused(f"event #{event.id} is dead, and events of order "
                          f"{event.order_number} that came after it have been handled "
                          "since; add --force to handle it after them all the same")
        event = _reopen(ctx, event)
    return event


def _overtaken(event: WebhookEvent) -> bool:
    return WebhookEvent.select().where(WebhookEvent.id == event.id, inbox.overtaken()).exists()


def _reopen(ctx: EngineContext, event: WebhookEvent) -> WebhookEvent:
    """To be handled again: a give-up it had is undone (the record of actions keeps it)."""
    now = ctx.clock()
    (WebhookEvent.update(status="received", attempts=0, next_attempt_at=None, updated_at=now,
                         given_up_by=None, given_up_at=None, given_up_reason=None)
     .where(WebhookEvent.id == event.id).execute())
    return get_event(event.id)


def _look_again(ctx: EngineContext, event: WebhookEvent) -> WebhookEvent:
    """A waiting fact, reopened to be handled now: received, and claimed for a lease as
    the inbox retry claims one, since a fact that came more than a lease ago would be due
    to the retry at once (engine.inbox._due) and handled twice side by side; its attempts
    kept (a wait counts none). One that its order's arrival woke since it was read is
    received already, and left as that wake made it."""
    now = ctx.clock()
    (WebhookEvent.update(status="received", next_attempt_at=now + lease(ctx), updated_at=now)
     .where(WebhookEvent.id == event.id, WebhookEvent.status == inbox.WAITING).execute())
    return get_event(event.id)


@dataclasses.dataclass
class Replayed:
    event: WebhookEvent
    outcome: str


async def replay_failed(ctx: EngineContext, progress: Optional[Callable[[int, int], None]] = None
                        ) -> list[Replayed]:
    """Every failed or dead event but those an operator gave up and those later events of
    their order have overtaken (engine.inbox.overtaken: one is replayed alone, forced),
    oldest first, one after the other (so the effects of one order keep their order);
    `progress(done, total)` after each."""
    failed = await ctx.db(lambda: list(
        WebhookEvent.select().where(awaiting_an_operator(), ~inbox.overtaken())
        .order_by(WebhookEvent.received_at, WebhookEvent.id)))
    replayed: list[Replayed] = []
    if progress:
        progress(0, len(failed))
    for event in failed:
        replayed.append(Replayed(event, await replay(ctx, event.id)))
        if progress:
            progress(len(replayed), len(failed))
    return replayed


def destination_of(row: Outbox) -> str:
    """The name of the system `row` goes to (DESTINATIONS)."""
    return DESTINATION_OF.get(row.kind, row.kind)


def awaiting_an_operator(status: str | None = None) -> peewee.Expression:
    """The events whose handling failed and that no operator has given up: failed (the
    scheduler tries them again) or dead (the retry policy gave them up); of one of the
    two `status`es when given. A failed event is never one given up (giving up makes it
    dead): only the dead are looked at for it, so the failed are a range of the status
    indexes, read from no row."""
    failed = WebhookEvent.status == "failed"
    dead = (WebhookEvent.status == "dead") & WebhookEvent.given_up_at.is_null()
    return {"failed": failed, "dead": dead}.get(status or "", failed | dead)


def failures_awaiting_an_operator() -> dict[str, int]:
    """{failed: n, dead: n} of `awaiting_an_operator`, and how many were given up
    (`given up`): counts of the status index and of the given-up events' own, each
    without a look at a row (1M events, 10,000 failed: a count reading each failed row's
    given_up_at took 100 ms)."""
    counts = {status: WebhookEvent.select().where(WebhookEvent.status == status).count()
              for status in FAILURES}
    given_up = (WebhookEvent.select().where(WebhookEvent.status == "dead",
                                            WebhookEvent.given_up_at.is_null(False))
                .count())
    return {"failed": counts["failed"], "dead": counts["dead"] - given_up,
            "given up": given_up}


def give_up_events(ctx: EngineContext, conditions: Sequence[peewee.Expression], reason: str,
                   given_up_by: tuple[str, str], waiting: bool = False) -> int:
    """The events matching every one of `conditions` that await an operator
    (`awaiting_an_operator`), or with `waiting` the facts waiting for their order, and
    that no handling holds (`not_in_flight`), given up: dead, as the retry policy leaves
    one it gives up, and final (handled again only by a forced replay; a waiting fact's
    wake, which looks for waiting ones only, passes it over); who, when and `reason` kept
    on each, and in the record of actions, in one statement each however many. Returns
    how many. `given_up_by`: (operator, address)."""
    if not reason.strip():
        raise ValueError("a give-up needs its reason")
    now = ctx.clock()
    operator_name = given_up_by[0]
    among = WebhookEvent.status == inbox.WAITING if waiting else awaiting_an_operator()
    chosen = (*conditions, among, not_in_flight(ctx, WebhookEvent))
    _record_each(WebhookEvent, chosen, given_up_by, "give up event", reason, now)
    return (WebhookEvent.update(status="dead", next_attempt_at=None, updated_at=now,
                                given_up_by=operator_name, given_up_at=now,
                                given_up_reason=reason)
            .where(*chosen).execute())


def give_up_event(ctx: EngineContext, event_id: int, reason: str,
                  given_up_by: tuple[str, str]) -> WebhookEvent:
    """One event given up (`give_up_events`); NotFound, or Refused when it is neither one
    that awaits an operator nor a fact waiting for its order, or a handling may hold it."""
    event = get_event(event_id)
    if event.given_up_at:
        raise Refused(f"event #{event.id} was given up already, by {event.given_up_by} at "
                      f"{format_time(event.given_up_at)} UTC")
    if event.status not in GIVEN_UP_FROM:
        raise Refused(f"event #{event.id} is {event.status}: only a failed event, one the "
                      "retries gave up, or a fact waiting for its order, is given up")
    if not give_up_events(ctx, [WebhookEvent.id == event_id], reason, given_up_by,
                          waiting=event.status == inbox.WAITING):
        raise in_flight_refusal(ctx, event)
    return get_event(event_id)


def retry_events(ctx: EngineContext, conditions: Sequence[peewee.Expression],
                 retried_by: tuple[str, str], waiting: bool = False) -> int:
    """The events matching every one of `conditions` that await an operator, that no
    handling holds and that no later event of their order has overtaken
    (engine.inbox.overtaken: one is replayed alone, forced), back in line: failed, due
    now, attempts counted afresh; the scheduler
    handles them at its next runs, oldest first (engine.inbox.retry_due). With `waiting`,
    the facts waiting for their order instead, made due now as their order's arrival
    makes them (received, their attempts kept): each is handled if its order is found
    now, and waits again if not. Each retry kept in the record of actions. Returns how
    many."""
    now = ctx.clock()
    if waiting:
        chosen: tuple[peewee.Expression, ...] = (*conditions,
                                                 WebhookEvent.status == inbox.WAITING)
        changes: dict[str, Any] = {"status": "received"}
    else:
        chosen = (*conditions, awaiting_an_operator(), not_in_flight(ctx, WebhookEvent),
                  ~inbox.overtaken())
        changes = {"status": "failed", "attempts": 0}
    _record_each(WebhookEvent, chosen, retried_by, "retry event", "back in line", now)
    return (WebhookEvent.update(next_attempt_at=now, updated_at=now, **changes)
            .where(*chosen).execute())


def _record_each(model: type[Outbox] | type[WebhookEvent], chosen: Sequence[peewee.Expression],
                 by: tuple[str, str], action: str, outcome: str,
                 now: datetime.datetime) -> None:
    """One record of `action` by `by` (operator, address) for each row of `model` that
    `chosen` selects, in one statement (a bulk action may take thousands)."""
    operator_name, address = by
    ConsoleAction.insert_from(
        model.select(Value(operator_name), Value(address), Value(action),
                     model.id.cast("TEXT"), Value(outcome),
                     Value(now, converter=ConsoleAction.created_at.db_value),
                     Value(now, converter=ConsoleAction.updated_at.db_value))
        .where(*chosen),
        fields=[ConsoleAction.operator, ConsoleAction.address, ConsoleAction.action,
                ConsoleAction.target, ConsoleAction.outcome, ConsoleAction.created_at,
                ConsoleAction.updated_at]).execute()


def list_outbox(status: str | None = None, limit: int = 50,
                destination: str | None = None) -> list[Outbox]:
    query = Outbox.select()
    if status:
        query = query.where(Outbox.status == status)
    if destination:
        query = query.where(Outbox.kind == KIND_OF[destination])
    return list(query.order_by(Outbox.id.desc()).limit(limit))


def not_in_flight(ctx: EngineContext,
                  model: type[Outbox] | type[WebhookEvent]) -> peewee.Expression:
    """The rows of `model` no process may be working on now: the one rule of every
    operator's action on effects and events, from the console or the command line.

    A row being worked on holds a lease (engine.claims): an effect its cause's request
    sends, or one the scheduler claimed, is pending until one lease from when it was
    taken, and so is an event being handled (failed, or received; one stored and handled
    at once holds it from its arrival). Put back in line, made due or given up then, the
    row would be sent a second time beside the send under way, or the give-up undone by
    that send's outcome. Such a row is due within a lease anyway, or sent by then.
    Read in the statement that changes the rows, so no claim comes in between."""
    now = ctx.clock()
    leased_until = now + lease(ctx)
    not_held = (model.next_attempt_at <= now) | (model.next_attempt_at > leased_until)
    if model is Outbox:
        return (Outbox.status != "pending") | not_held
    return (WebhookEvent.status.not_in(inbox.AWAITING_HANDLING) | not_held
            | (WebhookEvent.next_attempt_at.is_null()
               & (WebhookEvent.received_at <= now - lease(ctx))))


def in_flight(ctx: EngineContext, row: Outbox | WebhookEvent) -> bool:
    """`not_in_flight`'s rule for one row already read, for the pages: whether an action
    on it would be left undone now (its buttons are not offered then)."""
    return held_until(ctx, row) is not None


def held_until(ctx: EngineContext, row: Outbox | WebhookEvent) -> datetime.datetime | None:
    """Until when a process may be working on `row` (`not_in_flight`), or None."""
    now = ctx.clock()
    if isinstance(row, Outbox):
        until = row.next_attempt_at if row.status == "pending" else None
    elif row.status not in inbox.AWAITING_HANDLING:
        until = None
    else:
        until = row.next_attempt_at or row.received_at + lease(ctx)
    return until if until is not None and now < until <= now + lease(ctx) else None


def in_flight_refusal(ctx: EngineContext, row: Outbox | WebhookEvent) -> Refused:
    """Why an action left `row` as it is (`not_in_flight`)."""
    until = format_time(held_until(ctx, row) or ctx.clock())
    if isinstance(row, Outbox):
        return Refused(f"effect #{row.id} may be on its way out right now: a send holds it, "
                       f"or its next try comes, by {until} UTC. Left as it is, so that it "
                       "goes out once; look again after that time")
    return Refused(f"event #{row.id} may be being handled right now: a handling holds it, "
                   f"or its next try comes, by {until} UTC. Left as it is; look again after "
                   "that time")


def retry_outbox(ctx: EngineContext, row_id: int) -> Outbox:
    """Put one pending, waiting or dead effect back in line, due now, with a fresh
    attempt count; Refused for one sent, logged, or on its way out (`not_in_flight`)."""
    row = Outbox.get_or_none(Outbox.id == row_id)
    if row is None:
        raise NotFound(f"no outbox row #{row_id}")
    if row.status == "sent":
        raise Refused(f"outbox row #{row_id} was sent at {format_time(row.sent_at)}; "
                      "it is not sent twice")
    if row.status == "logged":
        raise Refused(f"outbox row #{row_id} was logged, not sent, as the settings "
                      "asked; it is final")
    if not requeue(ctx, Outbox.id == row_id):
        raise in_flight_refusal(ctx, row)
    return Outbox.get_by_id(row_id)


def retry_all(ctx: EngineContext, status: str, retried_by: tuple[str, str] | None = None,
              destination: str | None = None) -> int:
    """Put every effect in `status` (dead, waiting or pending), of one destination or of
    all, back in line, due now; returns how many. `retried_by`: see `requeue`."""
    if status not in RETRYABLE_OUTBOX_STATUSES:
        raise ValueError(f"cannot retry {status} rows")
    condition = Outbox.status == status
    if destination:
        condition &= Outbox.kind == KIND_OF[destination]
    return requeue(ctx, condition, retried_by)


def requeue(ctx: EngineContext, condition: peewee.Expression,
            retried_by: tuple[str, str] | None = None) -> int:
    """Rows matching `condition`, unless sent, logged or on their way out
    (`not_in_flight`), back to pending, due now, attempts reset; returns how many.
    `retried_by` (operator, address): each row's timeline shows the retry as its own line,
    recorded for every row in one statement (a bulk retry may take thousands)."""
    now = ctx.clock()
    requeued = (condition, Outbox.status.not_in(("sent", "logged")),
                not_in_flight(ctx, Outbox))
    if retried_by is not None:
        _record_each(Outbox, requeued, retried_by, "retry effect",
                     "back in line, with others", now)
    return (Outbox.update(status="pending", attempts=0, next_attempt_at=now,
                          updated_at=now)
            .where(*requeued).execute())


def parse_time(text: str) -> datetime.datetime:
    """ISO 8601 date or date-time; without an offset it is taken as UTC."""
    value = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.timezone.utc)
    return value.astimezone(datetime.timezone.utc)


def format_time(value: datetime.datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain text columns, as wide as their widest cell; empty cells show as "-"."""
    cells = [[str(cell) if cell not in (None, "") else "-" for cell in row] for row in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    lines = [headers, *cells]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in lines)


def clip(text: str | None, width: int = 48) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[:width - 1] + "…"
