"""checkout.session.completed: a Checkout Session finished.

Paid now (card): the order is paid. Unpaid (a bank debit still clearing): wait for
payment_intent.succeeded. Nothing to pay (`no_payment_required`: a 100 % discount, a free
price, a subscription's trial; no payment intent): the order is completed as a paid
checkout is, marked as free (`domain.orders.complete_payment`'s `free_because`). A
subscription-mode session links its subscription to the compliance order, paid or not, so
renewals and cancellation find the order; an unpaid one keeps its session and payment
intent on the order. The facts that came before it (a dispute, a refund, a renewal, the intent's own
success), waiting for their order, are handled once these links are committed. A session
naming an order not stored yet waits for it, as those facts do. The
order is paid as of the event's `created`, and its reference is the session's id
whichever of the payment's events came first.

Async, because a CRTC session that allowed several methods needs Stripe asked which one
was used (settlement depends on it), and that call must not hold a transaction open.
Every other session needs no other system, and `plainly` gives the engine its plain
handling, run in the unit that stores the event (engine.inbox). The steps are
idempotent, so running this again is safe.
"""
import functools
import logging
from typing import Any, Callable

from models import ORDER_MODELS, ComplianceOrder
from plugins.registry import card_event
from plugins.card import ONCE_PER_OBJECT
from domain.card_events import (ids_of, linked, metadata_of, method_of_payment, object_of,
                                order_of_metadata, payment_method_used)
from domain.money import Money
from domain.orders import FREE, OrderNotFound, complete_payment, remember_checkout
from domain.payment_state import as_of
from engine.contracts import EngineContext
from engine.transaction import OrderRef, Transaction

log = logging.getLogger("receiver.card")

# Why a session needed no payment, by its mode, as the order's note and alert say it.
NOTHING_TO_PAY = {
    "payment": "checkout total 0 (a 100 % discount or a free price)",
    "subscription": "nothing charged at checkout (a trial or a discount); the "
                    "subscription's invoices are charged later",
}


class CheckoutSessionCompleted:
    async def __call__(self, ctx: EngineContext, event: dict[str, Any],
                       tx: Transaction) -> None:
        session = object_of(event)
        order = order_of_metadata(session)
        if order is None:
            return
        method = None
        if _paid(session):
            method = await method_of_payment(ctx, session, order[1],
                                             session.get("payment_intent"))
        await tx.transaction(functools.partial(record, ctx, event, tx, method))

    def plainly(self, event: dict[str, Any]
                ) -> Callable[[EngineContext, dict[str, Any], Transaction], None] | None:
        """The plain handling of a session whose method needs no asking (its only
        allowed method says it, it is not paid yet, or its order is not a CRTC one), or
        None."""
        session = object_of(event)
        method = payment_method_used(session)
        if (_paid(session) and method is None
                and metadata_of(session).get("order_type") == "canada_crtc"):
            return None
        return functools.partial(record, method=method)

    def orders_of(self, event: dict[str, Any]) -> tuple[OrderRef, ...]:
        """The order the plain handling completes (locked and read by `record`); none
        when the session is handled once stored, or completes nothing yet."""
        session = object_of(event)
        order = metadata_of(session)
        order_id, order_type = order.get("order_id"), order.get("order_type")
        if (not isinstance(order_id, str) or order_type not in ORDER_MODELS
                or not (_paid(session) or _free_because(session))
                or self.plainly(event) is None):
            return ()
        return (OrderRef(order_type, order_id),)


card_event("checkout.session.completed", ONCE_PER_OBJECT)(CheckoutSessionCompleted())


def _paid(session: dict[str, Any]) -> bool:
    return session.get("payment_status") == "paid"


def _free_because(session: dict[str, Any]) -> str | None:
    """Why the session needed no payment, or None when it did."""
    if session.get("payment_status") != "no_payment_required":
        return None
    return NOTHING_TO_PAY.get(session.get("mode") or "")


def record(ctx: EngineContext, event: dict[str, Any], tx: Transaction,
           method: str | None) -> None:
    """In a transaction: the order paid (with `method`), completed as free, or left to
    wait for its payment to clear; a subscription linked to its order. An order not stored
    yet (the shop sends it later): the event waits for it (BEHAVIOUR.md 4.2 rule 7),
    nothing written, and is handled when it is stored."""
    session = object_of(event)
    order = order_of_metadata(session)
    if order is None:
        return
    order_id, order_type = order
    try:
        _record_for(ctx, event, tx, method, order_id, order_type)
    except OrderNotFound:
        subscription = session.get("subscription")
        tx.wait_for_order(f"checkout session {session['id']}: no {order_type} order "
                          f"{order_id} yet", ids_of(order=order_id,
                                                    subscription=subscription))


def _record_for(ctx: EngineContext, event: dict[str, Any], tx: Transaction,
                method: str | None, order_id: str, order_type: str) -> None:
    """`record` for the order the session names; OrderNotFound, nothing written, when it
    is not stored."""
    session = object_of(event)
    free_because = _free_because(session)
    amount = Money.of_stripe(session.get("amount_total"), session.get("currency"))
    paid_at = as_of(event.get("created"), ctx.clock())
    intent = session.get("payment_intent") if isinstance(
        session.get("payment_intent"), str) else None
    if _paid(session):
        complete_payment(ctx, tx, order_id, order_type, session["id"],
                         source="card", payment_intent_id=intent,
                         payment_method=method, amount=amount, paid_at=paid_at,
                         by_checkout=True)
    elif free_because:
        complete_payment(ctx, tx, order_id, order_type, session["id"],
                         source="card", payment_method=FREE, free_because=free_because,
                         amount=amount, paid_at=paid_at, by_checkout=True)
    else:
        log.info("session %s for %s is %s; waiting for the payment to clear",
                 session["id"], order_id, session.get("payment_status"))
        if intent:
            remember_checkout(ctx, tx, order_id, order_type, session["id"], intent)
    subscription = None
    if session.get("mode") == "subscription" and session.get("subscription"):
        subscription = session["subscription"]
        link_subscription(ctx, tx, order_id, order_type, subscription)
    # The facts about this payment that came first, waiting for their order, find it now.
    linked(ctx, tx, payment_intent=intent, subscription=subscription)


def link_subscription(ctx: EngineContext, tx: Transaction, order_id: str, order_type: str,
                      subscription_id: str) -> None:
    if order_type != "compliance":
        log.error("subscription %s belongs to %s order %s, not a compliance order; not kept",
                  subscription_id, order_type, order_id)
        return
    order = tx.lock_order("compliance", order_id)
    if not isinstance(order, ComplianceOrder):  # None: not stored (yet)
        raise OrderNotFound(f"no compliance order {order_id}")
    order.stripe_subscription_id = subscription_id
    order.updated_at = ctx.clock()
    tx.save(order)
