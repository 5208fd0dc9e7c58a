"""BEHAVIOUR.md 2.4, 2.5, 4.3: a crypto payment's ledger sums to what was received and its
treasury job follows the invoice, whatever order SHKeeper's callbacks come in (a callback
listing no transaction, the fallback txid, is replaced by the transactions once listed,
and is no second payment); fiat amounts in their currency's own minor unit; an invoice
paid past CRYPTO_PAYMENT_TOLERANCE_PERCENT more or less than expected is told. Callbacks
as SHKeeper sends them (tests/shkeeper.py)."""
import dataclasses
import itertools
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from models import CrtcOrder, FormationOrder, LedgerEntry, TreasuryJob
from engine import inbox
from tests import shkeeper
from tests.shkeeper import API_KEY, URL, key_headers


@pytest.fixture
def settings(settings):
    return dataclasses.replace(settings, crypto_processor_api_key=API_KEY)


async def send(post, ctx, callback):
    status, reply, _ = await post(URL, callback, key_headers())
    assert (status, reply) == (202, {"received": True})
    await ctx.drain_background()


def ledger_of(order_number):
    return sorted((entry.provider_ref, entry.amount_coin, entry.amount_fiat_cents,
                   entry.fallback)
                  for entry in LedgerEntry.select().where(LedgerEntry.order_id == order_number))


def subjects(smtp):
    return [message["Subject"] for _, message in smtp.messages]


# --- one unit per currency ---------------------------------------------------------------

@pytest.mark.parametrize("fiat,balance,minor", [
    ("JPY", "48959.975", 48960), ("KWD", "12.3456", 12346), ("USD", "7.805", 781),
    ("EUR", "0.5", 50),
])
@pytest.mark.gen_test
async def test_a_fiat_amount_is_kept_in_its_currencys_minor_unit(post, ctx, fiat, balance,
                                                                 minor):
    """A yen is not a hundred yen (the job stored ¥48,959.975 as 4895998), nor is a
    thousandth of a dinar dropped."""
    CrtcOrder.create(order_number="CA-1")
    await send(post, ctx, shkeeper.paid("CA-1", balance_fiat=balance, fiat=fiat))
    job, entry = TreasuryJob.get(), LedgerEntry.get()
    assert (job.fiat_currency, job.amount_fiat_cents) == (fiat, minor)
    assert (entry.fiat_currency, entry.amount_fiat_cents) == (fiat, minor)
    assert job.amount_usd_cents == (minor if fiat == "USD" else None)


# --- the fallback txid is replaced, not added to ---------------------------------------------

def invoice_without_transactions(number, status, balance_crypto, balance_fiat, **fields):
    return shkeeper.invoice(number, status, [], balance_crypto, balance_fiat, **fields)


def two_transactions(number):
    """The invoice as a later callback lists it: OVERPAID by a second transaction."""
    first = shkeeper.transaction("tx-one", "0.0015", "144")
    second = shkeeper.transaction("tx-two", "0.0001", "9.6", trigger=True)
    return shkeeper.invoice(number, "OVERPAID", [first, second], "0.0016", "153.6",
                            overpaid_fiat="2.40")


@pytest.mark.gen_test
async def test_a_callback_listing_its_transactions_replaces_the_fallback_entry(
        post, ctx, smtp, telegram):
    """A PAID callback without transactions, then an OVERPAID one listing them: the ledger
    held both (0.0031 BTC for a 0.0016 BTC invoice) and a 'second payment' was mailed."""
    FormationOrder.create(order_number="FO-2")
    await send(post, ctx, invoice_without_transactions("FO-2", "PAID", "0.0015", "144"))
    [(fallback_ref, *_)] = ledger_of("FO-2")
    assert fallback_ref.startswith("crypto-BTC-")
    assert TreasuryJob.get().fallback is True
    await send(post, ctx, two_transactions("FO-2"))

    assert ledger_of("FO-2") == [("tx-one", Decimal("0.0015"), 14400, False),
                                 ("tx-two", Decimal("0.0001"), 960, False)]
    job = TreasuryJob.get()
    assert (job.amount_coin, job.amount_fiat_cents, job.idempotency_key, job.fallback) == (
        Decimal("0.0016"), 15360, "crypto-settle:FO-2:tx-one", False)
    order = FormationOrder.get()
    assert (order.payment_status, order.stripe_session_id) == ("paid", "crypto-tx-one")
    assert not [s for s in subjects(smtp) if s.startswith("Second payment")]
    # The order alert told what the first callback had; the next, what the ledger has now.
    paid_alert, grown = (alert.json["text"] for alert in telegram.requests)
    assert "Amount: $144.00 (0.0015 BTC)" in paid_alert.splitlines()
    assert grown.startswith("Crypto payment for order FO-2 is now $153.60, was $144.00")
    assert (order.payment_amount, order.payment_currency) == (15360, "USD")


