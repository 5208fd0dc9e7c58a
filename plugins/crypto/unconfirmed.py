"""`unconfirmed`: SHKeeper saw a transaction that is not confirmed yet; kept and logged."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import crypto_status
from plugins.crypto import UNCONFIRMED_NOTICE
from domain import treasury


@crypto_status("unconfirmed", UNCONFIRMED_NOTICE)
def handle(ctx: EngineContext, callback: dict[str, Any], tx: Transaction) -> None:
    treasury.log_notice(ctx, callback, tx)
