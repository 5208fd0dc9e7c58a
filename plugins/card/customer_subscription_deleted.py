"""customer.subscription.deleted: the subscription ended; its compliance order is marked
cancelled (once: a later copy changes nothing)."""
import datetime
import logging

from models import UTC
from plugins.registry import card_event
from domain.card_events import object_of, order_with_subscription

log = logging.getLogger("receiver.card")


@card_event("customer.subscription.deleted")
def handle(ctx, event, effects):
    subscription = object_of(event)
    # Locked: a dispute committed meanwhile by another process must not be written over.
    order = order_with_subscription(subscription["id"], for_update=True)
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
    order.save()
