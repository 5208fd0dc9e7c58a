"""Order operations shared by the card and crypto plugins, written once.

Each runs inside the caller's transaction, `tx`: it reads and writes the orders through
it and asks for its effects through it, so an event's changes and the mail, jobs and
alerts they cause happen together, once. Orders are read with `tx.order(kind, number)`,
locked with `tx.lock_order(kind, number)`, of whatever kind with `find_any_kind(tx,
number)`, by the payment intent that paid them with `tx.order_paid_by(payment_intent_id)`,
and saved with `tx.save(order)`."""
import datetime
import logging
from typing import Any

from models import ORDER_MODELS, CrtcOrder, OrderBase
from engine.contracts import EngineContext
from engine.transaction import Transaction
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


def order_type_of(order_number: str) -> str:
    """The kind of order its number's prefix names (DEFAULT_ORDER_TYPE for any other)."""
    for prefix, order_type in ORDER_TYPE_PREFIXES:
        if order_number.startswith(prefix):
            return order_type
    return DEFAULT_ORDER_TYPE


def payment_method_of(processor_type: str | None) -> str | None:
    """Our CRTC orders' word for the card processor's payment method type, or None."""
    return PAYMENT_METHODS.get(processor_type or "")


def find_any_kind(tx: Transaction, order_number: str) -> OrderBase | None:
    """The order with that number, whatever its kind, or None; the kind its prefix names
    is looked in first."""
    return tx.order_of_any_kind(order_number, order_type_of(order_number))


def order_name_of_any_kind(tx: Transaction,
                           order_number: str) -> tuple[str, str | None] | None:
    """(kind, order_name) of the order with that number, whatever its kind; the kind its
    prefix names wins (as in `find_any_kind`). None when no order has that number."""
    found = tx.names_of(order_number)
    if not found:
        return None
    first = order_type_of(order_number)
    kind = first if first in found else next(kind for kind in ORDER_MODELS if kind in found)
    return kind, found[kind]


def document_name(order: OrderBase) -> str:
    """The name of the order's document in the workflow system: the order_name its
    webhooks gave, or, while none has come, the order number."""
    return order.order_name or order.order_number


def remember_order_name(ctx: EngineContext, tx: Transaction, order_number: str,
                        order_name: str) -> bool:
    """Keep the workflow system's document name on the order with that number (of any
    kind), for every later call and job about it; True when it changed. An order not
    stored yet gets it from its next webhook.

    A failure here is logged and does not spoil the webhook's own job and action (the
    order keeps the name it had, or its number stands in)."""
    renamed = False
    with tx.apart(f"order {order_number}: its workflow document name "
                  f"{order_name!r} not kept") as part:
        found = order_name_of_any_kind(tx, order_number)
        if found is not None and found[1] != order_name:
            tx.rename_order(found[0], order_number, order_name, found[1], ctx.clock())
            renamed = True
    return renamed and not part.failed


