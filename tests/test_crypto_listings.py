"""BEHAVIOUR.md 4.3 rules 10 and 11: an SHKeeper invoice's state is its latest listing of
transactions, whichever callback came first. Every callback lists the invoice's
transactions so far; one that lists fewer than a callback handled already is history
(kept, answered 202, nothing sent), the order's amount is the sum of the latest listing's
ledger entries and each entry's status the latest listing's; a PARTIAL callback whose
transactions already pay the invoice is told to the administrator once.

Callbacks as SHKeeper sends them (tests/shkeeper.py), signed with its API key and its
signature headers, over loopback; the property test draws an invoice's transactions and
delivers its callbacks in any order, with copies, late copies, the order created after
some of them, and some sent while the database is down (spooled, the spool drained at
any point), and holds the outcome to what the final listing alone gives, every time in
it SHKeeper's."""
import contextlib
import dataclasses
import datetime
import decimal
import itertools
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from models import CrtcOrder, FormationOrder, LedgerEntry, Outbox, TreasuryJob, WebhookEvent
from engine import inbox
from tests import shkeeper
from tests.service_process import database_down
from tests.shkeeper import API_KEY, URL

# SHKeeper's wallet limits (its Wallet.llimit, ulimit): PAID from 95 % of the invoice's
# amount, OVERPAID from 105 %; its fee, 2 % on top of the order's total.
LOWER, UPPER, FEE = Decimal("0.95"), Decimal("1.05"), Decimal("1.02")
BTC_IN_USD = Decimal(96000)


@pytest.fixture
def settings(settings):
    return dataclasses.replace(settings, crypto_processor_api_key=API_KEY)


async def send(post, ctx, clock, callback):
    """As SHKeeper sends it: the body as it signs it, its key and signature headers. Taken
    (202) in every case; one whose order is unknown yet is tried again later, and says
    so."""
    raw = shkeeper.encode(callback)
    status, reply, _ = await post(URL, raw, shkeeper.signed_headers(
        raw, int(clock().timestamp())))
    assert status == 202 and reply in ({"received": True},
                                       {"received": True, "error": "internal"})
    await ctx.drain_background()


def shkeeper_time(moment):
    """An aware time as SHKeeper writes its transactions' dates (UTC, to the second)."""
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def ledger_of(number):
    return [(entry.provider_ref, entry.amount_coin, entry.amount_fiat_cents,
             entry.provider_status)
            for entry in LedgerEntry.select().where(LedgerEntry.order_id == number)
            .order_by(LedgerEntry.provider_ref)]


def subjects(smtp, number):
    return [message["Subject"] for _, message in smtp.messages if number in message["Subject"]]


def alerts(telegram, number):
    return [request.json["text"] for request in telegram.requests
            if number in request.json["text"]]


def states(number):
    return [(event.event_type, event.status)
            for event in WebhookEvent.select().where(WebhookEvent.order_number == number)
            .order_by(WebhookEvent.id)]


# --- an older listing after a newer one ------------------------------------------------------

@pytest.mark.gen_test
async def test_an_older_listing_that_arrives_after_a_newer_one_is_history(
        post, ctx, clock, smtp, telegram):
    """OVERPAID (three transactions) is handled, then PAID (two) and PARTIAL (one) come
    late: both are kept and answered 202, and nothing changes or is sent for them."""
    clock.set(2026, 11, 20, 10, 20)
    FormationOrder.create(order_number="FO-11")
    partial, paid, overpaid = shkeeper.paid_in_steps("FO-11")
    await send(post, ctx, clock, overpaid)
    ledger, outbox = ledger_of("FO-11"), Outbox.select().count()
    job = TreasuryJob.get()

    clock.advance(minutes=5)
    await send(post, ctx, clock, paid)
    await send(post, ctx, clock, partial)
    assert states("FO-11") == [("OVERPAID", "processed"), ("PAID", "ignored"),
                               ("PARTIAL", "ignored")]
    assert "an older listing of the invoice (2 transactions) than the one handled as " \
        "event #" in WebhookEvent.get(WebhookEvent.event_type == "PAID").last_error
    assert ledger_of("FO-11") == ledger and Outbox.select().count() == outbox
    assert [e.provider_status for e in LedgerEntry.select()] == ["OVERPAID"] * 3
    after = TreasuryJob.get()
    assert (after.amount_coin, after.amount_fiat_cents, after.updated_at) == (
        job.amount_coin, job.amount_fiat_cents, job.updated_at)
    assert FormationOrder.get().payment_amount == 37440
    assert len(alerts(telegram, "FO-11")) == 1


