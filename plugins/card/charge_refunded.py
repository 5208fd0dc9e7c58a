"""charge.refunded: a charge was refunded, in part or in full (each refund is an event,
the charge's amount_refunded adding up). Refunded in full, the order is `refunded`: not
settled, its CRTC commission forfeited; in part, a paid order stays `paid` and keeps the
amount refunded. The administrator is told of each refund, with the amounts
(domain.payment_events)."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import card_event
from plugins.card import once_per_object_and
from domain.payment_events import refund_event


@card_event("charge.refunded", once_per_object_and("amount_refunded"), background=True)
async def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    await refund_event(ctx, event, tx)