@pytest.mark.gen_test
async def test_a_fallback_callback_after_the_transactions_were_listed_adds_nothing(
        post, ctx, smtp):
    FormationOrder.create(order_number="FO-3")
    await send(post, ctx, two_transactions("FO-3"))
    await send(post, ctx, invoice_without_transactions("FO-3", "PAID", "0.0015", "144"))
    assert [ref for ref, *_ in ledger_of("FO-3")] == ["tx-one", "tx-two"]
    assert TreasuryJob.get().amount_coin == Decimal("0.0016")
    assert FormationOrder.get().stripe_session_id == "crypto-tx-one"
    assert not [s for s in subjects(smtp) if s.startswith("Second payment")]


@pytest.mark.gen_test
async def test_two_callbacks_without_transactions_keep_one_entry_of_the_larger_balance(
        post, ctx, clock):
    FormationOrder.create(order_number="FO-4")
    await send(post, ctx, invoice_without_transactions("FO-4", "OVERPAID", "0.0016", "153.6"))
    clock.advance(minutes=5)
    await send(post, ctx, invoice_without_transactions("FO-4", "PAID", "0.0015", "144"))
    [(_, amount, cents, fallback)] = ledger_of("FO-4")
    assert (amount, cents, fallback) == (Decimal("0.0016"), 15360, True)
    assert TreasuryJob.get().amount_coin == Decimal("0.0016")


# --- over- and underpaid ---------------------------------------------------------------------

@pytest.mark.parametrize("total_cents,subject", [
    (32000, None),                                                   # 320.00 net of the fee
    (27350, "Crypto invoice for order CA-5 overpaid by 17.0 %"),
    (40000, "Crypto invoice for order CA-5 underpaid by 20.0 %"),
    (None, None),                                                    # PAID: SHKeeper's limits
])
@pytest.mark.gen_test
async def test_an_invoice_paid_past_the_tolerance_against_the_orders_total_is_told(
        post, ctx, smtp, total_cents, subject):
    CrtcOrder.create(order_number="CA-5", total_cents=total_cents)
    _, paid, _ = shkeeper.paid_in_steps("CA-5")  # 326.4 USD with SHKeeper's 2 % fee
    await send(post, ctx, paid)
    told = [s for s in subjects(smtp) if s.startswith("Crypto invoice")]
    assert told == ([subject] if subject else [])
    if subject:
        text = smtp.messages[-1][1].get_body(("plain",)).get_content()
        assert "$320.00" in text and "$326.40" in text
        assert f"Order total: ${total_cents // 100}.{total_cents % 100:02}" in text


@pytest.mark.parametrize("total_cents,currency,fiat,subject", [
    (4896, "JPY", "JPY", None),  # ¥4,896 asked, ¥4,896 paid: yen have no minor unit
    (4000, "JPY", "JPY", "Crypto invoice for order CA-8 overpaid by 22.4 %"),
    # Priced in CAD, invoiced in USD: not compared, the mismatch told.
    (4896, "CAD", "USD", "Crypto invoice for order CA-8 is in USD; the order is priced in CAD"),
])
@pytest.mark.gen_test
async def test_an_orders_total_is_read_in_its_own_currency(
        post, ctx, smtp, total_cents, currency, fiat, subject):
    CrtcOrder.create(order_number="CA-8", total_cents=total_cents, currency=currency)
    paid = shkeeper.paid("CA-8", balance_fiat="4993.92", fiat=fiat)  # 4,896 with the fee
    await send(post, ctx, paid)
    told = [s for s in subjects(smtp) if s.startswith("Crypto invoice")]
    assert told == ([subject] if subject else [])


