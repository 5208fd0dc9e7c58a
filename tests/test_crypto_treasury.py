"""BEHAVIOUR.md 2.4 and 2.5: the treasury job and ledger entry a paid crypto invoice leaves, and
the payment it completes, through SHKeeper's real sequence of callbacks."""
import asyncio
import dataclasses
import datetime
import json
from decimal import Decimal

import pytest

import plugins
from models import (
    UTC, CrtcOrder, FormationOrder, LedgerEntry, Outbox, TreasuryJob, WebhookEvent)
from domain import orders, treasury
from domain.money import minor_units
from tests import shkeeper
from tests.conftest import table_away
from tests.shkeeper import API_KEY, URL, key_headers


@pytest.fixture
def settings(settings):
    return dataclasses.replace(settings, crypto_processor_api_key=API_KEY)


async def send(post, callback):
    status, reply, _ = await post(URL, callback, key_headers())
    assert (status, reply) == (202, {"received": True})


@pytest.mark.gen_test
async def test_a_paid_invoice_leaves_a_job_an_entry_and_a_paid_order(post, clock, telegram):
    clock.set(2026, 11, 20, 9, 30)
    CrtcOrder.create(order_number="CA-1001", service_name="CRTC licence",
                     discount_code="CRYPTO10")
    await send(post, shkeeper.paid("CA-1001", txid="0x518a10b1", balance_crypto="7.80000000",
                                   balance_fiat="7.80", crypto="ETH-USDT"))
    now = datetime.datetime(2026, 11, 20, 9, 30, tzinfo=UTC)
    # The transaction's date: when SHKeeper stored it, before it sent the callback.
    stored = datetime.datetime(2026, 11, 20, 9, 0, tzinfo=UTC)

    job = TreasuryJob.get()
    assert (job.order_id, job.order_type, job.state, job.coin) == (
        "CA-1001", "canada_crtc", "received", "ETH-USDT")
    assert (job.amount_coin, job.amount_usd_cents) == (Decimal("7.80000000"), 780)
    assert job.idempotency_key == "crypto-settle:CA-1001:0x518a10b1"
    assert job.received_at == now

    entry = LedgerEntry.get()
    assert dataclasses.astuple(_ledger(entry)) == (
        "CA-1001", "canada_crtc", "ETH-USDT", "receive", Decimal("7.8"), 780,
        "crypto-processor", "0x518a10b1", "PAID", "confirmed",
        "crypto-processor:CA-1001:0x518a10b1", stored)
    assert entry.notes == "PAID: received 7.8 ETH-USDT (7.8 USD, fee 0.1529411765)"

    order = CrtcOrder.get()
    assert (order.payment_status, order.paid_at, order.stripe_session_id,
            order.payment_method) == ("paid", stored, "crypto-0x518a10b1", "crypto")
    [alert] = telegram.requests
    assert "CA-1001" in alert.json["text"] and "crypto" in alert.json["text"]
    assert "CRYPTO10" in alert.json["text"]
    assert WebhookEvent.get().status == "processed"


@dataclasses.dataclass
class _LedgerRow:
    order_id: str
    order_type: str
    coin: str
    movement_type: str
    amount_coin: Decimal
    amount_usd_cents: int
    provider: str
    provider_ref: str
    provider_status: str
    state: str
    idempotency_key: str
    acquired_at: datetime.datetime


def _ledger(entry):
    return _LedgerRow(*(getattr(entry, f.name) for f in dataclasses.fields(_LedgerRow)))


async def send_signed(post, clock, callback):
    """As SHKeeper sends it: the body serialised as it signs it, the key and signature."""
    raw = shkeeper.encode(callback)
    headers = shkeeper.signed_headers(raw, int(clock().timestamp()))
    status, reply, _ = await post(URL, raw, headers)
    assert (status, reply) == (202, {"received": True})


def ledger_of(order_number):
    return [(entry.provider_ref, entry.amount_coin, entry.amount_usd_cents,
             entry.idempotency_key)
            for entry in LedgerEntry.select().where(LedgerEntry.order_id == order_number)
            .order_by(LedgerEntry.id)]


