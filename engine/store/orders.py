"""Orders: read by kind and number (locked or not), by number of whatever kind, by the
payment intent that paid them; renamed; saved; a subscription's renewals counted.

An order a call's handling locks is read ahead with the turn's others (`OrderAhead`)
when the call says which (`OrderRef`, a plugin's `orders_of`): `lock_order` then takes
the row read ahead instead of asking again. Orders are locked in one order whichever
unit asks (kind by name, each kind's by number), so two turns rarely wait on each other
holding what the other waits for; when they do (the parts of one joined statement run in
no promised order), PostgreSQL rolls one back as a deadlock, a conflict whose unit is run
again (engine.commits)."""
import datetime
import decimal
import functools
import json
from typing import (Any, Callable, Iterable, Iterator, Literal, Mapping, NamedTuple,
                    Sequence, cast, overload)

import peewee

from models import (ORDER_MODELS, BaseModel, BundleOrder, ComplianceOrder, CrtcOrder,
                    FormationOrder, OrderBase, OrderChange, SubscriptionCycle, WebhookEvent)
from engine import commits
from engine.commits import Ahead, AheadStatement
from engine.db import locked
from engine.prepared import ArraySlot, Prepared, save_changes, slot, write_later

# The `field` of an order's history row that records its creation (models.OrderChange).
CREATED = "order"


class OrderRef(NamedTuple):
    """An order a call's handling reads: by `kind` and number, locked and read whole; or,
    `kind` None, the order of that number of whatever kind, its name read (a workflow
    call may rename it)."""
    kind: str | None
    number: str


def _order_by_number(model: type[OrderBase], for_update: bool) -> Prepared:
    def build() -> peewee.Query:
        query = model.select().where(model.order_number == slot(model.order_number))
        return locked(query) if for_update else query
    return Prepared(build, on_server=True)


ORDER_BY_NUMBER = {(kind, for_update): _order_by_number(model, for_update)
                   for kind, model in ORDER_MODELS.items() for for_update in (False, True)}


def _orders_by_numbers(model: type[OrderBase]) -> Prepared:
    """`_order_by_number` locked, for several numbers at once, in their order: two
    processes lock the same orders in the same order."""
    return Prepared(lambda: locked(model.select().where(
        model.order_number == peewee.fn.ANY(peewee.Cast(
            ArraySlot("numbers", model.order_number), "text[]"))).order_by(model.order_number)))


# Not prepared on the server, as NAMES_OF_ANY_KIND (below).
ORDERS_BY_NUMBERS = {kind: _orders_by_numbers(model) for kind, model in ORDER_MODELS.items()}


def _every_order_table(select: Any) -> peewee.Query:
    """One statement for every order table: the rows `select(model, kind)` gives for each,
    `kind` the column that names the table's kind; the tables in the order of their
    kinds' names (the order a turn locks orders in, OrderAhead)."""
    selects = [select(model, peewee.Value(kind).alias("kind"))
               for kind, model in sorted(ORDER_MODELS.items())]
    return functools.reduce(lambda union, select: union.union_all(select), selects)


def _name_of_any_kind() -> peewee.Query:
    """(kind, order_name) of each order with that number (at most one a kind)."""
    return _every_order_table(lambda model, kind: model.select(kind, model.order_name)
                              .where(model.order_number == slot(model.order_number)))


NAME_OF_ANY_KIND = Prepared(_name_of_any_kind, on_server=True)


def _names_of_any_kind() -> peewee.Query:
    """`_name_of_any_kind` for several numbers at once, each order locked, the kinds in
    turn and each kind's by number (OrderAhead): (kind, order_number, order_name)."""
    def locked_names(model: type[OrderBase], kind: peewee.Node) -> peewee.Select:
        rows = locked(model.select(model.order_number, model.order_name).where(
            model.order_number == peewee.fn.ANY(
                peewee.Cast(ArraySlot("numbers", model.order_number), "text[]")))
            .order_by(model.order_number)).alias("locked")
        return peewee.Select([rows], [kind, rows.c.order_number, rows.c.order_name]).bind(
            model._meta.database)
    return _every_order_table(locked_names)


# Not prepared on the server: a plan made without the array would not know how few it
# holds, and would scan each table.
NAMES_OF_ANY_KIND = Prepared(_names_of_any_kind)


