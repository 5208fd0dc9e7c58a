"""payment_intent.payment_failed: the order (of any kind) is marked failed and the
administrator is told why."""
from plugins.registry import card_event
from domain.card_events import email_admin, metadata_of, object_of
from domain.orders import mark_payment_failed


@card_event("payment_intent.payment_failed")
def handle(ctx, event, effects):
    intent = object_of(event)
    order_number = metadata_of(intent).get("order_id")
    if not order_number:
        return
    reason = (intent.get("last_payment_error") or {}).get("message") or "unknown error"
    marked = mark_payment_failed(ctx, order_number, reason)
    email_admin(ctx, effects, f"Payment failed for order {order_number}", "payment_failed",
                order_number, reason=reason, failed_at=ctx.clock().isoformat(timespec="seconds"),
                payment_intent=intent["id"], marked=marked)