@pytest.mark.gen_test
async def test_partial_then_paid_then_overpaid(post, clock, telegram):
    """FO-1002 paid in three transactions. Every callback lists the invoice's whole
    history; the ledger gets one entry per transaction, and sums to the invoice."""
    clock.set(2026, 11, 20, 9, 0)
    FormationOrder.create(order_number="FO-1002")
    partial, paid, overpaid = shkeeper.paid_in_steps("FO-1002")

    await send_signed(post, clock, partial)
    assert TreasuryJob.select().count() == 0 and LedgerEntry.select().count() == 0
    assert FormationOrder.get().payment_status == "pending_payment" and not telegram.requests

    clock.advance(minutes=20)
    await send_signed(post, clock, paid)
    # The PARTIAL transaction's entry is written now: the PAID callback lists it.
    assert ledger_of("FO-1002") == [
        ("tx-step-1", Decimal("0.001"), 9600, "crypto-processor:FO-1002:tx-step-1"),
        ("tx-step-2", Decimal("0.0024"), 23040, "crypto-processor:FO-1002:tx-step-2")]
    job = TreasuryJob.get()
    assert (job.amount_coin, job.amount_usd_cents, job.state) == (
        Decimal("0.0034"), 32640, "received")
    paid_at = FormationOrder.get().paid_at
    assert FormationOrder.get().payment_status == "paid"

    clock.advance(minutes=20)
    await send_signed(post, clock, overpaid)
    entries = ledger_of("FO-1002")
    assert [entry[0] for entry in entries] == ["tx-step-1", "tx-step-2", "tx-step-3"]
    assert sum(entry[1] for entry in entries) == Decimal("0.0039")
    assert sum(entry[2] for entry in entries) == 37440
    assert entries[2][3] == "crypto-processor:FO-1002:tx-step-3"
    job = TreasuryJob.get()
    assert (job.amount_coin, job.amount_usd_cents) == (Decimal("0.0039"), 37440)
    assert job.idempotency_key == "crypto-settle:FO-1002:tx-step-1"
    assert job.updated_at == clock() and job.received_at == paid_at
    order = FormationOrder.get()
    assert (order.payment_status, order.paid_at, order.stripe_session_id) == (
        "paid", paid_at, "crypto-tx-step-1")
    # Each entry's status is the newest listing's.
    assert [e.provider_status for e in LedgerEntry.select().order_by(LedgerEntry.id)] == [
        "OVERPAID"] * 3
    # The order alert, then the amount's change.
    assert [alert.json["text"] for alert in telegram.requests][1].startswith(
        "Crypto payment for order FO-1002 is now $374.40, was $326.40")

    # SHKeeper re-sends each callback every 60 s until it sees 202 (a lost answer, say).
    for callback in (partial, paid, overpaid):
        clock.advance(seconds=60)
        await send_signed(post, clock, callback)
    assert ledger_of("FO-1002") == entries and len(telegram.requests) == 2
    assert TreasuryJob.get().amount_coin == Decimal("0.0039")
    assert [e.event_type for e in WebhookEvent.select().order_by(WebhookEvent.id)] == [
        "PARTIAL", "PAID", "OVERPAID"]


@pytest.mark.gen_test
async def test_a_repeat_of_paid_is_one_event_and_changes_nothing(post, clock, telegram):
    CrtcOrder.create(order_number="CA-1001")
    callback = shkeeper.paid("CA-1001")
    await send(post, callback)
    clock.advance(seconds=60)
    await send(post, callback)
    # The same callback serialised differently (key order, spacing) is still the same.
    await send(post, shkeeper.encode(callback).replace(b",", b", "))
    assert WebhookEvent.select().count() == 1
    assert TreasuryJob.select().count() == 1 and LedgerEntry.select().count() == 1
    assert len(telegram.requests) == 1


@pytest.mark.gen_test
async def test_a_job_past_received_is_left_untouched(post, clock, telegram):
    clock.set(2026, 11, 20, 9, 0)
    CrtcOrder.create(order_number="CA-1001")
    partial, paid, overpaid = shkeeper.paid_in_steps("CA-1001")
    await send(post, paid)
    TreasuryJob.update(state="sizing").execute()
    before = TreasuryJob.get()

    clock.advance(hours=1)
    await send(post, overpaid)
    after = TreasuryJob.get()
    assert (after.state, after.amount_coin, after.amount_usd_cents, after.updated_at) == (
        "sizing", before.amount_coin, before.amount_usd_cents, before.updated_at)
    assert WebhookEvent.select().where(WebhookEvent.status == "processed").count() == 2


@pytest.mark.gen_test
async def test_a_new_invoice_for_an_order_whose_job_is_sizing_still_pays_and_ledgers(
        post, telegram):
    CrtcOrder.create(order_number="CA-1001")
    TreasuryJob.create(order_id="CA-1001", order_type="canada_crtc", state="sizing",
                       coin="BTC", amount_coin=Decimal("0.5"), amount_usd_cents=5,
                       idempotency_key="crypto-settle:CA-1001:older")
    await send(post, shkeeper.paid("CA-1001", txid="tx-new"))
    job = TreasuryJob.get()
    assert (job.state, job.amount_coin, job.amount_usd_cents) == ("sizing", Decimal("0.5"), 5)
    assert LedgerEntry.get().provider_ref == "tx-new"
    assert CrtcOrder.get().payment_status == "paid"


