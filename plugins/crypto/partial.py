"""PARTIAL: part of the invoice arrived; kept and logged, the order waits for the rest
(its administrator told when the listed transactions already pay it)."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import crypto_status
from plugins.crypto import INVOICE_CALLBACK
from domain import treasury


@crypto_status("PARTIAL", INVOICE_CALLBACK)
def handle(ctx: EngineContext, callback: dict[str, Any], tx: Transaction) -> None:
    treasury.receive_partial(ctx, callback, tx)
