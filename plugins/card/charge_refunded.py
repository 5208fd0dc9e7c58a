"""charge.refunded: a charge was refunded, in part or in full (each refund is an event,
the charge's amount_refunded adding up). Refunded in full, the order is `refunded`: not
settled, its CRTC commission forfeited; in part, a paid order stays `paid` and keeps the
amount refunded. The administrator is told of each refund, with the amounts
(domain.payment_events)."""
from plugins.registry import card_event
from domain.payment_events import refund_event


@card_event("charge.refunded")
async def handle(ctx, event, effects):
    await refund_event(ctx, event, effects)
