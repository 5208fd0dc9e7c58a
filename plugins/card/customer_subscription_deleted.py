"""customer.subscription.deleted: the subscription ended; its compliance order is marked
cancelled (once: a later copy changes nothing), as of when Stripe ended it. One whose
subscription no order has yet (its checkout has not come) waits for it."""
from typing import Any

from plugins.registry import card_event
from plugins.card import ONCE_PER_OBJECT
from domain.card_events import ids_of, object_of
from domain.payment_state import as_of
from engine.contracts import EngineContext
from engine.transaction import Transaction


@card_event("customer.subscription.deleted", ONCE_PER_OBJECT)
def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    subscription = object_of(event)
    # Locked: a dispute committed meanwhile by another process must not be written over.
    order = tx.lock_order_with_subscription(subscription["id"])
    if order is None:
        # Its checkout.session.completed has not linked the subscription yet.
        tx.wait_for_order(f"subscription {subscription['id']} ended; no compliance order "
                          f"has it yet", ids_of(subscription=subscription["id"]))
        return
    if order.subscription_status == "cancelled":
        return
    ended = subscription.get("ended_at") or subscription.get("canceled_at")
    order.subscription_status = "cancelled"
    order.cancelled_at = as_of(ended, as_of(event.get("created"), ctx.clock()))
    order.updated_at = ctx.clock()
    tx.save(order)
