"""Migration 0006 gives an order table created before the database defaults were declared
the same defaults a fresh database gets from 0001, and is a no-op where they are present;
0010 adds reminders_sent to a database from before it."""
import importlib
import json
import os
import re

import pytest
from peewee import IntegrityError, PostgresqlDatabase, SqliteDatabase
from playhouse.db_url import parse
from playhouse.migrate import PostgresqlMigrator, SqliteMigrator
from playhouse.migrate import migrate as run

import migrations
from models import (
    ORDER_MODELS, POSTGRES_FIELD_TYPES, SQLITE_FIELD_TYPES, ComplianceOrder, CrtcOrder, LedgerEntry,
    TreasuryJob, WebhookEvent, is_postgres, utcnow,
)
from tests.conftest import _postgres_scratch_database
from tests.test_models import assert_documented_defaults, insert_order_number_only

ORDER_DEFAULTS = importlib.import_module("migrations.0006_order_database_defaults")


@pytest.fixture
def scratch_db(tmp_path):
    """A database of its own (not bound to the models), migrated to the current shape."""
    url = os.environ.get("TEST_DATABASE_URL", "")
    if url.startswith("postgres"):
        scratch_url, drop = _postgres_scratch_database(url)
        db = PostgresqlDatabase(field_types=POSTGRES_FIELD_TYPES, **parse(scratch_url))
    else:
        drop = None
        db = SqliteDatabase(str(tmp_path / "old.sqlite3"), field_types=SQLITE_FIELD_TYPES)
    migrations.migrate(db)
    yield db
    db.close()
    if drop:
        drop()


def migrator_for(db):
    return PostgresqlMigrator(db) if is_postgres(db) else SqliteMigrator(db)


def strip_database_defaults(db):
    """The shape 0001 and 0005 gave the order tables before the defaults were declared."""
    migrator = migrator_for(db)
    for table, defaults in ORDER_DEFAULTS.DEFAULTS.items():
        for column in defaults:
            run(migrator.drop_column_default(table, column))


def test_0006_gives_old_order_tables_the_database_defaults(scratch_db):
    strip_database_defaults(scratch_db)
    with scratch_db.bind_ctx(list(ORDER_MODELS.values())):
        ComplianceOrder.create(order_number="CO-OLD", customer_name="Kept Through The Rebuild")
        with pytest.raises(IntegrityError):
            insert_order_number_only(scratch_db, ComplianceOrder, "CA-0000")

        ORDER_DEFAULTS.apply(scratch_db, migrator_for(scratch_db))

        before = utcnow()
        for model in ORDER_MODELS.values():
            insert_order_number_only(scratch_db, model, "CA-0001")
            assert_documented_defaults(model.get(model.order_number == "CA-0001"), before)
        kept = ComplianceOrder.get(ComplianceOrder.order_number == "CO-OLD")
        assert kept.customer_name == "Kept Through The Rebuild"
        with pytest.raises(IntegrityError):
            insert_order_number_only(scratch_db, ComplianceOrder, "CO-OLD")


def test_0006_changes_nothing_where_the_defaults_are_present(scratch_db):
    def shape():
        return {table: (scratch_db.get_columns(table), scratch_db.get_indexes(table))
                for table in ORDER_DEFAULTS.DEFAULTS}
    fresh = shape()
    ORDER_DEFAULTS.apply(scratch_db, migrator_for(scratch_db))
    assert shape() == fresh


CONSOLE = importlib.import_module("migrations.0011_console")
CONSOLE_TABLES = ("webhook_events", "outbox", "console_actions")


def test_0011_gives_an_old_database_the_console_table_and_indexes(scratch_db):
    def shape():
        return {table: (scratch_db.get_columns(table),
                        sorted(index.name for index in scratch_db.get_indexes(table)))
                for table in CONSOLE_TABLES}
    fresh = shape()
    scratch_db.execute_sql("DROP TABLE console_actions")
    for index in ("webhook_events_status_received_at_id", "webhook_events_external_id",
                  "outbox_kind_status_id"):
        scratch_db.execute_sql(f"DROP INDEX {index}")
    CONSOLE.apply(scratch_db, migrator_for(scratch_db))
    assert shape() == fresh
    CONSOLE.apply(scratch_db, migrator_for(scratch_db))
    assert shape() == fresh


