"""Crypto payments: the treasury job and its ledger entries.

Every write here is left for the transaction's next statement (nothing is read of it):
a crypto payment's job and entries go to the server with what the handling does next."""
import datetime
import decimal
from typing import TypedDict

import peewee

from models import LedgerEntry, TreasuryJob, is_postgres
from engine.prepared import InsertOrUpdate, Prepared, slot


class LedgerFields(TypedDict):
    """A ledger entry's columns, as the domain gives them."""
    order_id: str
    order_type: str
    coin: str
    movement_type: str
    amount_coin: decimal.Decimal
    fiat_currency: str
    amount_fiat_cents: int
    amount_usd_cents: int | None
    provider: str
    provider_ref: str
    provider_status: str
    state: str
    idempotency_key: str
    fallback: bool
    acquired_at: datetime.datetime
    notes: str
    created_at: datetime.datetime
    updated_at: datetime.datetime


def _not_less(column: peewee.Field) -> peewee.Expression:
    """The stored row's `column` is at most the new row's, as numbers: exact on
    PostgreSQL (NUMERIC); on SQLite, which keeps exact decimals as text, compared as
    reals (SHKeeper's amounts have at most 10 decimals: their order is kept)."""
    new = getattr(peewee.EXCLUDED, column.column_name)
    if is_postgres():
        return column <= new
    return peewee.Cast(column, "REAL") <= peewee.Cast(new, "REAL")


def _not_older(model: type[TreasuryJob]) -> peewee.Expression:
    """A callback's amounts are not older than the row's: it lists transactions and the
    row's came from one that did not, or both alike and its balance is not smaller."""
    new_fallback = peewee.EXCLUDED.fallback
    return ((model.fallback > new_fallback)
            | ((model.fallback == new_fallback) & _not_less(model.amount_coin)))


# The job of an order still `received` (the state a new job is written in: the `state`
# slot) follows the newest state of the invoice its callbacks showed (`_not_older`); one
# taken further is left as it is.
SAVE_TREASURY_JOB = InsertOrUpdate(
    TreasuryJob, TreasuryJob.order_id,
    (TreasuryJob.coin, TreasuryJob.amount_coin, TreasuryJob.fiat_currency,
     TreasuryJob.amount_fiat_cents, TreasuryJob.amount_usd_cents,
     TreasuryJob.idempotency_key, TreasuryJob.fallback, TreasuryJob.updated_at),
    lambda: (TreasuryJob.state == slot(TreasuryJob.state)) & _not_older(TreasuryJob))
# An entry of a listed transaction: written once, its status (and the note naming it) the
# newest listing's of its invoice.
SAVE_LEDGER_ENTRY = InsertOrUpdate(
    LedgerEntry, LedgerEntry.idempotency_key,
    (LedgerEntry.provider_status, LedgerEntry.notes, LedgerEntry.updated_at),
    lambda: LedgerEntry.provider_status != peewee.EXCLUDED.provider_status)
# The order's one fallback entry: its balance as the newest callback listing no
# transaction showed it, unless an entry of a listed transaction is stored.
SAVE_FALLBACK_ENTRY = InsertOrUpdate(
    LedgerEntry, LedgerEntry.idempotency_key,
    (LedgerEntry.coin, LedgerEntry.amount_coin, LedgerEntry.fiat_currency,
     LedgerEntry.amount_fiat_cents, LedgerEntry.amount_usd_cents, LedgerEntry.provider_ref,
     LedgerEntry.provider_status, LedgerEntry.acquired_at, LedgerEntry.notes,
     LedgerEntry.updated_at),
    lambda: _not_less(LedgerEntry.amount_coin),
    unless=lambda: LedgerEntry.select(LedgerEntry.id).where(
        LedgerEntry.order_id == slot(LedgerEntry.order_id), ~LedgerEntry.fallback))
DROP_FALLBACK_ENTRY = Prepared(lambda: LedgerEntry.delete().where(
    LedgerEntry.idempotency_key == slot(LedgerEntry.idempotency_key)), on_server=True)


class TreasuryStore:
    """Crypto payments, in the caller's transaction."""

    def save_treasury_job(self, order_id: str, order_type: str, coin: str,
                          amount_coin: decimal.Decimal, fiat_currency: str,
                          amount_fiat_cents: int, amount_usd_cents: int | None,
                          idempotency_key: str, fallback: bool,
                          at: datetime.datetime) -> None:
        """Write the order's one treasury job, `received` at `at`; a job already stored
        takes these amounts (and key) only while it is still `received` and they are not
        older than its own: `fallback` False (the callback listed its transactions) over
        True, else the larger `amount_coin`. A job taken further is left as it is."""
        SAVE_TREASURY_JOB.run_later(
            order_id=order_id, order_type=order_type, state="received", coin=coin,
            amount_coin=amount_coin, fiat_currency=fiat_currency,
            amount_fiat_cents=amount_fiat_cents, amount_usd_cents=amount_usd_cents,
            idempotency_key=idempotency_key, fallback=fallback, received_at=at,
            created_at=at, updated_at=at)

    def save_ledger_entry(self, entry: LedgerFields) -> None:
        """Write the entry; one with its idempotency_key stored already takes its status
        and note (nothing else changes)."""
        SAVE_LEDGER_ENTRY.run_later(**entry)

    def save_fallback_entry(self, entry: LedgerFields) -> None:
        """Write the order's fallback entry (`entry`, keyed by its idempotency_key), unless
        an entry of the order that is not a fallback is stored; one stored already takes
        the new amounts when its `amount_coin` is not larger."""
        SAVE_FALLBACK_ENTRY.run_later(**entry)

    def drop_ledger_entry(self, idempotency_key: str) -> None:
        """Delete the entry with that key, if any."""
        DROP_FALLBACK_ENTRY.execute_later(idempotency_key=idempotency_key)
