"""OVERPAID: more than the invoice arrived; handled exactly like a full payment."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import crypto_status, with_orders
from plugins.crypto import INVOICE_CALLBACK
from domain import treasury


@crypto_status("OVERPAID", INVOICE_CALLBACK)
@with_orders(treasury.orders_of)
def handle(ctx: EngineContext, callback: dict[str, Any], tx: Transaction) -> None:
    treasury.receive_payment(ctx, callback, tx)
