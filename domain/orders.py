"""Order operations shared by the card and crypto plugins, written once.

Each runs inside the caller's transaction and asks for its effects through `effects`, so
an event's changes and the mail, jobs and alerts they cause happen together, once."""
import functools
import logging

import peewee

from models import ORDER_MODELS, SubscriptionCycle
from engine import commits
from engine.commits import Ahead, AheadStatement, raise_if_conflict, savepoint
from engine.db import locked
from engine.prepared import ArraySlot, Prepared, save_changes, slot
from domain import payment_state
from domain.money import Money

log = logging.getLogger("receiver.orders")

# The card processor's payment method types, in the words our CRTC orders use.
PAYMENT_METHODS = {
    "card": "card",
    "us_bank_account": "ach",
    "affirm": "bnpl",
    "klarna": "bnpl",
    "afterpay_clearpay": "bnpl",
    "crypto": "crypto",
}
# The payment method of a CRTC order completed without a payment (a checkout that needed
# none): nothing to wait for before its funds count as available.
FREE = "free"


# An order number's prefix tells its kind, by convention (the crypto processor's callbacks
# name no kind); any other is taken for a CRTC order.
ORDER_TYPE_PREFIXES = (
    ("CA-", "canada_crtc"), ("FO-", "formation"), ("BU-", "bundle"), ("CO-", "compliance"))
DEFAULT_ORDER_TYPE = "canada_crtc"

# The source of a crypto payment, and the start of its references (`crypto-<txid>`).
CRYPTO_SOURCE = "crypto"
CRYPTO_REFERENCE = "crypto-"


class OrderNotFound(LookupError):
    """No order of that kind and number (yet): the event is retried later, not dropped,
    because the system that creates orders may not have written it yet."""


def order_type_of(order_number):
    for prefix, order_type in ORDER_TYPE_PREFIXES:
        if order_number.startswith(prefix):
            return order_type
    return DEFAULT_ORDER_TYPE


def payment_method_of(processor_type):
    return PAYMENT_METHODS.get(processor_type or "")


def _order_by_number(model, for_update):
    def build():
        query = model.select().where(model.order_number == slot(model.order_number))
        return locked(query) if for_update else query
    return Prepared(build, on_server=True)


ORDER_BY_NUMBER = {(order_type, for_update): _order_by_number(model, for_update)
                   for order_type, model in ORDER_MODELS.items() for for_update in (False, True)}


def find_order(order_type, order_number, for_update=False):
    """The order of that kind and number, or None; `for_update`: locked for the
    transaction, and taken from the turn's orders read ahead (`OrderAhead`) when kept."""
    if for_update:
        kept = commits.take_row(ORDER_MODELS[order_type], order_number)
        if kept is not commits.NOT_KEPT:
            return kept
    return ORDER_BY_NUMBER[order_type, for_update].first(order_number=order_number)


def _orders_by_numbers(model):
    """`_order_by_number` locked, for several numbers at once, in their order: two
    processes lock the same orders in the same order."""
    return Prepared(lambda: locked(model.select().where(
        model.order_number == peewee.fn.ANY(peewee.Cast(
            ArraySlot("numbers", model.order_number), "text[]"))).order_by(model.order_number)))


# Not prepared on the server, as NAMES_OF_ANY_KIND (below).
ORDERS_BY_NUMBERS = {order_type: _orders_by_numbers(model)
                     for order_type, model in ORDER_MODELS.items()}


