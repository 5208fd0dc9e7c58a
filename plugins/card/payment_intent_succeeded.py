"""payment_intent.succeeded: the money arrived; for a bank debit this is the moment the
order is paid (its checkout session completed unpaid days ago).

The order: the one the intent's metadata names, else the one that keeps the intent (its
checkout, paid or not, recorded it). Found by neither (the intent carries no metadata and
its checkout.session.completed has not come), it waits for its order with the intent's
id, and is handled when the checkout links it; unless it paid a subscription's invoice
(Stripe asked), whose own events tell of it. Named and not stored yet, it waits for the
order's number, and is handled when the shop sends the order. Paid as of the event's
`created`.

Async, because a CRTC order paid through a session that allowed several methods needs
Stripe asked which one was used (settlement depends on it), and that call must not hold a
transaction open. Completing a payment is idempotent, so running this again is safe."""
import functools
from typing import Any

from plugins.registry import card_event
from plugins.card import ONCE_PER_OBJECT
from domain.card_events import (
    ask_stripe, ids_of, linked, metadata_of, method_of_payment, object_of, order_of_metadata)
from domain.money import Money
from domain.orders import OrderNotFound, complete_payment
from domain.payment_state import as_of
from engine.contracts import EngineContext
from engine.transaction import Transaction


def _kept_by(tx: Transaction, intent_id: str) -> tuple[str, str] | None:
    """(number, kind) of the order that keeps the intent, or None (a unit)."""
    order = tx.order_paid_by(intent_id)
    if order is None or order.kind is None:
        return None
    return order.order_number, order.kind


async def _pays_an_invoice(ctx: EngineContext, intent: dict[str, Any]) -> bool:
    """Whether the intent paid an invoice (a subscription's): the intent names it in a
    shape before 2025-03-31.basil, Stripe's invoice payments of it from then on."""
    if intent.get("invoice"):
        return True
    paid = await ask_stripe(
        ctx, f"invoice payments of {intent['id']}", lambda v1: v1.invoice_payments.list,
        payment={"type": "payment_intent", "payment_intent": intent["id"]})
    return bool((paid or {}).get("data"))


@card_event("payment_intent.succeeded", ONCE_PER_OBJECT)
async def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    intent = object_of(event)
    named = order_of_metadata(intent) if metadata_of(intent).get("order_id") else None
    order = named or await ctx.db(functools.partial(_kept_by, tx, intent["id"]))
    if order is None:
        if await _pays_an_invoice(ctx, intent):
            return  # a subscription's invoice: its invoice events tell of it
        tx.wait_for_order(f"payment intent {intent['id']}: no order names it yet",
                          ids_of(payment_intent=intent["id"]))
        return
    order_id, order_type = order
    method = await method_of_payment(ctx, intent, order_type, intent["id"])
    reference = metadata_of(intent).get("checkout_session_id") or intent["id"]

    def complete() -> None:
        try:
            complete_payment(ctx, tx, order_id, order_type, reference, source="card",
                             payment_intent_id=intent["id"], payment_method=method,
                             amount=Money.of_stripe(intent.get("amount_received")
                                                    or intent.get("amount"),
                                                    intent.get("currency")),
                             paid_at=as_of(event.get("created"), ctx.clock()),
                             by_checkout=reference != intent["id"])
        except OrderNotFound:
            # The order its metadata names is not stored yet: handled when it is.
            tx.wait_for_order(f"payment intent {intent['id']}: no {order_type} order "
                              f"{order_id} yet", ids_of(order=order_id,
                                                        payment_intent=intent["id"]))
            return
        linked(ctx, tx, payment_intent=intent["id"])
    await tx.transaction(complete)