def complete_payment(ctx: EngineContext, tx: Transaction, order_id: str, order_type: str,
                     reference: str, *, source: str, payment_intent_id: str | None = None,
                     payment_method: str | None = None, free_because: str | None = None,
                     amount: Money | None = None, coins: str | None = None,
                     paid_at: datetime.datetime | None = None,
                     by_checkout: bool = False) -> tuple[OrderBase, bool]:
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
    `paid_at`: when the sender says the payment was made (the earliest any of its events
    says is kept; without one, now). `by_checkout`: `reference` is the payment's checkout
    session, the order's reference whichever of the payment's events came first.
    Returns (order, newly_paid)."""
    if order_type not in ORDER_MODELS:
        raise ValueError(f"unknown order type {order_type!r}")
    order = tx.lock_order(order_type, order_id)
    if order is None:
        raise OrderNotFound(f"no {order_type} order {order_id}")
    now = ctx.clock()
    if payment_state.received(order):
        if not _same_payment(order, reference, payment_intent_id, source):
            _another_payment(ctx, tx, order, reference, source, amount)
            return order, False
        if _fill_in_missing(order, payment_intent_id, payment_method, amount, paid_at,
                            reference if by_checkout else None):
            order.updated_at = now
            tx.save(order)
        log.info("%s order %s is already paid; nothing more to do", order_type, order_id)
        if order.parent_order_number:
            # Once per parent and child (the job's key): a retry finds the parent now.
            _redispatch_parent(tx, order, order.parent_order_number)
        _check_payment_method(ctx, tx, order)
        return order, False

    payment_state.merge_received(order, amount)
    order.paid_at = paid_at or now
    if by_checkout or not _checkout_kept(order, payment_intent_id):
        order.stripe_session_id = reference
    order.stripe_payment_intent_id = payment_intent_id or order.stripe_payment_intent_id
    if isinstance(order, CrtcOrder) and payment_method:
        order.payment_method = payment_method
    if free_because:
        order.append_note(f"No payment required: {free_because} "
                          f"({now.isoformat(timespec='seconds')})")
    settle_status(ctx, tx, order)

    if order.parent_order_number:
        _redispatch_parent(tx, order, order.parent_order_number)
    tx.alert(order_alert_text(order, source, free_because, amount, coins),
             key=f"alert-paid-{order_type}-{order_id}", order_number=order_id)
    log.info("%s order %s paid via %s (%s)", order_type, order_id, source, reference)
    _check_payment_method(ctx, tx, order)
    return order, True


def settle_status(ctx: EngineContext, tx: Transaction,
                  order: OrderBase) -> tuple[str, str]:
    """Save the order with the payment status its facts give (domain.payment_state);
    returns (the status it had, the one it has)."""
    before = order.payment_status
    order.payment_status = payment_state.status_of(order)
    order.updated_at = ctx.clock()
    tx.save(order)
    return before, order.payment_status


def _same_payment(order: OrderBase, reference: str, payment_intent_id: str | None,
                  source: str) -> bool:
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


def _another_payment(ctx: EngineContext, tx: Transaction, order: OrderBase, reference: str,
                    source: str, amount: Money | None) -> None:
    """The order was paid, and now a different payment arrived for it (a second checkout,
    or crypto after card): the customer may be owed a refund, so a person must look."""
    log.warning("%s order %s is already paid (%s) and received another %s payment %s; "
                "a refund may be due", order.kind, order.order_number,
                order.stripe_session_id, source, reference)
    email_admin(ctx, tx, f"Second payment for order {order.order_number}",
                "second_payment", order.order_number,
                key=f"email-second-payment-{order.kind}-{order.order_number}-{reference}",
                kind=order.kind, source=source, reference=reference,
                recorded=order.stripe_session_id, amount=amount and str(amount),
                recorded_amount=paid_amount(order),
                customer_name=order.customer_name, customer_email=order.customer_email)


def paid_amount(order: OrderBase) -> str | None:
    """What the order's payment received, as text (`$499.00`), or None when unknown."""
    if order.payment_amount is None or not order.payment_currency:
        return None
    return str(Money.of(order.payment_amount, order.payment_currency))


def _check_payment_method(ctx: EngineContext, tx: Transaction, order: OrderBase) -> None:
    """Settlement selects CRTC orders by payment method; a paid one without a method would
    never settle, silently. Stripe does not expand the charge in webhook events, so a
    session that allowed several methods cannot tell us which was used."""
    if not isinstance(order, CrtcOrder) or order.payment_method:
        return
    log.warning("CRTC order %s is paid but its payment method is unknown; it will not "
                "settle until payment_method is set", order.order_number)
    email_admin(ctx, tx, f"Payment method unknown for CRTC order {order.order_number}",
                "payment_method_unknown", order.order_number,
                key=f"email-payment-method-unknown-{order.order_number}",
                reference=order.stripe_session_id,
                payment_intent=order.stripe_payment_intent_id, amount=paid_amount(order))


def _fill_in_missing(order: OrderBase, payment_intent_id: str | None,
                     payment_method: str | None, amount: Money | None,
                     paid_at: datetime.datetime | None, session_id: str | None) -> bool:
    """A later event of the same payment may know what the first did not: the payment
    intent, the amount, (on CRTC orders, where settlement depends on it) the payment
    method, an earlier time of the payment, or its checkout session (the reference)."""
    changed = False
    if paid_at is not None and (order.paid_at is None or paid_at < order.paid_at):
        order.paid_at = paid_at
        changed = True
    if session_id and order.stripe_session_id != session_id:
        order.stripe_session_id = session_id
        changed = True
    if amount is not None and amount.currency and order.payment_amount is None:
        order.payment_amount, order.payment_currency = amount.minor, amount.currency
        changed = True
    if payment_intent_id and not order.stripe_payment_intent_id:
        order.stripe_payment_intent_id = payment_intent_id
        changed = True
    if isinstance(order, CrtcOrder) and payment_method and not order.payment_method:
        order.payment_method = payment_method
        changed = True
    return changed