@pytest.mark.gen_test
async def test_a_ledger_entry_already_recorded_is_skipped_silently(post, telegram):
    CrtcOrder.create(order_number="CA-1001")
    LedgerEntry.create(order_id="CA-1001", order_type="canada_crtc", coin="BTC",
                       amount_coin=Decimal("0.00012345"), amount_usd_cents=780,
                       provider="crypto-processor", provider_ref="tx-paid-1",
                       provider_status="PAID", idempotency_key="crypto-processor:CA-1001:tx-paid-1")
    await send(post, shkeeper.paid("CA-1001"))
    assert LedgerEntry.select().count() == 1 and TreasuryJob.select().count() == 1
    assert CrtcOrder.get().payment_status == "paid"
    assert WebhookEvent.get().status == "processed"


@pytest.mark.gen_test
async def test_one_transaction_paying_two_invoices_is_an_entry_for_each_order(post, telegram):
    """An exchange's batch payout: one transaction pays CA-1007 and CA-1008. SHKeeper
    lists the same txid in each invoice's callback, with the amount that invoice got."""
    for number in ("CA-1007", "CA-1008"):
        CrtcOrder.create(order_number=number)
    await send(post, shkeeper.paid("CA-1007", txid="tx-batch-1", balance_crypto="0.001",
                                   balance_fiat="96"))
    await send(post, shkeeper.paid("CA-1008", txid="tx-batch-1", balance_crypto="0.0024",
                                   balance_fiat="230.4"))
    entries = [(e.order_id, e.provider_ref, e.amount_coin, e.amount_usd_cents,
                e.idempotency_key) for e in LedgerEntry.select().order_by(LedgerEntry.id)]
    assert entries == [
        ("CA-1007", "tx-batch-1", Decimal("0.001"), 9600, "crypto-processor:CA-1007:tx-batch-1"),
        ("CA-1008", "tx-batch-1", Decimal("0.0024"), 23040,
         "crypto-processor:CA-1008:tx-batch-1")]
    assert [o.payment_status for o in CrtcOrder.select()] == ["paid", "paid"]
    # SHKeeper re-sends each callback until it sees 202: nothing more.
    await send(post, shkeeper.paid("CA-1008", txid="tx-batch-1", balance_crypto="0.0024",
                                   balance_fiat="230.4"))
    assert LedgerEntry.select().count() == 2


@pytest.mark.gen_test
async def test_an_invoice_in_euros_is_kept_in_euros_and_the_administrator_told(
        post, telegram, smtp):
    # On the real SHKeeper a EUR invoice was recorded as USD cents.
    CrtcOrder.create(order_number="CA-2001")
    callback = shkeeper.paid("CA-2001", txid="tx-eur-1", balance_crypto="0.00107",
                             balance_fiat="101.99", fiat="EUR")
    await send(post, callback)
    job, entry = TreasuryJob.get(), LedgerEntry.get()
    assert (job.fiat_currency, job.amount_fiat_cents, job.amount_usd_cents) == (
        "EUR", 10199, None)
    assert (entry.fiat_currency, entry.amount_fiat_cents, entry.amount_usd_cents) == (
        "EUR", 10199, None)
    assert "(101.99 EUR, fee " in entry.notes
    assert CrtcOrder.get().payment_status == "paid"
    [notice] = [row for row in Outbox.select() if row.kind == "email"]
    mail = json.loads(notice.payload)
    assert mail["subject"] == ("Crypto invoice for order CA-2001 is in EUR; the order is "
                               "priced in USD")
    assert "101.99 EUR" in mail["text"] and "Order priced in: USD" in mail["text"]
    # SHKeeper's OVERPAID top-up of the same invoice: the administrator was told already.
    await send(post, shkeeper.invoice(
        "CA-2001", "OVERPAID",
        [shkeeper.transaction("tx-eur-1", "0.00107", "101.99"),
         shkeeper.transaction("tx-eur-2", "0.0001", "9.53", trigger=True)],
        "0.00117", "111.52", fiat="EUR", overpaid_fiat="4.42"))
    assert [row.kind for row in Outbox.select()].count("email") == 1
    assert TreasuryJob.get().amount_fiat_cents == 11152


