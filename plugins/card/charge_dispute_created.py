"""charge.dispute.created: a customer disputed a charge. The order it paid is marked
disputed, and the administrator gets the amount, reason and payment-intent reference.
A CRTC order's commission is withheld when it was not released yet (domain.holdback),
and the e-mail says which of the two it is."""
import logging

from plugins.registry import card_event
from domain import holdback
from domain.card_events import email_admin, object_of
from domain.money import money
from domain.orders import find_by_payment_intent, mark_disputed

log = logging.getLogger("receiver.card")


@card_event("charge.dispute.created")
def handle(ctx, event, effects):
    dispute = object_of(event)
    payment_intent = dispute.get("payment_intent") or ""
    reason = dispute.get("reason") or "unknown"
    amount = money(dispute.get("amount"), dispute.get("currency"))
    order = find_by_payment_intent(payment_intent)
    commission = None
    if order is None:
        log.error("dispute %s: no order paid by %r", dispute["id"], payment_intent)
    else:
        mark_disputed(ctx, order, reason, amount)
        if order.kind == holdback.ORDER_TYPE:
            commission = holdback.forfeit(ctx, order, f"dispute {dispute['id']}: {reason}")
    number = order.order_number if order else "unknown"
    email_admin(ctx, effects, f"Dispute opened on order {number}", "dispute_created", number,
                reason=reason, amount=amount, payment_intent=payment_intent,
                dispute=dispute["id"], customer_name=order and order.customer_name,
                customer_email=order and order.customer_email,
                service_name=order and order.service_name, commission=commission)
