"""One module per crypto-processor (SHKeeper) invoice status (BEHAVIOUR.md 4.3).

An invoice's callbacks are one stream, placed by their listing of its transactions
(domain.treasury.Callback.version): every callback lists the invoice's transactions so
far, so one listing fewer is older whenever it arrives, and is history once a longer one
is handled. An `unconfirmed` notice, only logged, waits for nothing."""
from typing import Any

from domain import treasury
from plugins.registry import Placement, undeclared


def _invoice(callback: dict[str, Any]) -> str | None:
    external_id = treasury.external_id_of(callback)
    return None if external_id is None else f"invoice:{external_id}"


def _listing(callback: dict[str, Any]) -> str:
    return treasury.Callback.parse(callback).version


# The callback's key is the receiver's (domain.treasury.Callback.dedup_key: one per state
# of the invoice); its place, its listing among its invoice's callbacks.
INVOICE_CALLBACK = Placement(same=undeclared, stream=_invoice, version=_listing)
# A notice of a transaction not confirmed yet lists nothing: logged whenever it comes.
UNCONFIRMED_NOTICE = Placement(same=undeclared, stream=undeclared, version=undeclared)