def test_0010_creates_reminders_sent_on_an_older_database_and_is_a_no_op_after(scratch_db):
    scratch_db.execute_sql("DROP TABLE reminders_sent")
    scratch_db.execute_sql("DELETE FROM schema_migrations WHERE name = '0010_reminders_sent'")
    assert migrations.migrate(scratch_db) == ["0010_reminders_sent"]
    indexes = scratch_db.get_indexes("reminders_sent")
    assert ["key"] in [index.columns for index in indexes if index.unique]
    columns = scratch_db.get_columns("reminders_sent")
    importlib.import_module("migrations.0010_reminders_sent").apply(
        scratch_db, migrator_for(scratch_db))
    assert scratch_db.get_columns("reminders_sent") == columns


UNSENT_BY_ORDER = importlib.import_module("migrations.0012_outbox_unsent_by_order")


def test_0012_gives_an_old_database_the_index_of_unsent_effects_by_order(scratch_db):
    def indexes():
        return sorted(index.name for index in scratch_db.get_indexes("outbox"))
    fresh = indexes()
    assert "outbox_unsent_by_order" in fresh
    scratch_db.execute_sql("DROP INDEX outbox_unsent_by_order")
    UNSENT_BY_ORDER.apply(scratch_db, migrator_for(scratch_db))
    assert indexes() == fresh
    UNSENT_BY_ORDER.apply(scratch_db, migrator_for(scratch_db))
    assert indexes() == fresh


SETTLEMENT_REFUSALS = importlib.import_module("migrations.0023_settlement_refusals")


def test_0023_gives_old_crtc_orders_a_refusal_count_of_zero(scratch_db):
    def columns():  # an added column comes last, where a fresh table has it in place
        return sorted(scratch_db.get_columns("crtc_orders"))
    fresh = columns()
    migrator = migrator_for(scratch_db)
    run(migrator.drop_column("crtc_orders", "funds_refused_at"),
        migrator.drop_column("crtc_orders", "funds_refusals"))
    insert_order_number_only(scratch_db, CrtcOrder, "CA-OLD")
    SETTLEMENT_REFUSALS.apply(scratch_db, migrator)
    assert columns() == fresh
    insert_order_number_only(scratch_db, CrtcOrder, "CA-NEW")
    with scratch_db.bind_ctx([CrtcOrder]):
        assert {(o.order_number, o.funds_refusals, o.funds_refused_at)
                for o in CrtcOrder.select()} == {("CA-OLD", 0, None), ("CA-NEW", 0, None)}
    SETTLEMENT_REFUSALS.apply(scratch_db, migrator)
    assert columns() == fresh


ATTEMPTS = importlib.import_module("migrations.0013_attempts")


def test_0013_gives_an_old_database_the_attempts_and_the_trigger_that_writes_them(scratch_db):
    def shape():
        return (scratch_db.get_columns("outbox"), scratch_db.get_columns("attempts"),
                sorted(index.name for index in scratch_db.get_indexes("attempts")))
    fresh = shape()
    drop_trigger = ("DROP TRIGGER outbox_attempt ON outbox" if is_postgres(scratch_db)
                    else "DROP TRIGGER outbox_attempt")
    scratch_db.execute_sql(drop_trigger)
    scratch_db.execute_sql("DROP TABLE attempts")
    run(*(migrator_for(scratch_db).drop_column("outbox", name) for name, _ in ATTEMPTS.COLUMNS))
    for _ in range(2):
        ATTEMPTS.apply(scratch_db, migrator_for(scratch_db))
        assert shape() == fresh
    scratch_db.execute_sql(
        "INSERT INTO outbox (kind, payload, idempotency_key, status, attempts, "
        "next_attempt_at, created_at, updated_at) VALUES ('job', '{}', 'k', 'pending', 0, "
        "'2026-11-20 09:00:00+00:00', '2026-11-20 09:00:00+00:00', '2026-11-20 09:00:00+00:00')")
    scratch_db.execute_sql("UPDATE outbox SET attempts = 1, last_status_code = 502")
    scratch_db.execute_sql("UPDATE outbox SET attempts = 0")  # put back in line: no attempt
    assert scratch_db.execute_sql(
        "SELECT destination, outcome, status_code FROM attempts").fetchall() == [
        ("job", "pending", 502)]


