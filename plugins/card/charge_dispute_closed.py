"""charge.dispute.closed: a dispute ended. Won, an inquiry closed (warning_closed) or
prevented: the order is `paid` again (if nothing else holds it); lost: `dispute_lost`,
never settled, its subscription (if it renews) named to the administrator. Told once per
outcome, with the amount (domain.payment_events)."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import card_event
from plugins.card import EACH_EVENT
from domain.payment_events import dispute_event


@card_event("charge.dispute.closed", EACH_EVENT, background=True)
async def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    await dispute_event(ctx, event, tx)