@pytest.mark.gen_test
async def test_an_overpaid_invoice_without_an_order_total_is_told_by_shkeepers_measure(
        post, ctx, smtp):
    FormationOrder.create(order_number="FO-6")
    *_, overpaid = shkeeper.paid_in_steps("FO-6")  # overpaid_fiat 38.40 of 374.40
    await send(post, ctx, overpaid)
    await send(post, ctx, overpaid)
    assert [s for s in subjects(smtp) if s.startswith("Crypto invoice")] == [
        "Crypto invoice for order FO-6 overpaid by 11.4 %"]
    # SHKeeper's upper limit is what it counts as paid within it, not what was expected
    # (the mail called it "Expected").
    [mail] = [m for _, m in smtp.messages if m["Subject"].startswith("Crypto invoice")]
    text = mail.get_body(("plain",)).get_content()
    assert "Expected" not in text
    assert "Paid within SHKeeper's upper limit: $336.00" in text
    assert "Paid beyond it:                     $38.40" in text


@pytest.mark.gen_test
async def test_the_tolerance_is_a_setting(post, ctx, smtp):
    ctx.settings = dataclasses.replace(ctx.settings,
                                       crypto_payment_tolerance_percent=Decimal(12))
    FormationOrder.create(order_number="FO-7")
    *_, overpaid = shkeeper.paid_in_steps("FO-7")
    await send(post, ctx, overpaid)
    assert not [s for s in subjects(smtp) if s.startswith("Crypto invoice")]


# --- every ordering ------------------------------------------------------------------------

_example = itertools.count(1)


def callbacks(number):
    """One invoice's callbacks: PARTIAL, PAID listing nothing (the fallback txid), PAID
    and OVERPAID listing their transactions."""
    partial, paid, overpaid = shkeeper.paid_in_steps(number)
    return {"partial": partial,
            "paid without transactions": {**paid, "transactions": []},
            "paid": paid, "overpaid": overpaid}


@hypothesis_settings(max_examples=60, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ordering=st.permutations(sorted(callbacks("x"))),
       resent=st.lists(st.sampled_from(sorted(callbacks("x"))), max_size=2))
def test_every_ordering_of_an_invoices_callbacks_gives_one_ledger_job_and_payment(
        io_loop, post, ctx, clock, smtp, telegram, ordering, resent):
    number = f"FO-Q{next(_example)}"

    async def run():
        FormationOrder.create(order_number=number)
        sent = callbacks(number)
        for name in [*ordering, *resent]:
            clock.advance(seconds=61)
            await send(post, ctx, sent[name])
        clock.advance(hours=1)
        assert await inbox.retry_due(ctx) == 0
    io_loop.run_sync(run)

    assert ledger_of(number) == [
        ("tx-step-1", Decimal("0.001"), 9600, False),
        ("tx-step-2", Decimal("0.0024"), 23040, False),
        ("tx-step-3", Decimal("0.0005"), 4800, False)], ordering
    job = TreasuryJob.get(TreasuryJob.order_id == number)
    assert (job.amount_coin, job.amount_fiat_cents, job.idempotency_key, job.fallback) == (
        Decimal("0.0039"), 37440, f"crypto-settle:{number}:tx-step-1", False), ordering
    order = FormationOrder.get(FormationOrder.order_number == number)
    assert (order.payment_status, order.stripe_session_id) == ("paid", "crypto-tx-step-1")
    assert (order.payment_amount, order.payment_currency) == (37440, "USD"), ordering
    # One order alert, and one more when the amount grew after it: the last tells the ledger's.
    alerts = [r.json["text"] for r in telegram.requests if number in r.json["text"]]
    assert len(alerts) in (1, 2) and shkeeper.told_amount(alerts) == "$374.40", alerts
    assert not [s for s in subjects(smtp) if s == f"Second payment for order {number}"]


@pytest.mark.parametrize("field", ["fee_percent", "overpaid_fiat"])
@pytest.mark.gen_test
async def test_an_unreadable_fee_or_overpaid_measure_does_not_refuse_the_payment(
        post, ctx, smtp, field, caplog):
    FormationOrder.create(order_number="FO-8")
    await send(post, ctx, {**shkeeper.paid("FO-8"), field: "n/a"})
    assert FormationOrder.get().payment_status == "paid"
    assert f"{field} is not a number" in caplog.text
