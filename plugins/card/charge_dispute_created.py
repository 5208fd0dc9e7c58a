"""charge.dispute.created: a customer disputed a charge. The dispute is a fact about the
order's payment (domain.payment_events): the order becomes `disputed` unless a newer fact
says otherwise, its CRTC commission is withheld when not released yet (domain.holdback),
and the administrator is told once, with the amount, reason and payment intent."""
from plugins.registry import card_event
from domain.payment_events import dispute_event


@card_event("charge.dispute.created")
async def handle(ctx, event, effects):
    await dispute_event(ctx, event, effects)
