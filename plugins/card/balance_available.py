"""balance.available: money has settled at Stripe, so CRTC orders whose payment has had
time to clear advance to Client Selection (the scheduler runs the same as a fallback)."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import card_event
from plugins.card import EACH_EVENT
from domain.settlement import settle_crtc_orders


@card_event("balance.available", EACH_EVENT, background=True)
async def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    await settle_crtc_orders(ctx, tx)
