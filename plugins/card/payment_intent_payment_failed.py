"""payment_intent.payment_failed: an attempt to pay failed. Every order with that number
(any kind) whose payment was not received becomes `failed`, and the administrator is
told why, with the amount. An order already paid stays paid, and nobody is told: the
failure was of an earlier or another attempt (a declined first card), whatever order
Stripe delivered the events in (domain.payment_state)."""
import logging
from typing import Any

from plugins.registry import card_event
from plugins.card import CARD_FACT
from domain.card_events import email_admin, metadata_of, object_of
from domain.money import Money
from domain.orders import mark_payment_failed
from domain.payment_state import as_of
from engine.contracts import EngineContext
from engine.transaction import Transaction

log = logging.getLogger("receiver.card")


@card_event("payment_intent.payment_failed", CARD_FACT)
def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    intent = object_of(event)
    order_number = metadata_of(intent).get("order_id")
    if not order_number:
        return
    reason = (intent.get("last_payment_error") or {}).get("message") or "unknown error"
    marked, left = mark_payment_failed(ctx, tx, order_number, reason,
                                       as_of(event.get("created"), ctx.clock()))
    if left and not marked:
        log.info("payment intent %s for %s failed (%s); the order's payment was received, "
                 "so it stays %s", intent["id"], order_number, reason,
                 ", ".join(order.payment_status for order in left))
        return
    email_admin(ctx, tx, f"Payment failed for order {order_number}", "payment_failed",
                order_number, reason=reason, failed_at=ctx.clock().isoformat(timespec="seconds"),
                payment_intent=intent["id"], marked=marked,
                amount=str(Money.of_stripe(intent.get("amount"), intent.get("currency"))))
