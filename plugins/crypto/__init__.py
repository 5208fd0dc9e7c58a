"""One module per crypto-processor (SHKeeper) invoice status (BEHAVIOUR.md 4.3).

An invoice's callbacks are one stream, handled one after another: each tells the invoice
as SHKeeper has it then."""
from typing import Any

from domain import treasury
from plugins.registry import Placement


def _receiver_key(callback: dict[str, Any]) -> None:
    return None


def _invoice(callback: dict[str, Any]) -> str | None:
    external_id = treasury.external_id_of(callback)
    return None if external_id is None else f"invoice:{external_id}"


# The callback's key is the receiver's (domain.treasury.Callback.dedup_key); its place is
# its arrival among its invoice's callbacks.
INVOICE_CALLBACK = Placement(same=_receiver_key, stream=_invoice, version=_receiver_key)