class OrderAhead(Ahead):
    """The order a plugin locks and reads (`find_order(..., for_update=True)`), read
    ahead with the turn's others of its kind (engine.commits.Ahead: a part of the
    statement that inserts the turn's events), locked as the plugin's own read would
    lock it, and kept for the turn (`commits.keep_rows`): the plugin's read takes it,
    unless a write to its table in the turn came first and dropped it; a second read
    goes to the database. Asked for where the call's unit will read it (a plugin's
    `ahead`, plugins.registry): an order read ahead and not taken (the call was a copy)
    stays locked until the turn's COMMIT all the same. Locked before the unit's own
    writes (a crypto payment's treasury job), where the unit alone would lock it after
    them: a deadlock with a process locking in the other order is a conflict, and its
    unit is run again (engine.commits)."""

    def __init__(self, order_type: str, order_number: str) -> None:
        self.order_type, self.order_number = order_type, order_number

    @classmethod
    def statements(cls, items: list[Ahead]) -> list[AheadStatement]:
        """The turn's orders locked in one order, whichever kind of item asked: kind
        after kind (by name), each kind's by number. Two turns that lock the same orders
        then lock them in the same order, and neither waits on the other while holding
        what the other waits for (a deadlock). The names read ahead
        (`OrderNameAhead`, made here) lock every order asked for; the orders read in
        full after them are then the turn's already."""
        by_kind: dict[str, list[OrderAhead]] = {}
        named = []
        for item in items:
            if isinstance(item, OrderNameAhead):
                named.append(item)
            elif isinstance(item, OrderAhead):
                by_kind.setdefault(item.order_type, []).append(item)
        read_in_full = [item.order_number for of_a_kind in by_kind.values()
                        for item in of_a_kind]
        locking = [OrderNameAhead.locking(named, read_in_full)] if named else []
        return locking + [cls._locking(order_type, by_kind[order_type])
                          for order_type in sorted(by_kind)]

    @staticmethod
    def _locking(order_type: str, items: list["OrderAhead"]) -> AheadStatement:
        """The statement that locks and reads the orders of one kind."""
        numbers = sorted({item.order_number for item in items})
        statement = ORDERS_BY_NUMBERS[order_type]

        def take(names, rows):
            found = dict.fromkeys(numbers)
            for order in statement.instances(names, rows):
                found[order.order_number] = order
            commits.keep_rows(ORDER_MODELS[order_type], found)
            for item in items:
                item.done = True
        return statement.ahead(take, numbers=numbers)


def find_any_kind(order_number):
    """The order with that number, whatever its kind, or None. The kind its prefix
    names is looked in first."""
    first = order_type_of(order_number)
    for order_type in (first, *(kind for kind in ORDER_MODELS if kind != first)):
        order = find_order(order_type, order_number)
        if order is not None:
            return order
    return None


def _every_order_table(select):
    """One statement for every order table: the rows `select(model, kind)` gives for each,
    `kind` the column that names the table's kind; the tables in the order of their
    kinds' names (the order a turn locks orders in, OrderAhead)."""
    selects = [select(model, peewee.Value(kind).alias("kind"))
               for kind, model in sorted(ORDER_MODELS.items())]
    return functools.reduce(lambda union, select: union.union_all(select), selects)


def _name_of_any_kind():
    """(kind, order_name) of each order with that number (at most one a kind)."""
    return _every_order_table(lambda model, kind: model.select(kind, model.order_name)
                              .where(model.order_number == slot(model.order_number)))


NAME_OF_ANY_KIND = Prepared(_name_of_any_kind, on_server=True)


def _names_of_any_kind():
    """`_name_of_any_kind` for several numbers at once, each order locked, the kinds in
    turn and each kind's by number (OrderAhead): (kind, order_number, order_name)."""
    def locked_names(model, kind):
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


class OrderNameAhead(Ahead):
    """The order name a workflow call's plugin reads (`remember_order_name`), read ahead
    with the turn's others (engine.commits.Ahead) and kept for the turn: used by the
    first read of that order's name in the turn, which comes before the only write of a
    name (RENAME) that could make it stale; a second read goes to the database. The
    orders of that number, of every kind, are locked as they are read, in the turn's
    one order with the orders the payments lock (`OrderAhead`, which makes the
    statement): the call may rename one, or move its fulfilment status."""

    together_with = OrderAhead

    def __init__(self, order_number: str) -> None:
        self.order_number = order_number

    @staticmethod
    def locking(items: list["OrderNameAhead"], also: list[str]) -> AheadStatement:
        """The statement that locks and reads the names of the orders of `items`' numbers
        and `also`'s, of every kind."""
        asked = {item.order_number for item in items}

        def take(names, rows):
            found: dict[str, dict[str, str | None]] = {number: {} for number in asked}
            for kind, number, name in rows:
                if number in asked:
                    found[number][kind] = name
            commits.for_this_turn(OrderNameAhead, dict).update(found)
            for item in items:
                item.done = True
        return NAMES_OF_ANY_KIND.ahead(take, numbers=sorted(asked.union(also)))