def _rename(model: type[OrderBase]) -> Prepared:
    return Prepared(lambda: model.update(
        order_name=slot(model.order_name), updated_at=slot(model.updated_at)).where(
        model.order_number == slot(model.order_number)), on_server=True)


RENAME = {kind: _rename(model) for kind, model in ORDER_MODELS.items()}


def _names_read_ahead() -> dict[str, dict[str, str | None]]:
    """The names read ahead and not used yet in this turn, by number (`OrderNameAhead`)."""
    made: Callable[[], dict[str, dict[str, str | None]]] = dict
    return commits.for_this_turn(OrderNameAhead, made)


class OrderAhead(Ahead):
    """The order a unit locks and reads (`OrderStore.lock_order`), read ahead with the
    turn's others of its kind (engine.commits.Ahead: a part of the statement that
    inserts the turn's events), locked as the unit's own read would lock it, and kept
    for the turn (`commits.keep_rows`): the unit's read takes it, unless a write to its
    table in the turn came first and dropped it; a second read goes to the database. An
    order read ahead and not taken (the call was a copy) stays locked until the turn's
    COMMIT all the same. Locked before the unit's own writes (a crypto payment's
    treasury job), where the unit alone would lock it after them: a deadlock with a
    process locking in the other order is a conflict, and its unit is run again."""

    def __init__(self, kind: str, number: str) -> None:
        self.kind, self.number = kind, number

    @classmethod
    def statements(cls, items: Sequence[Ahead]) -> list[AheadStatement]:
        """The turn's orders locked in one order, whichever kind of item asked: kind
        after kind (by name), each kind's by number. The names read ahead
        (`OrderNameAhead`, made here) lock every order asked for; the orders read in
        full after them are then the turn's already."""
        by_kind: dict[str, list[OrderAhead]] = {}
        named = []
        for item in items:
            if isinstance(item, OrderNameAhead):
                named.append(item)
            elif isinstance(item, OrderAhead):
                by_kind.setdefault(item.kind, []).append(item)
        read_in_full = [item.number for of_a_kind in by_kind.values() for item in of_a_kind]
        locking = [OrderNameAhead.locking(named, read_in_full)] if named else []
        return locking + [cls._locking(kind, by_kind[kind]) for kind in sorted(by_kind)]

    @staticmethod
    def _locking(kind: str, items: list["OrderAhead"]) -> AheadStatement:
        """The statement that locks and reads the orders of one kind."""
        numbers = sorted({item.number for item in items})
        statement = ORDERS_BY_NUMBERS[kind]

        def take(names: list[str], rows: list[tuple]) -> None:
            found: dict[str, OrderBase | None] = dict.fromkeys(numbers)
            for order in statement.instances(names, rows):
                found[order.order_number] = order
            commits.keep_rows(ORDER_MODELS[kind], found)
            for item in items:
                item.done = True
        return statement.ahead(take, numbers=numbers)


class OrderNameAhead(Ahead):
    """The name of the order of a number, of whatever kind (`OrderStore.names_of`), read
    ahead with the turn's others and kept for the turn: used by the first read of that
    order's name in the turn, which comes before the only write of a name
    (`rename_order`) that could make it stale; a second read goes to the database. The
    orders of that number, of every kind, are locked as they are read, in the turn's one
    order with the orders the payments lock (`OrderAhead`, which makes the statement)."""

    together_with = OrderAhead

    def __init__(self, number: str) -> None:
        self.number = number

    @staticmethod
    def locking(items: list["OrderNameAhead"], also: list[str]) -> AheadStatement:
        """The statement that locks and reads the names of the orders of `items`' numbers
        and `also`'s, of every kind."""
        asked = {item.number for item in items}

        def take(names: list[str], rows: list[tuple]) -> None:
            found: dict[str, dict[str, str | None]] = {number: {} for number in asked}
            for kind, number, name in rows:
                if number in asked:
                    found[number][kind] = name
            _names_read_ahead().update(found)
            for item in items:
                item.done = True
        return NAMES_OF_ANY_KIND.ahead(take, numbers=sorted(asked.union(also)))


def ahead_of(refs: Iterable[OrderRef]) -> tuple[Ahead, ...]:
    """What the engine reads ahead for the orders a call's handling names."""
    return tuple(OrderNameAhead(ref.number) if ref.kind is None
                 else OrderAhead(ref.kind, ref.number) for ref in refs)


