"""charge.dispute.updated: a dispute changed (evidence submitted, under review, an inquiry
turned into a chargeback). Each update is a fact of its own (a dispute is updated many
times), about the order's payment as of any dispute event (domain.payment_events): one
that says the dispute is open again after it was closed is a conflict, and Stripe is
asked for the dispute as it is now."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import card_event
from plugins.card import EACH_EVENT
from domain.payment_events import dispute_event


@card_event("charge.dispute.updated", EACH_EVENT, background=True)
async def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    await dispute_event(ctx, event, tx)