def order_name_of_any_kind(order_number):
    """(kind, order_name) of the order with that number, whatever its kind, in one
    round trip (none when read ahead, `OrderNameAhead`); the kind its prefix names wins
    (as in find_any_kind). None when no order has that number."""
    found = None
    if commits.together():
        found = commits.for_this_turn(OrderNameAhead, dict).pop(order_number, None)
    if found is None:
        found = dict(NAME_OF_ANY_KIND.execute(order_number=order_number).fetchall())
    if not found:
        return None
    first = order_type_of(order_number)
    kind = first if first in found else next(kind for kind in ORDER_MODELS if kind in found)
    return kind, found[kind]


def document_name(order):
    """The name of the order's document in the workflow system: the order_name its
    webhooks gave, or, while none has come, the order number."""
    return order.order_name or order.order_number


RENAME = {order_type: Prepared(lambda model=model: model.update(
    order_name=slot(model.order_name), updated_at=slot(model.updated_at)).where(
    model.order_number == slot(model.order_number)), on_server=True)
    for order_type, model in ORDER_MODELS.items()}


def remember_order_name(ctx, order_number, order_name):
    """Keep the workflow system's document name on the order with that number (of any
    kind), for every later call and job about it; True when it changed. An order not
    stored yet gets it from its next webhook.

    A failure here is logged and does not spoil the webhook's own job and action (the
    order keeps the name it had, or its number stands in)."""
    try:
        with savepoint():
            found = order_name_of_any_kind(order_number)
            if found is None or found[1] == order_name:
                return False
            RENAME[found[0]].execute_later(order_name=order_name, updated_at=ctx.clock(),
                                           order_number=order_number)
            return True
    except peewee.PeeweeException as failure:
        raise_if_conflict(failure)
        log.exception("order %s: its workflow document name %r not kept", order_number,
                      order_name)
        return False


def complete_payment(ctx, effects, order_id, order_type, reference, *, source,
                     payment_intent_id=None, payment_method=None, free_because=None,
                     amount=None, coins=None):
    """Mark an order's payment received, once (BEHAVIOUR.md 4.2, "Completing a payment").

    A first completion keeps the fact (domain.payment_state), and with it paid_at, the
    reference (stripe_session_id), the payment intent, the amount (`amount`, a Money;
    `coins`, what a crypto payment paid it with, as text) and, on CRTC orders, the
    payment method; its payment_status is then what the order's facts give: `paid`, or
    still `disputed` (or refunded) when Stripe told of a dispute (or refund) first. It
    re-dispatches a parent order with gov_fee_paid=true and sends one order alert, with
    the amount. `free_because` (a checkout that needed no payment) completes it all the
    same, says why in a note line and in the alert, which does not call the order paid.
    An order whose payment was received already only gets a missing payment-intent id
    (or CRTC payment method) filled in; a different payment is told as a second one.
    Returns (order, newly_paid)."""
    if order_type not in ORDER_MODELS:
        raise ValueError(f"unknown order type {order_type!r}")
    order = find_order(order_type, order_id, for_update=True)
    if order is None:
        raise OrderNotFound(f"no {order_type} order {order_id}")
    now = ctx.clock()
    if payment_state.received(order):
        if not _same_payment(order, reference, payment_intent_id, source):
            _another_payment(ctx, effects, order, reference, source, amount)
            return order, False
        if _fill_in_missing(order, payment_intent_id, payment_method, amount):
            order.updated_at = now
            save_changes(order)
        log.info("%s order %s is already paid; nothing more to do", order_type, order_id)
        if order.parent_order_number:
            # Once per parent and child (the job's key): a retry finds the parent now.
            _redispatch_parent(effects, order)
        _check_payment_method(ctx, effects, order)
        return order, False

    payment_state.merge_received(order, amount)
    order.paid_at = now
    order.stripe_session_id = reference
    order.stripe_payment_intent_id = payment_intent_id or order.stripe_payment_intent_id
    if order_type == "canada_crtc" and payment_method:
        order.payment_method = payment_method
    if free_because:
        order.append_note(f"No payment required: {free_because} "
                          f"({now.isoformat(timespec='seconds')})")
    settle_status(ctx, order)

    if order.parent_order_number:
        _redispatch_parent(effects, order)
    effects.alert(order_alert_text(order, source, free_because, amount, coins),
                  key=f"alert-paid-{order_type}-{order_id}", order_number=order_id)
    log.info("%s order %s paid via %s (%s)", order_type, order_id, source, reference)
    _check_payment_method(ctx, effects, order)
    return order, True