LEDGER_KEYS = importlib.import_module("migrations.0021_ledger_keys_per_order")


def test_0021_gives_old_ledger_keys_the_order_and_leaves_new_ones_alone(scratch_db):
    def entry(order_id, txid, key, provider="crypto-processor"):
        return dict(order_id=order_id, order_type="canada_crtc", coin="BTC", provider=provider,
                    provider_ref=txid, provider_status="PAID", idempotency_key=key)
    with scratch_db.bind_ctx([LedgerEntry]):
        LedgerEntry.insert_many([
            entry("CA-1", "tx-old", "crypto-processor:tx-old"),
            entry("CA-2", "tx-new", "crypto-processor:CA-2:tx-new"),
            entry("CA-3", "tx-other", "manual:tx-other", provider="manual"),
        ]).execute()
        LEDGER_KEYS.apply(scratch_db, migrator_for(scratch_db))
        LEDGER_KEYS.apply(scratch_db, migrator_for(scratch_db))
        assert sorted(e.idempotency_key for e in LedgerEntry.select()) == [
            "crypto-processor:CA-1:tx-old", "crypto-processor:CA-2:tx-new", "manual:tx-other"]


LISTINGS = importlib.import_module("migrations.0025_invoice_listing_versions")


def test_0025_places_stored_invoice_callbacks_by_their_listing(scratch_db):
    """A callback handled before, placed by its arrival, would stand after every callback
    of its invoice to come (and make each history): it takes its listing's place."""
    from tests import shkeeper
    partial, paid, _ = shkeeper.paid_in_steps("CA-1")

    def event(event_type, body, version, stream="invoice:CA-1", source="crypto"):
        return dict(source=source, event_type=event_type, dedup_key=f"{event_type}{version}",
                    payload=json.dumps(body), status="processed", stream=stream,
                    version=version)
    with scratch_db.bind_ctx([WebhookEvent]):
        WebhookEvent.insert_many([
            event("PAID", paid, "2026-11-20 09:41:40.000000"),
            event("PARTIAL", partial, ""),
            event("unconfirmed", shkeeper.unconfirmed("CA-1"), "2026-11-20 09:00:01.000000"),
            event("malformed", "not an object", "2026-11-20 09:00:02.000000"),
            event("formation/submitted", {"transactions": []}, "2026-11-20T09:00:00",
                  stream="formation:FO-1", source="workflow"),
        ]).execute()
        for _ in range(2):
            LISTINGS.apply(scratch_db, migrator_for(scratch_db))
        assert [(e.event_type, e.stream, e.version)
                for e in WebhookEvent.select().order_by(WebhookEvent.id)] == [
            ("PAID", "invoice:CA-1", "000002|2026-11-20 09:41:37"),
            ("PARTIAL", "invoice:CA-1", "000001|2026-11-20 09:00:12"),
            ("unconfirmed", None, None),
            ("malformed", "invoice:CA-1", "2026-11-20 09:00:02.000000"),
            ("formation/submitted", "formation:FO-1", "2026-11-20T09:00:00")]


FIAT_CURRENCY = importlib.import_module("migrations.0014_fiat_currency")