@pytest.mark.gen_test
async def test_an_invoice_in_the_orders_own_currency_is_normal_whatever_the_currency(
        post, telegram, smtp):
    """Every CAD crypto payment mailed "is in CAD, not USD": most orders of a CRTC shop.
    An invoice in its order's currency is told nothing; its job keeps it in that currency."""
    CrtcOrder.create(order_number="CA-2002", currency="CAD", total_cents=10199)
    await send(post, shkeeper.paid("CA-2002", txid="tx-cad-1", balance_crypto="0.00107",
                                   balance_fiat="101.99", fiat="CAD"))
    job = TreasuryJob.get()
    assert (job.fiat_currency, job.amount_fiat_cents, job.amount_usd_cents) == (
        "CAD", 10199, None)
    assert CrtcOrder.get().payment_status == "paid"
    assert [row for row in Outbox.select() if row.kind == "email"] == []


@pytest.mark.gen_test(timeout=30)
async def test_twenty_identical_paid_callbacks_at_once(post, telegram):
    CrtcOrder.create(order_number="CA-1001")
    raw = shkeeper.encode(shkeeper.paid("CA-1001"))
    answers = await asyncio.gather(*(post(URL, raw, key_headers()) for _ in range(20)))
    assert [(status, reply) for status, reply, _ in answers] == [
        (202, {"received": True})] * 20
    assert WebhookEvent.select().count() == 1
    assert TreasuryJob.select().count() == 1 and LedgerEntry.select().count() == 1
    order = CrtcOrder.get()
    assert order.payment_status == "paid"
    assert len(telegram.requests) == 1


@pytest.mark.gen_test
async def test_a_failed_treasury_write_is_logged_and_the_payment_still_completed(
        post, db, telegram, caplog):
    CrtcOrder.create(order_number="CA-1001")
    with table_away(db, "treasury_jobs"):
        await send(post, shkeeper.paid("CA-1001"))
    assert "treasury job / ledger entry not written" in caplog.text
    # Written together: the ledger entry went with the job.
    assert TreasuryJob.select().count() == 0 and LedgerEntry.select().count() == 0
    assert CrtcOrder.get().payment_status == "paid"
    assert WebhookEvent.get().status == "processed"
    assert len(telegram.requests) == 1


@pytest.mark.gen_test
async def test_a_failed_ledger_write_takes_the_job_with_it(post, db, telegram, caplog):
    CrtcOrder.create(order_number="CA-1001")
    with table_away(db, "ledger_entries"):
        await send(post, shkeeper.paid("CA-1001"))
    assert "treasury job / ledger entry not written" in caplog.text
    assert TreasuryJob.select().count() == 0
    assert CrtcOrder.get().payment_status == "paid"


def test_a_callback_names_its_order_only_when_it_completes_it():
    """What PAID and OVERPAID lock and read (their `orders_of`): the kinds of the orders
    of its number (the stored order's kind routes it) and the order of its prefix's kind;
    none for a notice or a callback not paid."""
    registry = plugins.registries()["crypto"]

    def asked(body):
        return [(ref.kind, ref.number) for ref in registry.orders_of(body["status"], body)]
    assert asked(shkeeper.paid("CO-7")) == [(None, "CO-7"), ("compliance", "CO-7")]
    assert asked({**shkeeper.paid("X-7"), "status": "OVERPAID"}) == [(None, "X-7"),
                                                                     ("canada_crtc", "X-7")]
    assert asked({**shkeeper.paid("CO-8"), "paid": False}) == []
    assert asked({**shkeeper.paid("CO-9"), "status": "PARTIAL", "paid": False}) == []


# --- reading a callback --------------------------------------------------------------------

@pytest.mark.parametrize("order_number,order_type", [
    ("CA-1", "canada_crtc"), ("FO-1", "formation"), ("BU-1", "bundle"),
    ("CO-1", "compliance"), ("ZZ-1", "canada_crtc"), ("CA1", "canada_crtc"),
    ("", "canada_crtc"),
])
def test_order_type_of(order_number, order_type):
    assert orders.order_type_of(order_number) == order_type


@pytest.mark.parametrize("fiat,expected", [
    ("7.80", 780), ("7.805", 781), ("7.8049", 780), ("0.004", 0), ("0.005", 1),
    ("1234567.895", 123456790), ("0", 0),
    # 31 significant digits: multiplying by 100 in a 28-digit context would round to
    # 100.5 first, and then half-up to 101.
    ("1.004999999999999999999999999999", 100),
])
def test_cents_round_half_up(fiat, expected):
    assert minor_units(Decimal(fiat), "USD") == expected


