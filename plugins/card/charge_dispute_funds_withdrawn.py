"""charge.dispute.funds_withdrawn: Stripe took the disputed amount from the balance. Its
dispute, as the event shows it, is a fact about the order's payment, as of any dispute
event (domain.payment_events): it tells of the dispute even when its created event has
not come (yet)."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import card_event
from plugins.card import EACH_EVENT
from domain.payment_events import dispute_event


@card_event("charge.dispute.funds_withdrawn", EACH_EVENT, background=True)
async def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    await dispute_event(ctx, event, tx)