def test_0014_keeps_the_fiat_currency_of_old_treasury_jobs_and_ledger_entries(scratch_db):
    def shape():  # an added column comes last, where a fresh table has it in place
        return [sorted(scratch_db.get_columns(table)) for table in FIAT_CURRENCY.TABLES]
    fresh = shape()
    migrator = migrator_for(scratch_db)
    for table in FIAT_CURRENCY.TABLES:
        run(migrator.drop_column(table, "fiat_currency"),
            migrator.drop_column(table, "amount_fiat_cents"),
            migrator.add_not_null(table, "amount_usd_cents"))
    notes = {"CA-USD": "PAID: received 0.001 BTC (96 USD, fee 1.88)",
             "CA-EUR": "PAID: received 0.00107 BTC (101.99 EUR, fee 2)"}
    for order, cents in (("CA-USD", 9600), ("CA-EUR", 10199)):
        scratch_db.execute_sql(
            "INSERT INTO treasury_jobs (order_id, order_type, state, coin, amount_coin, "
            "amount_usd_cents, idempotency_key, received_at, created_at, updated_at) VALUES "
            f"('{order}', 'canada_crtc', 'received', 'BTC', '0.001', {cents}, 'k-{order}', "
            "'2026-11-20 09:00:00+00:00', '2026-11-20 09:00:00+00:00', "
            "'2026-11-20 09:00:00+00:00')")
        scratch_db.execute_sql(
            "INSERT INTO ledger_entries (order_id, order_type, coin, movement_type, "
            "amount_coin, amount_usd_cents, provider, provider_ref, provider_status, state, "
            "idempotency_key, acquired_at, notes, created_at, updated_at) VALUES "
            f"('{order}', 'canada_crtc', 'BTC', 'receive', '0.001', {cents}, "
            f"'crypto-processor', 'tx', 'PAID', 'confirmed', 'crypto-processor:{order}:tx', "
            f"'2026-11-20 09:00:00+00:00', '{notes[order]}', '2026-11-20 09:00:00+00:00', "
            "'2026-11-20 09:00:00+00:00')")
    for _ in range(2):
        FIAT_CURRENCY.apply(scratch_db, migrator)
        assert shape() == fresh
    with scratch_db.bind_ctx([TreasuryJob, LedgerEntry]):
        for model in (TreasuryJob, LedgerEntry):
            assert {(row.order_id, row.fiat_currency, row.amount_fiat_cents,
                     row.amount_usd_cents) for row in model.select()} == {
                ("CA-USD", "USD", 9600, 9600), ("CA-EUR", "EUR", 10199, None)}


PAYMENT_FACTS = importlib.import_module("migrations.0018_payment_facts")