def remember_checkout(ctx: EngineContext, tx: Transaction, order_id: str, order_type: str,
                      session_id: str, payment_intent_id: str) -> None:
    """The checkout session and the payment intent it started for the order, kept before
    it is paid (a bank debit clearing), so that the intent's own events, and a dispute
    or refund of it, find the order, and its reference is the session's. OrderNotFound
    when the order is not stored yet."""
    order = tx.lock_order(order_type, order_id)
    if order is None:
        raise OrderNotFound(f"no {order_type} order {order_id}")
    if not order.stripe_payment_intent_id and not payment_state.received(order):
        order.stripe_payment_intent_id = payment_intent_id
        order.stripe_session_id = session_id
        order.updated_at = ctx.clock()
        tx.save(order)


def _checkout_kept(order: OrderBase, payment_intent_id: str | None) -> bool:
    """Whether the order keeps the checkout session of this payment intent already (an
    unpaid checkout's: `remember_checkout`)."""
    return bool(order.stripe_session_id and payment_intent_id
                and order.stripe_payment_intent_id == payment_intent_id)


def email_admin(ctx: EngineContext, tx: Transaction, subject: str, template: str,
                order: str, key: str | None = None, **variables: Any) -> None:
    """An e-mail to ADMIN_EMAIL about order number `order` (templates see it as `order`);
    logged instead when no administrator is configured. Named by `key`, or else by its
    template among its event's effects."""
    if not ctx.settings.admin_email:
        log.warning("ADMIN_EMAIL unset; not e-mailed: %s", subject)
        return
    tx.email([ctx.settings.admin_email], subject, f"email/{template}", purpose=template,
             key=key, order_number=order, title=subject, order=order, **variables)


def _redispatch_parent(tx: Transaction, child: OrderBase, parent_number: str) -> None:
    """The child collected the parent's government fee: the parent's service runs again,
    now with the fee paid. A parent not known yet (the system that writes orders may be
    behind) is looked for again when the event is retried; the child stays paid."""
    parent = find_any_kind(tx, parent_number)
    if parent is None:
        log.warning("order %s names parent %s, which is not known yet; re-dispatch retried",
                    child.order_number, parent_number)
        tx.retry_later(f"parent order {parent_number} of "
                       f"{child.order_number} not found")
        return
    tx.job("process_compliance_service", {
        "order_name": document_name(parent),
        "order_number": parent.order_number,
        "service_slug": getattr(parent, "service_slug", None) or "",
        "gov_fee_paid": True,
    }, key=f"job-gov-fee-paid-{parent.order_number}-{child.order_number}")


def order_alert_text(order: OrderBase, source: str, free_because: str | None = None,
                     amount: Money | None = None, coins: str | None = None) -> str:
    """The alert of a completed order: what, how much, from where."""
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


def mark_payment_failed(ctx: EngineContext, tx: Transaction, order_number: str, reason: str,
                        failed_at: datetime.datetime) -> tuple[list[OrderBase], list[OrderBase]]:
    """BEHAVIOUR.md 4.2 payment_intent.payment_failed: the failure is kept on every order
    of any kind with that number (domain.payment_state.merge_failure), and those whose
    payment was not received become `failed`, with a note line (once per failure: a
    failure told again at the same time adds none); one whose payment was
    received keeps its status (the failure was of an earlier or another attempt).
    Returns (the orders marked failed, the orders left as they were)."""
    now = ctx.clock()
    marked: list[OrderBase] = []
    left: list[OrderBase] = []
    for order in tx.lock_orders_numbered(order_number):
        newer = payment_state.merge_failure(order, failed_at) is payment_state.Change.NEWER
        if payment_state.received(order):
            if newer:
                order.updated_at = now
                tx.save(order)
            left.append(order)
            continue
        if newer:  # a copy of a failure kept already adds no line
            order.append_note(f"Payment failed: {reason} "
                              f"({failed_at.isoformat(timespec='seconds')})")
            settle_status(ctx, tx, order)
        marked.append(order)
    return marked, left


def record_cycle(ctx: EngineContext, tx: Transaction, order: OrderBase, subscription_id: str,
                 invoice_id: str) -> int:
    """The renewal number of a paid invoice: 1 + the renewals recorded before it. The same
    invoice keeps its number; two invoices racing for one number cannot both have it (a
    unique index), so the loser fails and is retried with the next number."""
    known = tx.subscription_cycle(invoice_id)
    if known is not None:
        return int(known.cycle)
    cycle = 1 + tx.cycles_recorded(subscription_id)
    tx.record_cycle(subscription_id, invoice_id, order.order_number, cycle, ctx.clock())
    return cycle
