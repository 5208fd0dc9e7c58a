"""payment_intent.payment_failed: an attempt to pay failed. Every order with that number
(any kind) whose payment was not received becomes `failed`, and the administrator is
told why, with the amount. An order already paid stays paid, and nobody is told: the
failure was of an earlier or another attempt (a declined first card), whatever order
Stripe delivered the events in (domain.payment_state). Each failed attempt is a fact of
its own (a new event), failed as of the event's `created`; one whose order is not stored
yet waits for it. An intent that names no order is not ours to tell of."""
import logging
from typing import Any

from plugins.registry import card_event
from plugins.card import EACH_EVENT
from domain.card_events import email_admin, ids_of, metadata_of, object_of
from domain.money import Money
from domain.orders import mark_payment_failed
from domain.payment_state import as_of
from engine.contracts import EngineContext
from engine.transaction import Transaction

log = logging.getLogger("receiver.card")


@card_event("payment_intent.payment_failed", EACH_EVENT, background=True)
def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    intent = object_of(event)
    order_number = metadata_of(intent).get("order_id")
    if not order_number:
        return
    reason = (intent.get("last_payment_error") or {}).get("message") or "unknown error"
    failed_at = as_of(event.get("created"), ctx.clock())
    marked, left = mark_payment_failed(ctx, tx, order_number, reason, failed_at)
    if not marked and not left:
        # The order the intent names is not stored yet: told once it is.
        tx.wait_for_order(f"payment intent {intent['id']} failed; no order {order_number} "
                          f"yet", ids_of(order=order_number))
        return
    if left and not marked:
        log.info("payment intent %s for %s failed (%s); the order's payment was received, "
                 "so it stays %s", intent["id"], order_number, reason,
                 ", ".join(order.payment_status for order in left))
        return
    email_admin(ctx, tx, f"Payment failed for order {order_number}", "payment_failed",
                order_number,
                key=f"email-payment-failed-{intent['id']}-{int(failed_at.timestamp())}",
                reason=reason, failed_at=failed_at.isoformat(timespec="seconds"),
                payment_intent=intent["id"], marked=marked,
                amount=str(Money.of_stripe(intent.get("amount"), intent.get("currency"))))
