"""payment_intent.succeeded: the money arrived; for a bank debit this is the moment the
order is paid (its checkout session completed unpaid days ago)."""
from plugins.registry import card_event
from services.card_events import (
    metadata_of, object_of, order_of_metadata, payment_method_used)
from services.orders import complete_payment


@card_event("payment_intent.succeeded")
def handle(ctx, event, effects):
    intent = object_of(event)
    order = order_of_metadata(intent)
    if order is None:
        return
    order_id, order_type = order
    reference = metadata_of(intent).get("checkout_session_id") or intent["id"]
    complete_payment(ctx, effects, order_id, order_type, reference, source="card",
                     payment_intent_id=intent["id"],
                     payment_method=payment_method_used(intent))
