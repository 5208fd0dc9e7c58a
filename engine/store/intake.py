"""What a customer sends us and what we remind them of: orders in from the shop (the
orders API and the import), the calls that wait for an order (a failed call retried, a
card fact waiting for the ids that will find its order), the compliance orders waiting
for an intake form, reminders sent."""
import datetime
import functools
import math
import operator
import threading
import time
from typing import Any, Iterable, Mapping, NamedTuple, Sequence, cast

import peewee

from models import ORDER_MODELS, ComplianceOrder, OrderBase, SentReminder, WebhookEvent
from engine.commits import on_commit, raise_if_conflict, savepoint
from engine.prepared import InsertOnce, write_later

NEW_REMINDER = InsertOnce(SentReminder)
# A card fact whose order is not known yet (engine.inbox, `Effects.wait_for_order`).
WAITING = "waiting"
# The waiting statuses as a literal, so that a statement reads the partial index of the
# waiting events (models.WebhookEvent) whatever plan the database keeps for it.
_WAITING = peewee.SQL(f"'{WAITING}'")


class Links:
    """When this process last committed a link of each id to an order (`wake_facts`), on
    the monotonic clock. A fact whose handling began before such a commit, and which ends
    waiting for that id, may have looked for its order before the link was committed and
    written its wait after the wake looked for it (two handlings side by side: a spool
    drain's, the request path's): it is handed over again at once (engine.inbox._wait)
    rather than lost until its next look. Another process's links are not here: a fact it
    missed so is looked at again after CARD_FACT_WAIT_ALERT_MINUTES."""

    # Long enough for any handling that looks for an order and then waits.
    KEPT_SECONDS = 900.0

    def __init__(self) -> None:
        self._at: dict[str, float] = {}
        self._lock = threading.Lock()

    def committed(self, keys: Sequence[str]) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._at) > 10_000:
                self._at = {key: at for key, at in self._at.items()
                            if now - at < self.KEPT_SECONDS}
            self._at.update(dict.fromkeys(keys, now))

    def since(self, keys: Sequence[str], moment: float) -> bool:
        """Whether one of `keys` was linked at `moment` (monotonic) or after."""
        with self._lock:
            return any(self._at.get(key, -math.inf) >= moment for key in keys)


LINKS = Links()


def wait_key(kind: str, value: str) -> str:
    """One id that will find a waiting fact's order: `payment_intent:pi_1`, `order:CO-1`."""
    return f"{kind}:{value}"