@pytest.mark.gen_test
async def test_callbacks_held_while_the_order_is_unknown_go_in_listing_order(post, ctx, clock):
    """OVERPAID came first, while the order was unknown (its payment is tried again later);
    PAID, a shorter listing, came next: placed before it, it is tried too. Once the order
    exists the retry hands them over in listing order, so the order ends with OVERPAID's
    listing; the PARTIAL callback SHKeeper re-sends late is history, and a copy of PAID is
    the event stored already."""
    clock.set(2026, 11, 20, 10, 0)
    partial, paid, overpaid = shkeeper.paid_in_steps("FO-12")
    await send(post, ctx, clock, overpaid)
    await send(post, ctx, clock, paid)
    assert [status for _, status in states("FO-12")] == ["failed", "failed"]
    FormationOrder.create(order_number="FO-12")
    clock.advance(hours=1)
    await inbox.retry_due(ctx)
    await ctx.drain_background()
    assert states("FO-12") == [("OVERPAID", "processed"), ("PAID", "processed")]
    await send(post, ctx, clock, partial)
    await send(post, ctx, clock, paid)
    assert states("FO-12")[2:] == [("PARTIAL", "ignored")]
    saved = FormationOrder.get()
    assert (saved.payment_amount, saved.stripe_session_id) == (37440, "crypto-tx-step-1")
    assert [status for *_, status in ledger_of("FO-12")] == ["OVERPAID"] * 3


# --- the order's amount and the entries' status -----------------------------------------------

@pytest.mark.gen_test
async def test_the_orders_amount_is_its_latest_listings_whichever_came_first(
        post, ctx, clock, telegram):
    """$326.40 then $48.00: the order says $374.40 in either order, as its ledger does;
    the alert that follows the order alert says what the amount is now, and was."""
    clock.set(2026, 11, 20, 10, 20)
    for number, order in (("FO-13", ("paid", "overpaid")), ("FO-14", ("overpaid", "paid"))):
        FormationOrder.create(order_number=number)
        _, paid, overpaid = shkeeper.paid_in_steps(number)
        for name in order:
            await send(post, ctx, clock, {"paid": paid, "overpaid": overpaid}[name])
        saved = FormationOrder.get(FormationOrder.order_number == number)
        assert (saved.payment_amount, saved.payment_currency) == (37440, "USD"), number
        assert sum(cents for _, _, cents, _ in ledger_of(number)) == 37440
        assert [status for *_, status in ledger_of(number)] == ["OVERPAID"] * 3, number
    first, grown = alerts(telegram, "FO-13")
    assert "Amount: $326.40 (0.0034 BTC)" in first.splitlines()
    assert grown == ("Crypto payment for order FO-13 is now $374.40, was $326.40 "
                     "(0.0039 BTC, OVERPAID)")
    [only] = alerts(telegram, "FO-14")
    assert "Amount: $374.40 (0.0039 BTC)" in only.splitlines()


# --- a PARTIAL invoice already paid -----------------------------------------------------------

