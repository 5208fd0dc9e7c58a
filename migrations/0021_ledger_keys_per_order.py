"""A ledger entry's key names its order as well as its transaction
(`crypto-processor:<order_id>:<txid>`, domain.treasury.ledger_key): one transaction may pay
several invoices. Entries keyed the old way (`crypto-processor:<txid>`) get the new key,
so a callback re-sent for their invoice still finds them and adds nothing."""
from models import LedgerEntry

PROVIDER = "crypto-processor"


def apply(db, migrator):
    with db.bind_ctx([LedgerEntry]):
        (LedgerEntry
         .update(idempotency_key=PROVIDER + ":" + LedgerEntry.order_id + ":"
                 + LedgerEntry.provider_ref)
         .where(LedgerEntry.provider == PROVIDER,
                LedgerEntry.idempotency_key == PROVIDER + ":" + LedgerEntry.provider_ref)
         .execute())
