"""charge.dispute.funds_reinstated: Stripe gave the disputed amount back (the dispute was
won, or closed in our favour). Its dispute, as the event shows it, is a fact about the
order's payment (domain.payment_events): closed as won, the order is `paid` again even
when the closed event has not come (yet)."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import card_event
from plugins.card import EACH_EVENT
from domain.payment_events import dispute_event


@card_event("charge.dispute.funds_reinstated", EACH_EVENT, background=True)
async def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    await dispute_event(ctx, event, tx)