def settle_status(ctx, order):
    """Save the order with the payment status its facts give (domain.payment_state);
    returns (the status it had, the one it has)."""
    before = order.payment_status
    order.payment_status = payment_state.status_of(order)
    order.updated_at = ctx.clock()
    save_changes(order)
    return before, order.payment_status


def _same_payment(order, reference, payment_intent_id, source):
    """Whether a completion for an order whose payment was received is about the payment
    recorded. A checkout session and its payment intent are one payment under two ids,
    and either event may come first, so a match on either id counts. Every crypto
    callback of an order is about its one invoice (SHKeeper keeps one per external id),
    whichever transaction it names."""
    recorded = {order.stripe_session_id, order.stripe_payment_intent_id} - {None}
    if source == CRYPTO_SOURCE and (order.stripe_session_id or "").startswith(
            CRYPTO_REFERENCE):
        return True
    return reference in recorded or (payment_intent_id or None) in recorded


def _another_payment(ctx, effects, order, reference, source, amount):
    """The order was paid, and now a different payment arrived for it (a second checkout,
    or crypto after card): the customer may be owed a refund, so a person must look."""
    log.warning("%s order %s is already paid (%s) and received another %s payment %s; "
                "a refund may be due", order.kind, order.order_number,
                order.stripe_session_id, source, reference)
    email_admin(ctx, effects, f"Second payment for order {order.order_number}",
                "second_payment", order.order_number,
                key=f"email-second-payment-{order.kind}-{order.order_number}-{reference}",
                kind=order.kind, source=source, reference=reference,
                recorded=order.stripe_session_id, amount=amount and str(amount),
                recorded_amount=paid_amount(order),
                customer_name=order.customer_name, customer_email=order.customer_email)


def paid_amount(order):
    """What the order's payment received, as text (`$499.00`), or None when unknown."""
    if order.payment_amount is None or not order.payment_currency:
        return None
    return str(Money.of(order.payment_amount, order.payment_currency))


def _check_payment_method(ctx, effects, order):
    """Settlement selects CRTC orders by payment method; a paid one without a method would
    never settle, silently. Stripe does not expand the charge in webhook events, so a
    session that allowed several methods cannot tell us which was used."""
    if order.kind != "canada_crtc" or order.payment_method:
        return
    log.warning("CRTC order %s is paid but its payment method is unknown; it will not "
                "settle until payment_method is set", order.order_number)
    email_admin(ctx, effects, f"Payment method unknown for CRTC order {order.order_number}",
                "payment_method_unknown", order.order_number,
                key=f"email-payment-method-unknown-{order.order_number}",
                reference=order.stripe_session_id,
                payment_intent=order.stripe_payment_intent_id, amount=paid_amount(order))


def _fill_in_missing(order, payment_intent_id, payment_method, amount):
    """A later event of the same payment may know what the first did not: the payment
    intent, the amount, or (on CRTC orders, where settlement depends on it) the payment
    method."""
    changed = False
    if amount is not None and amount.currency and order.payment_amount is None:
        order.payment_amount, order.payment_currency = amount.minor, amount.currency
        changed = True
    if payment_intent_id and not order.stripe_payment_intent_id:
        order.stripe_payment_intent_id = payment_intent_id
        changed = True
    if order.kind == "canada_crtc" and payment_method and not order.payment_method:
        order.payment_method = payment_method
        changed = True
    return changed


def email_admin(ctx, effects, subject, template, order, key=None, **variables):
    """An e-mail to ADMIN_EMAIL about order number `order` (templates see it as `order`);
    logged instead when no administrator is configured. Named by `key`, or else by its
    template among its event's effects."""
    if not ctx.settings.admin_email:
        log.warning("ADMIN_EMAIL unset; not e-mailed: %s", subject)
        return
    effects.email([ctx.settings.admin_email], subject, f"email/{template}", purpose=template,
                  key=key, order_number=order, title=subject, order=order, **variables)