def history_value(value: Any) -> str:
    """A column's value as an order's history keeps it: JSON text, times in ISO 8601 UTC,
    exact decimals as text."""
    def plain(value: Any) -> Any:
        if isinstance(value, datetime.datetime):
            return value.astimezone(datetime.timezone.utc).isoformat()
        if isinstance(value, decimal.Decimal):
            return str(value)
        if isinstance(value, dict):
            return {name: plain(item) for name, item in value.items()}
        return value
    return json.dumps(plain(value), ensure_ascii=False, sort_keys=True)


class OrderStore:
    """Orders, in the caller's transaction. Every change of an order written here is
    recorded in its history (models.OrderChange) in the same transaction: by the caller
    named (`by`), else by the handling's event, else by the handling's `by` (a scheduled
    job's name)."""

    # The handling's (engine.outbox.Effects, engine.transaction.Transaction): its event,
    # who it is when no event is, and its context's clock.
    event: WebhookEvent | None
    by: str | None
    now: Callable[[], datetime.datetime]

    def changed_by(self) -> tuple[str, int | None]:
        """(who, the event's id or None) of the changes this handling makes."""
        if self.event is not None and self.event.id is not None:
            return (f"event #{self.event.id} ({self.event.source} "
                    f"{self.event.event_type})", self.event.id)
        return self.by or "the service", None

    def record_changes(self, kind: str, number: str, changes: Mapping[str, tuple[Any, Any]],
                       at: datetime.datetime, by: str | None = None) -> None:
        """Keep `changes` ({column: (old, new)}) of the order of that kind and number in
        its history, made `at` by `by` (or by this handling, `changed_by`); the insert
        goes with the next statement. `CREATED` as a column: the order was created, with
        the new value."""
        if not changes:
            return
        who, event_id = (by, None) if by is not None else self.changed_by()
        write_later(OrderChange.insert_many([{
            "kind": kind, "order_number": number, "field": field,
            "old_value": None if field == CREATED else history_value(old),
            "new_value": history_value(new), "changed_by": who, "event_id": event_id,
            "changed_at": at, "created_at": at, "updated_at": at}
            for field, (old, new) in sorted(changes.items())]))

    def record_creation(self, kind: str, number: str, values: Mapping[str, Any],
                        at: datetime.datetime, by: str | None = None) -> None:
        """Keep in the order's history that it was created `at`, by `by` (or by this
        handling), with `values` ({shop field: value})."""
        self.record_changes(kind, number, {CREATED: (None, dict(values))}, at, by)

    def order_history(self, order_number: str) -> list[OrderChange]:
        """The history of the orders with that number, oldest first."""
        return list(OrderChange.select().where(OrderChange.order_number == order_number)
                    .order_by(OrderChange.changed_at, OrderChange.id))

    @overload
    def order(self, kind: Literal["canada_crtc"], number: str) -> CrtcOrder | None: ...
    @overload
    def order(self, kind: Literal["compliance"], number: str) -> ComplianceOrder | None: ...
    @overload
    def order(self, kind: Literal["formation"], number: str) -> FormationOrder | None: ...
    @overload
    def order(self, kind: Literal["bundle"], number: str) -> BundleOrder | None: ...
    @overload
    def order(self, kind: str, number: str) -> OrderBase | None: ...

    def order(self, kind: str, number: str) -> OrderBase | None:
        """The order of that kind and number, or None; not locked."""
        return ORDER_BY_NUMBER[kind, False].first(order_number=number)

    @overload
    def lock_order(self, kind: Literal["canada_crtc"], number: str) -> CrtcOrder | None: ...
    @overload
    def lock_order(self, kind: Literal["compliance"],
                   number: str) -> ComplianceOrder | None: ...
    @overload
    def lock_order(self, kind: Literal["formation"], number: str) -> FormationOrder | None: ...
    @overload
    def lock_order(self, kind: Literal["bundle"], number: str) -> BundleOrder | None: ...
    @overload
    def lock_order(self, kind: str, number: str) -> OrderBase | None: ...

    def lock_order(self, kind: str, number: str) -> OrderBase | None:
        """The order of that kind and number, locked until the transaction ends, or
        None."""
        kept = commits.take_row(ORDER_MODELS[kind], number)
        if kept is not commits.NOT_KEPT:
            return cast("OrderBase | None", kept)  # keep_rows keeps this kind's rows, or None
        return ORDER_BY_NUMBER[kind, True].first(order_number=number)

    def order_of_any_kind(self, number: str, first_kind: str) -> OrderBase | None:
        """The order with that number, whatever its kind, or None; `first_kind`'s table
        is looked in first."""
        for kind in (first_kind, *(kind for kind in ORDER_MODELS if kind != first_kind)):
            order = self.order(kind, number)
            if order is not None:
                return order
        return None

    def lock_orders_numbered(self, number: str) -> Iterator[OrderBase]:
        """Every order with that number, of every kind, each locked as it is read: one
        kind's read after the caller has done with the one before (its writes go with
        the next kind's read)."""
        for model in ORDER_MODELS.values():
            yield from locked(model.select().where(model.order_number == number))

    def service_slug_of(self, number: str) -> str | None:
        """The service slug of the compliance order with that number, or None (no such
        order, or it has none). Not locked; only the slug is read."""
        order = (ComplianceOrder.select(ComplianceOrder.service_slug)
                 .where(ComplianceOrder.order_number == number).first())
        return order.service_slug if order else None

    def names_of(self, number: str) -> dict[str, str | None]:
        """{kind: order_name} of the orders with that number (at most one a kind), in one
        round trip (none when read ahead, `OrderRef` with no kind)."""
        found = None
        if commits.together():
            found = _names_read_ahead().pop(number, None)
        if found is None:
            found = dict(NAME_OF_ANY_KIND.execute(order_number=number).fetchall())
        return found

    def rename_order(self, kind: str, number: str, name: str, was: str | None,
                     at: datetime.datetime) -> None:
        """Keep the workflow system's document name `name` on the order, which was `was`."""
        RENAME[kind].execute_later(order_name=name, updated_at=at, order_number=number)
        self.record_changes(kind, number, {"order_name": (was, name)}, at)

    def order_paid_by(self, payment_intent_id: str) -> OrderBase | None:
        """The order a payment intent paid: exact match on stripe_payment_intent_id first,
        then a match within the reference (stripe_session_id), across the four kinds;
        or None. Not locked."""
        for model in ORDER_MODELS.values():
            order = model.select().where(
                model.stripe_payment_intent_id == payment_intent_id).first()
            if order:
                return order
        for model in ORDER_MODELS.values():
            # ILIKE narrows it down; the case-sensitive test makes it exact (ids are).
            for order in model.select().where(
                    model.stripe_session_id.contains(payment_intent_id)):
                if payment_intent_id in (order.stripe_session_id or ""):
                    return order
        return None

    def order_refunded_by(self, charge_id: str) -> OrderBase | None:
        """The order whose refunds kept are of that charge, across the four kinds; or
        None. Not locked."""
        for model in ORDER_MODELS.values():
            order = model.select().where(model.refunded_charge == charge_id).first()
            if order:
                return order
        return None

    def save(self, row: BaseModel) -> None:
        """Write the changed fields of a row read from the database (an UPDATE by its
        id); the write may reach the server with the transaction's next statement. An
        order's changes go to its history, by this handling (`changed_by`)."""
        if isinstance(row, OrderBase) and row.kind is not None:
            self.record_changes(row.kind, row.order_number, row.take_changes(),
                                self.now())
        save_changes(row)

    def subscription_cycle(self, invoice_id: str) -> SubscriptionCycle | None:
        """The renewal a subscription's invoice was recorded as (its order and its
        number), or None."""
        return SubscriptionCycle.get_or_none(SubscriptionCycle.invoice_id == invoice_id)

    def cycles_recorded(self, subscription_id: str) -> int:
        """How many renewals of the subscription are recorded."""
        return (SubscriptionCycle.select()
                .where(SubscriptionCycle.subscription_id == subscription_id).count())

    def record_cycle(self, subscription_id: str, invoice_id: str, order_number: str,
                     cycle: int, at: datetime.datetime) -> None:
        """Record an invoice's renewal number (a unique index refuses a number taken)."""
        SubscriptionCycle.create(subscription_id=subscription_id, invoice_id=invoice_id,
                                 order_number=order_number, cycle=cycle,
                                 created_at=at, updated_at=at)
