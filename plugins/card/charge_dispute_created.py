"""charge.dispute.created: a customer disputed a charge. The dispute is a fact about the
order's payment (domain.payment_events): the order becomes `disputed` unless a newer fact
says otherwise, its CRTC commission is withheld when not released yet (domain.holdback),
and the administrator is told once, with the amount, reason and payment intent."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import card_event
from plugins.card import ONCE_PER_OBJECT
from domain.payment_events import dispute_event


@card_event("charge.dispute.created", ONCE_PER_OBJECT, background=True)
async def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    await dispute_event(ctx, event, tx)