def _redispatch_parent(effects, child):
    """The child collected the parent's government fee: the parent's service runs again,
    now with the fee paid. A parent not known yet (the system that writes orders may be
    behind) is looked for again when the event is retried; the child stays paid."""
    parent = find_any_kind(child.parent_order_number)
    if parent is None:
        log.warning("order %s names parent %s, which is not known yet; re-dispatch retried",
                    child.order_number, child.parent_order_number)
        effects.retry_later(f"parent order {child.parent_order_number} of "
                            f"{child.order_number} not found")
        return
    effects.job("process_compliance_service", {
        "order_name": document_name(parent),
        "order_number": parent.order_number,
        "service_slug": getattr(parent, "service_slug", None) or "",
        "gov_fee_paid": True,
    }, key=f"job-gov-fee-paid-{parent.order_number}-{child.order_number}")


def order_alert_text(order, source, free_because=None, amount=None, coins=None):
    if free_because:
        lines = [f"New order {order.order_number} ({order.kind}): no payment required",
                 f"Why: {free_because}", f"Source: {source}"]
    else:
        lines = [f"New paid order {order.order_number} ({order.kind})", f"Source: {source}"]
    if amount is not None:
        lines.append(f"Amount: {amount}" + (f" ({coins})" if coins else ""))
    if order.service_name:
        lines.append(f"Service: {order.service_name}")
    if order.discount_code:
        lines.append(f"Campaign discount code: {order.discount_code}")
    return "\n".join(lines)


def mark_payment_failed(ctx, order_number, reason, failed_at):
    """BEHAVIOUR.md 4.2 payment_intent.payment_failed: the failure is kept on every order
    of any kind with that number (domain.payment_state.merge_failure), and those whose
    payment was not received become `failed`, with a note line; one whose payment was
    received keeps its status (the failure was of an earlier or another attempt).
    Returns (the orders marked failed, the orders left as they were)."""
    now = ctx.clock()
    marked, left = [], []
    for model in ORDER_MODELS.values():
        for order in locked(model.select().where(model.order_number == order_number)):
            newer = payment_state.merge_failure(order, failed_at) is payment_state.Change.NEWER
            if payment_state.received(order):
                if newer:
                    order.updated_at = now
                    save_changes(order)
                left.append(order)
                continue
            order.append_note(f"Payment failed: {reason} ({now.isoformat(timespec='seconds')})")
            settle_status(ctx, order)
            marked.append(order)
    return marked, left


def find_by_payment_intent(payment_intent_id):
    """The order a payment intent paid: exact match on stripe_payment_intent_id first, then
    (BEHAVIOUR.md) a substring match on the reference, across the four kinds; or None.
    Not locked: the caller locks the order it keeps a fact on (domain.payment_events)."""
    if not payment_intent_id:
        return None
    for model in ORDER_MODELS.values():
        order = model.select().where(
            model.stripe_payment_intent_id == payment_intent_id).first()
        if order:
            return order
    for model in ORDER_MODELS.values():
        # ILIKE narrows it down; the case-sensitive test makes it exact (ids are).
        for order in model.select().where(
                model.stripe_session_id.contains(payment_intent_id)):
            if payment_intent_id in order.stripe_session_id:
                return order
    return None


def record_cycle(ctx, order, subscription_id, invoice_id):
    """The renewal number of a paid invoice: 1 + the renewals recorded before it. The same
    invoice keeps its number; two invoices racing for one number cannot both have it (a
    unique index), so the loser fails and is retried with the next number."""
    known = SubscriptionCycle.get_or_none(SubscriptionCycle.invoice_id == invoice_id)
    if known:
        return known.cycle
    cycle = 1 + (SubscriptionCycle.select()
                 .where(SubscriptionCycle.subscription_id == subscription_id).count())
    now = ctx.clock()
    SubscriptionCycle.create(subscription_id=subscription_id, invoice_id=invoice_id,
                             order_number=order.order_number, cycle=cycle,
                             created_at=now, updated_at=now)
    return cycle
