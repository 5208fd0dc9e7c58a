"""customer.subscription.deleted: the subscription ended; its compliance order is marked
cancelled (once: a later copy changes nothing)."""
import datetime
import logging
from typing import Any

from models import UTC
from plugins.registry import card_event
from plugins.card import CARD_FACT
from domain.card_events import object_of
from engine.contracts import EngineContext
from engine.transaction import Transaction

log = logging.getLogger("receiver.card")


@card_event("customer.subscription.deleted", CARD_FACT)
def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    subscription = object_of(event)
    # Locked: a dispute committed meanwhile by another process must not be written over.
    order = tx.lock_order_with_subscription(subscription["id"])
    if order is None:
        log.warning("subscription %s ended; no compliance order has it", subscription["id"])
        return
    if order.subscription_status == "cancelled":
        return
    ended = subscription.get("ended_at") or subscription.get("canceled_at")
    order.subscription_status = "cancelled"
    order.cancelled_at = (datetime.datetime.fromtimestamp(ended, UTC) if ended
                          else ctx.clock())
    order.updated_at = ctx.clock()
    tx.save(order)