def test_a_callback_reads_as_shkeeper_means_it():
    callback = treasury.Callback.parse(treasury.read(shkeeper.encode(
        shkeeper.paid_in_steps("BU-9")[2])))
    assert (callback.external_id, callback.status, callback.paid, callback.coin) == (
        "BU-9", "OVERPAID", True, "BTC")
    assert callback.txids == ("tx-step-1", "tx-step-2", "tx-step-3")
    assert (callback.amount_coin, callback.amount_fiat, callback.fiat_currency) == (
        Decimal("0.0039"), Decimal("374.4"), "USD")
    assert callback.usd_cents(callback.amount_fiat) == 37440
    third = callback.transactions[2]
    assert (third.amount_coin, third.amount_fiat, third.fee_fiat) == (
        Decimal("0.0005"), Decimal("48"), Decimal("0.9411764706"))
    assert callback.to_be_processed and callback.order_type == "bundle"


def test_the_dedup_key_separates_invoice_states_but_not_resends():
    steps = [treasury.Callback.parse(c) for c in shkeeper.paid_in_steps("CA-1")]
    keys = [c.dedup_key() for c in steps]
    assert len(set(keys)) == 3
    again = treasury.Callback.parse(shkeeper.paid_in_steps("CA-1")[1])
    assert again.dedup_key() == keys[1]
    assert all(key.startswith("CA-1:") for key in keys)


def test_an_unconfirmed_notice_reads_its_amount_and_txid():
    notice = treasury.Callback.parse(shkeeper.unconfirmed("CA-1", txid="tx-u", amount="0.5"))
    assert (notice.status, notice.notice_txid, notice.amount_coin) == (
        "unconfirmed", "tx-u", Decimal("0.5"))
    assert not notice.to_be_processed


@pytest.mark.gen_test
async def test_shkeepers_own_bytes_for_an_invoice_paid_in_three_transactions(
        post, ctx, clock, telegram):
    """The three callbacks byte for byte as SHKeeper sends them, each signed at its own
    time, then each re-sent a minute later as SHKeeper does until it sees 202."""
    ctx.settings = dataclasses.replace(ctx.settings,
                                       crypto_processor_api_key=shkeeper.WIRE_API_KEY)
    CrtcOrder.create(order_number="CA-0042")
    for repeat in (0, 60):
        for timestamp, signature, raw in shkeeper.WIRE:
            clock.fixed = datetime.datetime.fromtimestamp(timestamp + repeat, UTC)
            headers = {"Content-Type": "application/json",
                       "X-Shkeeper-Api-Key": shkeeper.WIRE_API_KEY,
                       "X-Shkeeper-Timestamp": str(timestamp),
                       "X-Shkeeper-Signature": signature}
            assert (await post(URL, raw, headers))[:2] == (202, {"received": True})
    entries = list(LedgerEntry.select().order_by(LedgerEntry.id))
    assert [(e.amount_coin, e.amount_usd_cents) for e in entries] == [
        (Decimal("0.001"), 9600), (Decimal("0.0024"), 23040), (Decimal("0.0005"), 4800)]
    assert sum(e.amount_coin for e in entries) == Decimal("0.0039")
    first_txid = entries[0].provider_ref
    assert first_txid.startswith("a1f3c9e2") and all(
        e.idempotency_key == f"crypto-processor:CA-0042:{e.provider_ref}" for e in entries)
    job = TreasuryJob.get()
    assert (job.amount_coin, job.amount_usd_cents, job.idempotency_key) == (
        Decimal("0.0039"), 37440, f"crypto-settle:CA-0042:{first_txid}")
    assert CrtcOrder.get().stripe_session_id == f"crypto-{first_txid}"
    assert WebhookEvent.select().count() == 3
    assert shkeeper.told_amount([r.json["text"] for r in telegram.requests]) == "$374.40"
    assert CrtcOrder.get().payment_amount == 37440


def test_the_test_callbacks_are_shaped_byte_for_byte_as_shkeepers():
    """tests/shkeeper.py builds what SHKeeper sends: only the ids differ."""
    for step, (_, _, wire) in zip(shkeeper.paid_in_steps("CA-0042"), shkeeper.WIRE):
        real = json.loads(wire)
        ids = dict(zip((t["txid"] for t in step["transactions"]),
                       (t["txid"] for t in real["transactions"])))
        step = {**step, "addr": real["addr"], "transactions": [
            {**t, "txid": ids[t["txid"]]} for t in step["transactions"]]}
        assert shkeeper.encode(step) == wire