def partial_but_paid(number):
    """Two transactions SHKeeper took at once: its balance counts the first alone (the
    second's update lost), so the invoice stays PARTIAL while the callback lists both:
    $96 + $230.40 of a $320 order with SHKeeper's 2 % fee."""
    first = shkeeper.transaction("tx-race-1", "0.001", "96", date="2026-11-20 09:00:12")
    second = shkeeper.transaction("tx-race-2", "0.0024", "230.4", trigger=True,
                                  date="2026-11-20 09:00:13")
    return shkeeper.invoice(number, "PARTIAL", [first, second], "0.001", "96")


@pytest.mark.gen_test
async def test_a_partial_callback_whose_transactions_pay_the_orders_total_is_told_once(
        post, ctx, clock, smtp):
    clock.set(2026, 11, 20, 9, 1)
    CrtcOrder.create(order_number="CA-15", total_cents=32000)
    callback = partial_but_paid("CA-15")
    await send(post, ctx, clock, callback)
    clock.advance(seconds=60)
    await send(post, ctx, clock, callback)  # SHKeeper's re-send: the same event
    await send(post, ctx, clock, {**callback, "transactions": callback["transactions"][::-1]})
    assert subjects(smtp, "CA-15") == [
        "Crypto invoice for order CA-15 is paid, SHKeeper says PARTIAL"]
    text = smtp.messages[-1][1].get_body(("plain",)).get_content()
    assert "the order's total of $320.00: $320.00 less SHKeeper's fee ($326.40 in all)" in \
        " ".join(text.split())
    assert LedgerEntry.select().count() == 0 and CrtcOrder.get().payment_status == \
        "pending_payment"


@pytest.mark.gen_test
async def test_without_an_order_total_a_partial_listing_more_than_its_balance_is_told(
        post, ctx, clock, smtp):
    clock.set(2026, 11, 20, 9, 1)
    FormationOrder.create(order_number="FO-16")
    await send(post, ctx, clock, partial_but_paid("FO-16"))
    assert subjects(smtp, "FO-16") == [
        "Crypto invoice for order FO-16 is paid, SHKeeper says PARTIAL"]
    text = " ".join(smtp.messages[-1][1].get_body(("plain",)).get_content().split())
    assert "add up to $326.40, more than the $96.00 SHKeeper counts as its balance" in text


@pytest.mark.parametrize("order", ["crtc with a total", "formation"])
@pytest.mark.gen_test
async def test_a_partial_callback_is_told_only_once_its_transactions_pay_the_invoice(
        post, ctx, clock, smtp, order):
    clock.set(2026, 11, 20, 9, 1)
    number = "FO-17" if order == "formation" else "CA-17"
    if order == "formation":
        FormationOrder.create(order_number=number)
    else:
        CrtcOrder.create(order_number=number, total_cents=32000)
    partial, *_ = shkeeper.paid_in_steps(number)
    await send(post, ctx, clock, partial)
    # $230.40 of $320 less the fee: 70.6 %, past the 5 % tolerance, and its balance.
    await send(post, ctx, clock, {**partial_but_paid(number), "transactions": [
        shkeeper.transaction("tx-race-2", "0.0024", "230.4", trigger=True)],
        "balance_fiat": "230.4", "balance_crypto": "0.0024"})
    assert subjects(smtp, number) == []
    await send(post, ctx, clock, partial_but_paid(number))
    assert subjects(smtp, number) == [
        f"Crypto invoice for order {number} is paid, SHKeeper says PARTIAL"]


# --- any delivery of an invoice's callbacks ---------------------------------------------------