def test_0018_puts_old_fiat_amounts_in_minor_units_and_keeps_one_fallback_entry_per_order(
        scratch_db):
    """Before 0018 every fiat amount was in hundredths (a JPY job 100 times too large, a
    KWD one short of its third decimal), and a fallback entry stood beside the listed
    transactions that counted the same coins."""
    def shape():
        return [sorted(scratch_db.get_columns(table)) for table in PAYMENT_FACTS.MONEY_TABLES]
    fresh = shape()
    migrator = migrator_for(scratch_db)
    for table in PAYMENT_FACTS.MONEY_TABLES:
        run(migrator.drop_column(table, "fallback"))
    at = "'2026-11-20 09:00:00+00:00'"

    def job(order, fiat, cents, txid):
        scratch_db.execute_sql(
            "INSERT INTO treasury_jobs (order_id, order_type, state, coin, amount_coin, "
            "fiat_currency, amount_fiat_cents, amount_usd_cents, idempotency_key, "
            f"received_at, created_at, updated_at) VALUES ('{order}', 'canada_crtc', "
            f"'received', 'BTC', '0.5', '{fiat}', {cents}, NULL, "
            f"'crypto-settle:{order}:{txid}', {at}, {at}, {at})")

    def entry(order, fiat, cents, txid, coins="0.5", note_fiat="1"):
        scratch_db.execute_sql(
            "INSERT INTO ledger_entries (order_id, order_type, coin, movement_type, "
            "amount_coin, fiat_currency, amount_fiat_cents, amount_usd_cents, provider, "
            "provider_ref, provider_status, state, idempotency_key, acquired_at, notes, "
            f"created_at, updated_at) VALUES ('{order}', 'canada_crtc', 'BTC', 'receive', "
            f"'{coins}', '{fiat}', {cents}, NULL, 'crypto-processor', '{txid}', 'PAID', "
            f"'confirmed', 'crypto-processor:{order}:{txid}', {at}, "
            f"'PAID: received {coins} BTC ({note_fiat} {fiat}, fee 0)', {at}, {at})")
    job("CA-JPY", "JPY", 4895998, "tx-j")
    entry("CA-JPY", "JPY", 4895998, "tx-j", note_fiat="48959.975")
    job("CA-KWD", "KWD", 1235, "tx-k")
    entry("CA-KWD", "KWD", 1235, "tx-k", note_fiat="12.3456")
    # Listed transactions beside a fallback entry; two fallback entries alone.
    job("CA-BOTH", "USD", 15360, "crypto-BTC-1795165200000")
    for txid, coins in (("crypto-BTC-1795165200000", "0.0015"), ("tx-one", "0.0015"),
                        ("tx-two", "0.0001")):
        entry("CA-BOTH", "USD", 100, txid, coins=coins)
    job("CA-TWO", "USD", 15360, "crypto-BTC-1795165260000")
    for txid, coins in (("crypto-BTC-1795165200000", "0.0015"),
                        ("crypto-BTC-1795165260000", "0.0016")):
        entry("CA-TWO", "USD", 100, txid, coins=coins)

    PAYMENT_FACTS.apply(scratch_db, migrator)
    PAYMENT_FACTS.apply(scratch_db, migrator)  # a second run converts nothing again
    assert shape() == fresh
    with scratch_db.bind_ctx([TreasuryJob, LedgerEntry]):
        assert {(job.order_id, job.amount_fiat_cents, job.fallback)
                for job in TreasuryJob.select()} == {
            ("CA-JPY", 48960, False), ("CA-KWD", 12350, False), ("CA-BOTH", 15360, True),
            ("CA-TWO", 15360, True)}
        assert {(e.order_id, e.provider_ref, e.amount_fiat_cents, e.fallback,
                 e.idempotency_key.rsplit(":", 1)[1]) for e in LedgerEntry.select()} == {
            ("CA-JPY", "tx-j", 48960, False, "tx-j"),
            ("CA-KWD", "tx-k", 12346, False, "tx-k"),
            ("CA-BOTH", "tx-one", 100, False, "tx-one"),
            ("CA-BOTH", "tx-two", 100, False, "tx-two"),
            ("CA-TWO", "crypto-BTC-1795165260000", 100, True, "fallback")}


ORDER_CURRENCY = importlib.import_module("migrations.0020_order_currency")


def test_0020_gives_old_crtc_orders_their_currency_usd(scratch_db):
    def columns():
        return sorted(scratch_db.get_columns("crtc_orders"))
    fresh = columns()
    migrator = migrator_for(scratch_db)
    run(migrator.drop_column("crtc_orders", "currency"))
    insert_order_number_only(scratch_db, CrtcOrder, "CA-OLD")
    ORDER_CURRENCY.apply(scratch_db, migrator)
    assert columns() == fresh
    insert_order_number_only(scratch_db, CrtcOrder, "CA-NEW")
    with scratch_db.bind_ctx([CrtcOrder]):
        assert {(o.order_number, o.currency) for o in CrtcOrder.select()} == {
            ("CA-OLD", "USD"), ("CA-NEW", "USD")}
    ORDER_CURRENCY.apply(scratch_db, migrator)
    assert columns() == fresh


EVENT_GIVEN_UP = importlib.import_module("migrations.0022_event_given_up")


