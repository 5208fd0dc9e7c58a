"""Seed the rows a benchmark needs: the orders a scenario pays (numbered like the scenario
numbers them) and, for the scale run, ledger entries."""
import decimal

import migrations
from models import ORDER_MODELS, LedgerEntry, database, utcnow
from engine.connection import open_database

BATCH = 2000


def _insert(model, rows_of, count, start=0):
    with database.atomic():
        for first in range(start, start + count, BATCH):
            model.insert_many([rows_of(n) for n in range(first, min(first + BATCH,
                                                                   start + count))]).execute()


def seed_orders(database_url, scenario, count, start=0):
    """Before the service starts (the tables are made here if they are not yet): a
    service seeded under its feet waits on the seeding's write lock (SQLite), takes the
    database for down and spools its calls, and the run would measure the spool."""
    kind, number_format = scenario.orders
    extra = getattr(scenario, "seeded", lambda n: {})
    now = utcnow()
    _open(database_url)
    try:
        _insert(ORDER_MODELS[kind], lambda n: {
            "order_number": number_format.format(n), "created_at": now, "updated_at": now,
            "customer_email": f"bench{n}@example.test", **extra(n)}, count, start)
    finally:
        database.close()


def seed_ledger(database_url, count, start=0):
    now = utcnow()
    _open(database_url)
    try:
        _insert(LedgerEntry, lambda n: {
            "order_id": f"CO-L{n}", "order_type": "compliance", "coin": "BTC",
            "amount_coin": decimal.Decimal("0.00012345"), "amount_usd_cents": 780,
            "provider": "crypto-processor", "provider_ref": f"0xseed{n}",
            "provider_status": "PAID", "idempotency_key": f"crypto-processor:CO-L{n}:0xseed{n}",
            "acquired_at": now, "created_at": now, "updated_at": now}, count, start)
    finally:
        database.close()


def _open(database_url):
    migrations.migrate(open_database(database_url))