_example = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class Invoice:
    """An invoice as SHKeeper keeps it: the order's total, the transactions' fiat amounts
    (fee included), and whether its last two came at once and the last one's update of the
    balance was lost."""
    total: int
    amounts: tuple[int, ...]
    race: bool

    @property
    def amount_fiat(self):
        return self.total * FEE

    def status(self, balance):
        if balance < self.amount_fiat * LOWER:
            return "PARTIAL"
        return "PAID" if balance < self.amount_fiat * UPPER else "OVERPAID"

    def transactions(self, number):
        return [shkeeper.transaction(
            f"tx-{number}-{n}", (Decimal(amount) / BTC_IN_USD).quantize(Decimal("1e-8")),
            amount, date=f"2026-11-20 09:{n:02d}:00") for n, amount in enumerate(self.amounts)]

    def callbacks(self, number):
        """One callback per transaction, each listing the transactions so far with the
        balance SHKeeper counts then; in a race the last two list every transaction and
        count all but the last (one event: the same state of the invoice)."""
        transactions = self.transactions(number)
        count = len(transactions)
        sent = [self.callback(number, transactions[:n], n, n - 1)
                for n in range(1, count - 1 if self.race else count + 1)]
        if self.race:
            sent += [self.callback(number, transactions, count - 1, trigger)
                     for trigger in (count - 2, count - 1)]
        return sent

    def callback(self, number, listed, counted, trigger):
        transactions = [{**t, "trigger": n == trigger} for n, t in enumerate(listed)]
        fiat = sum((Decimal(t["amount_fiat"]) for t in listed[:counted]), Decimal(0))
        coins = sum((Decimal(t["amount_crypto"]) for t in listed[:counted]), Decimal(0))
        over = fiat - self.amount_fiat * UPPER
        return shkeeper.invoice(number, self.status(fiat), transactions, coins, fiat,
                                overpaid_fiat=f"{over:.2f}" if over > 0 else "0.00")


@st.composite
def invoices(draw):
    total = draw(st.integers(min_value=50, max_value=500))
    amounts = draw(st.lists(st.integers(min_value=1, max_value=total), min_size=1,
                            max_size=4))
    race = len(amounts) >= 2 and draw(st.booleans())
    invoice = Invoice(total, tuple(amounts), race)
    # In a race nothing was paid before the two came: the listing before them is PARTIAL.
    before = sum(amounts[:-2])
    if race and invoice.status(Decimal(before)) != "PARTIAL":
        invoice = dataclasses.replace(invoice, race=False)
    return invoice


def expected(invoice, number, with_total):
    """What the final listing alone gives: (ledger, order's amount or None, job or None,
    the mails' subjects)."""
    final = invoice.callbacks(number)[-1]
    status, listed = final["status"], final["transactions"]
    net = sum((Decimal(t["amount_fiat"]) - Decimal(t["fee_fiat"]) for t in listed),
              Decimal(0))
    gross = sum((Decimal(t["amount_fiat"]) for t in listed), Decimal(0))
    cents = [int((Decimal(t["amount_fiat"]) * 100).to_integral_value(decimal.ROUND_HALF_UP))
             for t in listed]
    mails = []
    if status == "PARTIAL":
        if (net >= invoice.total * LOWER) if with_total else gross > Decimal(
                final["balance_fiat"]):
            mails.append(f"Crypto invoice for order {number} is paid, SHKeeper says PARTIAL")
        return [], None, None, mails
    ledger = [(t["txid"], Decimal(t["amount_crypto"]), c, status)
              for t, c in zip(listed, cents)]
    if with_total:
        share = (net - invoice.total) / invoice.total * 100
    else:
        balance, over = Decimal(final["balance_fiat"]), Decimal(final["overpaid_fiat"])
        share = over / (balance - over) * 100 if over > 0 else Decimal(0)
    if abs(share) > 5:
        way = "overpaid" if share > 0 else "underpaid"
        # Its share is the first listing's that crossed the tolerance (the mail goes once;
        # the amount's alert tells what came after): the way is the final listing's.
        mails.append(f"Crypto invoice for order {number} {way} by")
    job = (Decimal(final["balance_crypto"]),
           int((Decimal(final["balance_fiat"]) * 100).to_integral_value(decimal.ROUND_HALF_UP)),
           f"crypto-settle:{number}:{listed[0]['txid']}")
    return sorted(ledger), sum(cents), job, mails


