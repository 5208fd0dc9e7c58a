"""Treasury jobs and ledger entries keep their fiat currency: fiat_currency and
amount_fiat_cents (cents of that currency) are added, and amount_usd_cents may be null
(an amount in another currency is not recorded as USD).

Rows from before were all written as if in USD: they get fiat_currency USD and their
amount as amount_fiat_cents. Their ledger notes name the invoice's real currency
(`(<amount> <FIAT>, fee ...)`): the entries, and the treasury job of their order, whose
note names another currency get it, and lose the USD amount they never had."""
import re

from peewee import BigIntegerField, TextField
from playhouse.migrate import migrate as run

from migrations import add_column_if_missing
from models import LedgerEntry, TreasuryJob, database_default

TABLES = ("treasury_jobs", "ledger_entries")
# The fiat currency in a ledger note, as domain.treasury writes it.
NOTE_CURRENCY = re.compile(r"\(\S+ ([A-Z]{3,}), fee ")


def apply(db, migrator):
    added = False
    for table in TABLES:
        columns = {column.name: column for column in db.get_columns(table)}
        if "fiat_currency" not in columns:
            added = True
            add_column_if_missing(db, migrator, table, "fiat_currency", TextField(
                default="USD", constraints=database_default("'USD'")))
            add_column_if_missing(db, migrator, table, "amount_fiat_cents", BigIntegerField(
                default=0, constraints=database_default("0")))
            db.execute_sql(f'UPDATE "{table}" SET amount_fiat_cents = amount_usd_cents')
        if not columns["amount_usd_cents"].null:
            run(migrator.drop_not_null(table, "amount_usd_cents"))
    if added:
        _relabel_from_notes(db)


def _relabel_from_notes(db):
    with db.bind_ctx([LedgerEntry, TreasuryJob]):
        for entry in LedgerEntry.select().where(~LedgerEntry.notes.contains(" USD, fee ")):
            found = NOTE_CURRENCY.search(entry.notes or "")
            if not found or found.group(1) == "USD":
                continue
            relabelled = {"fiat_currency": found.group(1), "amount_usd_cents": None}
            LedgerEntry.update(relabelled).where(LedgerEntry.id == entry.id).execute()
            (TreasuryJob.update(relabelled).where(TreasuryJob.order_id == entry.order_id)
             .execute())