def _like_literal(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def waits_for(keys: Sequence[str]) -> peewee.ColumnBase:
    """The waiting event's `waiting_for` names one of `keys` (each a whole word of it)."""
    padded = peewee.SQL("' '").concat(WebhookEvent.waiting_for).concat(peewee.SQL("' '"))
    return functools.reduce(operator.or_, (
        peewee.NodeList((padded, peewee.SQL("LIKE"), f"% {_like_literal(key)} %",
                         peewee.SQL("ESCAPE '\\'")))
        for key in keys))


def waiting_for_an_id(value: str) -> peewee.ColumnBase:
    """A waiting event whose `waiting_for` names `value` as an id of any kind (`pi_1`
    finds `payment_intent:pi_1`, `CO-1` finds `order:CO-1`): what an operator who has the
    id at hand looks a waiting fact up by. Reads the waiting events only."""
    padded = peewee.SQL("' '").concat(WebhookEvent.waiting_for).concat(peewee.SQL("' '"))
    return (WebhookEvent.status == _WAITING) & peewee.NodeList((
        padded, peewee.SQL("LIKE"), f"% %:{_like_literal(value)} %", peewee.SQL("ESCAPE '\\'")))


class FactWaiting(NamedTuple):
    """A card fact waiting for its order: its event, what it is, since when, the ids
    that will find its order."""
    event_id: int
    event_type: str
    since: datetime.datetime
    waiting_for: str


class FactsWaiting(NamedTuple):
    """The card facts waiting for their order: how many, the longest waiting first."""
    facts: int
    oldest: list[FactWaiting]


class OrderWaitedFor(NamedTuple):
    """An order not there yet that calls wait for: its number, how many calls, the
    arrival of the first."""
    order_number: str
    calls: int
    since: datetime.datetime


class CallsWaiting(NamedTuple):
    """The calls waiting for orders not there yet: how many, for how many orders, and
    the orders waited for longest, first first."""
    calls: int
    orders: int
    oldest: list[OrderWaitedFor]


class IntakeStore:
    """Intake and reminders, in the caller's transaction."""

    def kind_of_order(self, number: str) -> str | None:
        """The kind of the order with that number, or None when there is none; one read
        a kind until found, in ORDER_MODELS' order."""
        for kind, model in ORDER_MODELS.items():
            if model.select().where(model.order_number == number).exists():
                return kind
        return None

    def add_shop_order(self, kind: str, number: str, values: Mapping[str, Any],
                       at: datetime.datetime) -> OrderBase | None:
        """Insert the order of that kind and number with `values` (those not None; the
        others are the columns' defaults), created and updated `at`, and return it as
        stored. None, the insert undone and the transaction going on, when the number
        is taken: another transaction made the order meanwhile (the caller locks it)."""
        model = ORDER_MODELS[kind]
        try:
            with savepoint():
                model.insert(order_number=number, created_at=at, updated_at=at,
                             **{name: value for name, value in values.items()
                                if value is not None}).execute()
        except peewee.IntegrityError as failure:
            raise_if_conflict(failure)
            return None
        return model.get(model.order_number == number)

    def set_shop_fields(self, order: OrderBase, changed: Mapping[str, Any],
                        at: datetime.datetime) -> OrderBase:
        """Write `changed` (field: value) to the order, updated `at`; return the order
        as stored now."""
        model = type(order)
        model.update(updated_at=at, **changed).where(model.id == order.id).execute()
        return model.get_by_id(order.id)

    def make_calls_due(self, order_number: str, now: datetime.datetime) -> int:
        """The failed calls about the order `order_number`, or about an order naming it
        as its parent, that are not due yet, and the card facts waiting for that order:
        made due `now`. Returns how many."""
        children = functools.reduce(operator.or_, (
            model.select(model.order_number).where(model.parent_order_number == order_number)
            for model in ORDER_MODELS.values()))
        about = ((WebhookEvent.order_number == order_number)
                 | WebhookEvent.order_number.in_(children))
        failed = int(WebhookEvent.update(next_attempt_at=now, updated_at=now)
                     .where(about, WebhookEvent.status == "failed",
                            WebhookEvent.next_attempt_at > now)
                     .execute())
        return failed + self.wake_facts([wait_key("order", order_number)], now,
                                        order_number)

    def wake_facts(self, keys: Sequence[str], now: datetime.datetime,
                   order_number: str | None = None) -> int:
        """The card facts waiting for one of `keys` (or, with `order_number`, about that
        order), made due `now` to be handled again; how many."""
        if not keys:
            return 0
        on_commit(functools.partial(LINKS.committed, list(keys)))
        found_by = waits_for(keys)
        if order_number is not None:
            found_by = found_by | (WebhookEvent.order_number == order_number)
        return int(WebhookEvent.update(status="received", next_attempt_at=now, updated_at=now)
                   .where(WebhookEvent.status == _WAITING, found_by).execute())

    def wake_facts_later(self, keys: Sequence[str], now: datetime.datetime) -> None:
        """`wake_facts`, for a caller that does not read how many: the write goes with the
        transaction's next statement (a turn's on PostgreSQL), no round trip of its own."""
        if keys:
            on_commit(functools.partial(LINKS.committed, list(keys)))
            write_later(WebhookEvent.update(status="received", next_attempt_at=now,
                                            updated_at=now)
                        .where(WebhookEvent.status == _WAITING, waits_for(keys)))

    def wake_facts_to_look_at(self, now: datetime.datetime) -> int:
        """The waiting card facts whose time to be looked at again has come, made due;
        how many (the inbox retry's run: a link to their order may have come without
        waking them, its transaction and theirs committed side by side)."""
        return int(WebhookEvent.update(status="received", updated_at=now)
                   .where(WebhookEvent.status == _WAITING,
                          WebhookEvent.next_attempt_at <= now).execute())

    def facts_waiting(self, limit: int) -> FactsWaiting:
        """The card facts waiting for their order: how many, and the `limit` waiting
        longest (by arrival). Two reads of the waiting events' index."""
        waiting = WebhookEvent.select().where(WebhookEvent.status == _WAITING)
        oldest = [FactWaiting(event.id, event.event_type, event.received_at,
                              event.waiting_for or "")
                  for event in waiting.order_by(WebhookEvent.received_at, WebhookEvent.id)
                  .limit(limit)]
        return FactsWaiting(waiting.count(), oldest)

    def calls_waiting_for_orders(self, unhandled: Sequence[str], limit: int) -> CallsWaiting:
        """The calls not yet handled (in a status of `unhandled`: engine.inbox's
        AWAITING_HANDLING, the inbox importing this store) whose order is in none of the
        order tables: their totals, and the `limit` orders waited for longest (by their
        first call's arrival, then number). Two reads."""
        number = WebhookEvent.order_number
        missing = functools.reduce(operator.and_, (
            ~peewee.fn.EXISTS(model.select(peewee.SQL("1")).where(model.order_number == number))
            for model in ORDER_MODELS.values()))
        per_order = (WebhookEvent.select(number,
                                         peewee.fn.COUNT(WebhookEvent.id).alias("calls"),
                                         peewee.fn.MIN(WebhookEvent.received_at).alias("since"))
                     .where(WebhookEvent.status.in_(unhandled), number.is_null(False), missing)
                     .group_by(number))
        # peewee's types know rows of models only.
        rows = list(cast(Iterable[dict[str, Any]], per_order.order_by(
            peewee.SQL("since"), number).limit(limit).dicts()))
        totals = cast(tuple[int, int] | None, WebhookEvent.select(
            peewee.fn.COUNT(WebhookEvent.id), peewee.fn.COUNT(number.distinct()))
            .where(WebhookEvent.status.in_(unhandled), number.is_null(False), missing)
            .tuples().first())
        calls, orders = totals or (0, 0)
        oldest = [OrderWaitedFor(row["order_number"], row["calls"],
                                 WebhookEvent.received_at.python_value(row["since"]))
                  for row in rows]
        return CallsWaiting(calls, orders, oldest)

    def orders_awaiting_intake(self, status: str,
                               fewer_reminders_than: int) -> list[ComplianceOrder]:
        """The compliance orders in fulfillment_status `status`, with a customer e-mail,
        reminded fewer than `fewer_reminders_than` times; oldest first. Not locked."""
        return list(ComplianceOrder.select()
                    .where(ComplianceOrder.fulfillment_status == status,
                           ComplianceOrder.intake_reminders_sent < fewer_reminders_than,
                           ComplianceOrder.customer_email.is_null(False))
                    .order_by(ComplianceOrder.created_at, ComplianceOrder.id))

    def count_intake_reminder(self, orders: Iterable[ComplianceOrder],
                              at: datetime.datetime) -> None:
        """One more intake reminder sent `at` for each of the orders (counted in the
        database, whatever the rows read hold)."""
        (ComplianceOrder.update(
            intake_reminders_sent=ComplianceOrder.intake_reminders_sent + 1,
            intake_reminded_at=at, updated_at=at)
         .where(ComplianceOrder.id.in_([order.id for order in orders])).execute())

    def reminders_sent(self, keys: Iterable[str]) -> set[str]:
        """Those of `keys` a reminder was sent under (committed, or recorded in this
        transaction)."""
        return {key for (key,) in cast(Iterable[tuple[str]], SentReminder.select(
            SentReminder.key).where(SentReminder.key.in_(list(keys))).tuples())}

    def reminder_sent(self, key: str) -> bool:
        """Whether a reminder was sent under `key`."""
        return bool(SentReminder.select().where(SentReminder.key == key).exists())

    def record_reminder(self, key: str, kind: str, customer_email: str,
                        day: datetime.date, at: datetime.datetime,
                        order_number: str | None = None, cycle: str | None = None) -> bool:
        """Record a reminder sent under `key` (its customer, the day in the business's
        time zone, the filing's order and cycle, if any): False, and nothing written,
        when the key is taken (another run sent it; on PostgreSQL a racing insert of the
        key waits for the other transaction's end)."""
        return NEW_REMINDER.run(
            key=key, kind=kind, customer_email=customer_email, day=day.isoformat(),
            order_number=order_number, cycle=cycle, created_at=at,
            updated_at=at) is not None