deliveries = st.tuples(
    st.permutations(range(4)),
    st.lists(st.integers(min_value=0, max_value=3), max_size=3),  # copies, anywhere
    st.lists(st.integers(min_value=0, max_value=3), max_size=2),  # late copies, at the end
    st.integers(min_value=0, max_value=8),                         # when the order is created
    st.sets(st.integers(min_value=0, max_value=9), max_size=4),    # sent with the database down
    st.sets(st.integers(min_value=0, max_value=9), max_size=2))    # the spool drained before


@hypothesis_settings(max_examples=80, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])
@given(invoice=invoices(), delivery=deliveries, with_total=st.booleans(), data=st.data())
def test_any_delivery_of_an_invoices_callbacks_gives_what_its_final_listing_says(
        io_loop, post, ctx, db, clock, smtp, telegram, invoice, delivery, with_total, data):
    number = f"CA-L{next(_example)}"
    order, copies, late, created_after, down, drained_before = delivery
    sent = invoice.callbacks(number)
    ordering = [n for n in order if n < len(sent)]
    for copy in copies:
        if copy < len(sent):
            ordering.insert(data.draw(st.integers(0, len(ordering))), copy)
    ordering += [copy for copy in late if copy < len(sent)]

    async def run():
        clock.set(2026, 11, 20, 10, 0)
        for place, n in enumerate(ordering):
            if place in drained_before:
                await inbox.drain_spool(ctx)
            if place == created_after:
                CrtcOrder.create(order_number=number,
                                 total_cents=invoice.total * 100 if with_total else None)
            clock.advance(seconds=61)
            with database_down(db) if place in down else contextlib.nullcontext():
                await send(post, ctx, clock, sent[n])
        await inbox.drain_spool(ctx)
        if created_after >= len(ordering):
            CrtcOrder.create(order_number=number,
                             total_cents=invoice.total * 100 if with_total else None)
        for _ in range(6):
            clock.advance(hours=6)
            if not await inbox.retry_due(ctx):
                break
        await ctx.drain_background()
    io_loop.run_sync(run)

    ledger, amount, job, mails = expected(invoice, number, with_total)
    shown = (invoice, ordering, created_after, with_total, sorted(down), sorted(drained_before))
    assert ledger_of(number) == ledger, shown
    # Every time is SHKeeper's, whenever the callback was handled.
    dates = {t["txid"]: t["date"] for t in invoice.transactions(number)}
    assert {entry.provider_ref: shkeeper_time(entry.acquired_at)
            for entry in LedgerEntry.select().where(LedgerEntry.order_id == number)} == {
        txid: dates[txid] for txid, *_ in ledger}, shown
    saved = CrtcOrder.get(CrtcOrder.order_number == number)
    jobs = [(j.amount_coin, j.amount_fiat_cents, j.idempotency_key)
            for j in TreasuryJob.select().where(TreasuryJob.order_id == number)]
    told = alerts(telegram, number)
    if amount is None:
        assert (saved.payment_status, saved.payment_amount, jobs, told) == (
            "pending_payment", None, [], []), shown
    else:
        assert (saved.payment_status, saved.payment_amount) == ("paid", amount), shown
        assert shkeeper_time(saved.paid_at) in dates.values(), shown
        assert jobs == [job], shown
        assert len([t for t in told if " is now " not in t]) == 1, (told, shown)
        assert shkeeper.told_amount(told) == f"${Decimal(amount) / 100:.2f}", (told, shown)
    assert sorted(subject.split(" %")[0].rsplit(" ", 1)[0] if " by " in subject else subject
                  for subject in subjects(smtp, number)) == sorted(mails), shown
    assert not WebhookEvent.select().where(WebhookEvent.order_number == number,
                                           WebhookEvent.status.in_(["received", "failed"])
                                           ).exists(), shown