def test_0022_gives_old_events_an_empty_give_up_record_and_is_a_no_op_after(scratch_db):
    def columns():  # an added column comes last, where a fresh table has it in place
        return (sorted(scratch_db.get_columns("webhook_events")),
                sorted(index.name for index in scratch_db.get_indexes("webhook_events")))
    fresh = columns()
    assert "webhook_events_given_up" in fresh[1]
    migrator = migrator_for(scratch_db)
    scratch_db.execute_sql("DROP INDEX webhook_events_given_up")
    run(*(migrator.drop_column("webhook_events", name)
          for name in ("given_up_by", "given_up_at", "given_up_reason")))
    scratch_db.execute_sql(
        "INSERT INTO webhook_events (source, event_type, dedup_key, payload, status, "
        "attempts, received_at, created_at, updated_at) VALUES ('card', 'x', 'k', '{}', "
        "'dead', 5, '2026-11-20 09:00:00+00:00', '2026-11-20 09:00:00+00:00', "
        "'2026-11-20 09:00:00+00:00')")
    EVENT_GIVEN_UP.apply(scratch_db, migrator)
    assert columns() == fresh
    EVENT_GIVEN_UP.apply(scratch_db, migrator)
    assert columns() == fresh
    assert scratch_db.execute_sql(
        "SELECT status, given_up_by, given_up_at, given_up_reason FROM webhook_events"
    ).fetchall() == [("dead", None, None, None)]


# What a migration may do, so that the release before it runs on the schema it leaves
# (deploy/DEPLOY.md, "Rolling an upgrade back"): add, never take away or rename, never
# make a column required.
TAKES_AWAY = re.compile(r"\.(drop_column|rename_column|rename_table|drop_table|add_not_null)\("
                        r"|DROP\s+(TABLE|COLUMN)|RENAME\s+(TO|COLUMN)|SET\s+NOT\s+NULL",
                        re.IGNORECASE)


def test_every_migration_only_adds_so_the_release_before_runs_on_its_schema(scratch_db,
                                                                           monkeypatch):
    added = []

    def recorded(db, migrator, table, name, field):
        added.append((table, name))
        migrations.add_column_if_missing(db, migrator, table, name, field)

    for name in migrations.available():
        with open(os.path.join(os.path.dirname(migrations.__file__), f"{name}.py"),
                  encoding="utf-8") as source:
            assert not TAKES_AWAY.search(source.read()), name
        module = importlib.import_module(f"migrations.{name}")
        if hasattr(module, "add_column_if_missing"):
            monkeypatch.setattr(module, "add_column_if_missing", recorded)
        module.apply(scratch_db, migrator_for(scratch_db))  # a no-op where applied
    assert ("webhook_events", "given_up_reason") in added
    # A column added later is one the release before does not write: it may be empty, or
    # the database fills it in.
    required = [(table, name) for table, name in added
                if not any(column.name == name and (column.null or column.default is not None)
                           for column in scratch_db.get_columns(table))]
    assert required == []


def test_each_migration_has_a_number_of_its_own():
    numbers = [name[:4] for name in migrations.available()]
    assert len(numbers) == len(set(numbers))


def test_a_database_that_recorded_the_old_names_is_unchanged_and_records_the_new_ones(
        scratch_db):
    with scratch_db.bind_ctx([LedgerEntry]):  # what the ledger migration would rewrite
        LedgerEntry.create(order_id="CA-1", order_type="canada_crtc", coin="BTC",
                           provider="crypto-processor", provider_ref="tx-1",
                           provider_status="PAID", idempotency_key="crypto-processor:tx-1")
    with scratch_db.bind_ctx([migrations.SchemaMigration]):
        for old, new in migrations.RENAMED.items():
            (migrations.SchemaMigration.update(name=old)
             .where(migrations.SchemaMigration.name == new).execute())

    def state():
        tables = sorted(scratch_db.get_tables())
        return ({table: (scratch_db.get_columns(table), scratch_db.get_indexes(table))
                 for table in tables if table != "schema_migrations"},
                scratch_db.execute_sql("SELECT idempotency_key FROM ledger_entries").fetchall())
    before = state()
    assert migrations.pending(scratch_db) == []

    assert migrations.migrate(scratch_db) == []
    assert state() == before
    recorded = {row[0] for row in scratch_db.execute_sql(
        "SELECT name FROM schema_migrations").fetchall()}
    assert recorded == set(migrations.available())
    assert migrations.migrate(scratch_db) == []
