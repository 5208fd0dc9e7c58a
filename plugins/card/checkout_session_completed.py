"""checkout.session.completed: a Checkout Session finished.

Paid now (card): the order is paid. Unpaid (a bank debit still clearing): wait for
payment_intent.succeeded. Nothing to pay (`no_payment_required`: a 100 % discount, a free
price, a subscription's trial; no payment intent): the order is completed as a paid
checkout is, marked as free (`domain.orders.complete_payment`'s `free_because`). A
subscription-mode session links its subscription to the compliance order, paid or not, so
renewals and cancellation find the order.

Async, because a CRTC session that allowed several methods needs Stripe asked which one
was used (settlement depends on it), and that call must not hold a transaction open. The
steps are idempotent, so running this again is safe.
"""
import logging

from plugins.registry import card_event
from domain.card_events import method_of_payment, object_of, order_of_metadata
from domain.orders import FREE, OrderNotFound, complete_payment, find_order

log = logging.getLogger("receiver.card")

# Why a session needed no payment, by its mode, as the order's note and alert say it.
NOTHING_TO_PAY = {
    "payment": "checkout total 0 (a 100 % discount or a free price)",
    "subscription": "nothing charged at checkout (a trial or a discount); the "
                    "subscription's invoices are charged later",
}


@card_event("checkout.session.completed")
async def handle(ctx, event, effects):
    session = object_of(event)
    order = order_of_metadata(session)
    if order is None:
        return
    order_id, order_type = order
    paid = session.get("payment_status") == "paid"
    free_because = (NOTHING_TO_PAY.get(session.get("mode"))
                    if session.get("payment_status") == "no_payment_required" else None)
    if paid:
        method = await method_of_payment(ctx, session, order_type, session.get("payment_intent"))

    def record():
        if paid:
            complete_payment(ctx, effects, order_id, order_type, session["id"],
                             source="card", payment_intent_id=session.get("payment_intent"),
                             payment_method=method)
        elif free_because:
            complete_payment(ctx, effects, order_id, order_type, session["id"],
                             source="card", payment_method=FREE, free_because=free_because)
        else:
            log.info("session %s for %s is %s; waiting for the payment to clear",
                     session["id"], order_id, session.get("payment_status"))
        if session.get("mode") == "subscription" and session.get("subscription"):
            link_subscription(ctx, order_id, order_type, session["subscription"])
    await effects.transaction(record)


def link_subscription(ctx, order_id, order_type, subscription_id):
    if order_type != "compliance":
        log.error("subscription %s belongs to %s order %s, not a compliance order; not kept",
                  subscription_id, order_type, order_id)
        return
    order = find_order("compliance", order_id, for_update=True)
    if order is None:
        raise OrderNotFound(f"no compliance order {order_id}")
    order.stripe_subscription_id = subscription_id
    order.updated_at = ctx.clock()
    order.save()
