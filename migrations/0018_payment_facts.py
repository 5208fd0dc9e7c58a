"""Payments as facts, and one unit per currency.

Orders get the columns their payment status is worked out of (models.OrderBase: received,
amount, failure, dispute, refund); null on every existing row, which domain.payments reads
as "only the stored status is known". Treasury jobs and ledger entries get `fallback`.

Rows written before this migration (only when it adds `fallback`, so a database made
afresh converts nothing):
- Fiat amounts were in hundredths of every currency; they are now in the currency's
  ISO 4217 minor unit. A ledger entry's note keeps its exact fiat amount, so a JPY or KWD
  entry is read from it; a treasury job's amount is scaled (a KWD job's third decimal,
  dropped when it was written, stays lost: the next callback of its order restores it).
- A ledger entry under a fallback txid (`crypto-<COIN>-<epoch ms>`: a callback that listed
  no transaction) counted the invoice's balance; the listed transactions of a later
  callback were added beside it, counting the same coins twice. Such an entry is deleted
  where its order has listed entries; of an order's several fallback entries (each a
  whole balance) the largest is kept; the one kept takes the order's fallback key
  (domain.treasury.fallback_key). Each deletion is logged.
"""
import decimal
import logging
import re

from peewee import BigIntegerField, BooleanField, TextField

from migrations import add_column_if_missing
from models import LedgerEntry, TreasuryJob, UTCDateTimeField, database_default

log = logging.getLogger("receiver.migrate")

ORDER_TABLES = ("formation_orders", "compliance_orders", "bundle_orders", "crtc_orders")
ORDER_COLUMNS = (
    ("payment_received", BooleanField(null=True)),
    ("payment_amount", BigIntegerField(null=True)),
    ("payment_currency", TextField(null=True)),
    ("payment_failed_at", UTCDateTimeField(null=True)),
    ("dispute_id", TextField(null=True)),
    ("dispute_status", TextField(null=True)),
    ("dispute_amount", BigIntegerField(null=True)),
    ("dispute_as_of", UTCDateTimeField(null=True)),
    ("refunded_charge", TextField(null=True)),
    ("refunded_amount", BigIntegerField(null=True)),
    ("refund_complete", BooleanField(null=True)),
    ("refunded_as_of", UTCDateTimeField(null=True)),
)
MONEY_TABLES = ("treasury_jobs", "ledger_entries")
PROVIDER = "crypto-processor"
# The fallback txid, as domain.treasury made it.
FALLBACK_TXID = re.compile(r"crypto-[^-]+-\d+")
# The fiat amount in a ledger note, as domain.treasury writes it: "(<amount> <FIAT>, fee".
NOTE_AMOUNT = re.compile(r"\((\S+) ([A-Z]{3,}), fee ")


def apply(db, migrator):
    for table in ORDER_TABLES:
        for name, field in ORDER_COLUMNS:
            add_column_if_missing(db, migrator, table, name, field)
    converting = all("fallback" not in {column.name for column in db.get_columns(table)}
                     for table in MONEY_TABLES)
    for table in MONEY_TABLES:
        add_column_if_missing(db, migrator, table, "fallback", BooleanField(
            default=False, constraints=database_default("FALSE")))
    if converting:
        with db.bind_ctx([LedgerEntry, TreasuryJob]):
            _to_minor_units()
            _one_fallback_entry_per_order()


def _to_minor_units():
    # Imported here: the migration's own table of units is the service's.
    from domain.money import decimal_places, minor_units
    for entry in LedgerEntry.select().where(LedgerEntry.amount_fiat_cents != 0):
        if decimal_places(entry.fiat_currency) == 2:
            continue
        found = NOTE_AMOUNT.search(entry.notes or "")
        amount = (decimal.Decimal(found.group(1)) if found
                  else decimal.Decimal(entry.amount_fiat_cents).scaleb(-2))
        (LedgerEntry.update(amount_fiat_cents=minor_units(amount, entry.fiat_currency))
         .where(LedgerEntry.id == entry.id).execute())
    for job in TreasuryJob.select().where(TreasuryJob.amount_fiat_cents != 0):
        if decimal_places(job.fiat_currency) == 2:
            continue
        amount = decimal.Decimal(job.amount_fiat_cents).scaleb(-2)
        (TreasuryJob.update(amount_fiat_cents=minor_units(amount, job.fiat_currency))
         .where(TreasuryJob.id == job.id).execute())


def _one_fallback_entry_per_order():
    fallback = [entry for entry in LedgerEntry.select().where(LedgerEntry.provider == PROVIDER)
                if FALLBACK_TXID.fullmatch(entry.provider_ref or "")]
    by_order = {}
    for entry in fallback:
        by_order.setdefault(entry.order_id, []).append(entry)
    for order_id, entries in by_order.items():
        listed = (LedgerEntry.select().where(LedgerEntry.order_id == order_id,
                                             LedgerEntry.provider == PROVIDER,
                                             LedgerEntry.id.not_in([e.id for e in entries]))
                  .exists())
        entries.sort(key=lambda entry: (entry.amount_coin, entry.id))
        kept = None if listed else entries.pop()
        for entry in entries:
            log.warning("ledger entry %s of order %s (%s %s under fallback txid %s) deleted: "
                        "its coins are counted by the order's other entries", entry.id,
                        order_id, entry.amount_coin, entry.coin, entry.provider_ref)
            LedgerEntry.delete().where(LedgerEntry.id == entry.id).execute()
        if kept is not None:
            (LedgerEntry.update(fallback=True,
                                idempotency_key=f"{PROVIDER}:{order_id}:fallback")
             .where(LedgerEntry.id == kept.id).execute())
    for job in TreasuryJob.select(TreasuryJob.id, TreasuryJob.idempotency_key):
        if FALLBACK_TXID.fullmatch(job.idempotency_key.rsplit(":", 1)[-1]):
            TreasuryJob.update(fallback=True).where(TreasuryJob.id == job.id).execute()
