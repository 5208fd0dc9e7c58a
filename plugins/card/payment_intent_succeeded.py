"""payment_intent.succeeded: the money arrived; for a bank debit this is the moment the
order is paid (its checkout session completed unpaid days ago).

Async, because a CRTC order paid through a session that allowed several methods needs
Stripe asked which one was used (settlement depends on it), and that call must not hold a
transaction open. Completing a payment is idempotent, so running this again is safe."""
import functools
from typing import Any

from plugins.registry import card_event
from plugins.card import CARD_FACT
from domain.card_events import (
    metadata_of, method_of_payment, object_of, order_of_metadata)
from domain.money import Money
from domain.orders import complete_payment
from engine.contracts import EngineContext
from engine.transaction import Transaction


@card_event("payment_intent.succeeded", CARD_FACT)
async def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    intent = object_of(event)
    order = order_of_metadata(intent)
    if order is None:
        return
    order_id, order_type = order
    method = await method_of_payment(ctx, intent, order_type, intent["id"])
    reference = metadata_of(intent).get("checkout_session_id") or intent["id"]
    await tx.transaction(functools.partial(
        complete_payment, ctx, tx, order_id, order_type, reference, source="card",
        payment_intent_id=intent["id"], payment_method=method,
        amount=Money.of_stripe(intent.get("amount_received") or intent.get("amount"),
                               intent.get("currency"))))
