"""BEHAVIOUR.md 2.5 and 4.3 rule 12: a crypto payment's times are SHKeeper's. Each ledger
entry is acquired when SHKeeper stored its transaction (the transaction's `date`, UTC as
SHKeeper writes it), the order is paid when SHKeeper stored the newest transaction of the
callback that completed it, however late the callback is handled: spooled through a
database cut or tried again once its order exists. Without a date SHKeeper wrote, the
time is the callback's arrival, never its handling.

Callbacks as SHKeeper sends them (tests/shkeeper.py) over loopback; the clock is the
test's."""
import dataclasses
import datetime
import re

import pytest

from models import UTC, CrtcOrder, FormationOrder, LedgerEntry, WebhookEvent
from domain import settlement
from engine import inbox
from engine.transaction import Transaction
from tests import shkeeper
from tests.console_helpers import (  # noqa: F401 (fixtures)
    console_settings, logged_in, operator, text,
)
from tests.door import through_the_door
from tests.service_process import database_down
from tests.shkeeper import API_KEY, URL, key_headers

# SHKeeper's dates of the three transactions of shkeeper.paid_in_steps, on Friday 20
# November 2026, as aware UTC.
STORED = {"tx-step-1": datetime.datetime(2026, 11, 20, 9, 0, 12, tzinfo=UTC),
          "tx-step-2": datetime.datetime(2026, 11, 20, 9, 41, 37, tzinfo=UTC),
          "tx-step-3": datetime.datetime(2026, 11, 20, 10, 15, 4, tzinfo=UTC)}
# SHKeeper sends a transaction's callback a minute or more after it stored it (its
# NOTIFICATION_TASK_DELAY); the callbacks reach us then.
ARRIVALS = {"PAID": datetime.datetime(2026, 11, 20, 9, 42, 40, tzinfo=UTC),
            "OVERPAID": datetime.datetime(2026, 11, 20, 10, 16, 9, tzinfo=UTC)}
MONDAY = datetime.datetime(2026, 11, 23, 8, 0, tzinfo=UTC)
# A row of the order page's timeline: (when, what).
ROW = re.compile(r'When: </span>([^<]*)</td><td class="status"><span class="cell-label">'
                 r'What: </span>([^<]*)</td>')


@pytest.fixture
def settings(settings):
    return dataclasses.replace(console_settings(settings), crypto_processor_api_key=API_KEY)


async def send(post, callback):
    status, reply, _ = await post(URL, callback, key_headers())
    assert status == 202 and reply in ({"received": True},
                                       {"received": True, "error": "internal"})


def statuses(number):
    return [event.status for event in WebhookEvent.select()
            .where(WebhookEvent.order_number == number).order_by(WebhookEvent.id)]


def acquired(number):
    return {entry.provider_ref: entry.acquired_at
            for entry in LedgerEntry.select().where(LedgerEntry.order_id == number)}


async def handled(post, ctx, db, clock, how, number, callbacks):
    """Each callback reaches us at its arrival (ARRIVALS, by its status) and is handled
    then (`at once`), or on Monday: spooled while the database is cut off and moved into
    the inbox then, or tried again then, once its order is stored."""
    if how != "retried":
        FormationOrder.create(order_number=number)
    for callback in callbacks:
        clock.fixed = ARRIVALS[callback["status"]]
        if how == "spooled":
            with database_down(db):
                await send(post, callback)
        else:
            await send(post, callback)
    clock.fixed = MONDAY
    if how == "spooled":
        assert await inbox.drain_spool(ctx) == len(callbacks)
    elif how == "retried":
        assert "processed" not in statuses(number)
        FormationOrder.create(order_number=number)
        await inbox.retry_due(ctx)
    await ctx.drain_background()
    assert statuses(number) == ["processed"] * len(callbacks)


@pytest.mark.gen_test
async def test_a_callback_handled_days_later_records_shkeepers_dates(post, clock):
    """PAID and OVERPAID reach us on Monday for transactions SHKeeper stored on Friday:
    each entry is acquired at its transaction's date, the order paid at the date of the
    transaction that paid it, and OVERPAID's later transaction does not move it."""
    clock.fixed = MONDAY
    FormationOrder.create(order_number="FO-1")
    _, paid, overpaid = shkeeper.paid_in_steps("FO-1")
    await send(post, paid)
    assert acquired("FO-1") == {txid: STORED[txid] for txid in ("tx-step-1", "tx-step-2")}
    assert FormationOrder.get().paid_at == STORED["tx-step-2"]

    clock.advance(hours=3)
    await send(post, overpaid)
    # tx-step-1 and tx-step-2, re-saved by the longer listing, keep SHKeeper's time.
    assert acquired("FO-1") == STORED
    order = FormationOrder.get()
    assert (order.paid_at, order.payment_amount) == (STORED["tx-step-2"], 37440)


@pytest.mark.parametrize("how", ["spooled", "retried"])
@pytest.mark.gen_test
async def test_late_handling_records_the_times_handling_at_once_does(
        post, ctx, db, clock, how):
    """The same two callbacks, handled as they arrive for FO-1 and on Monday for FO-2,
    leave the same times."""
    await handled(post, ctx, db, clock, "at once", "FO-1",
                  shkeeper.paid_in_steps("FO-1")[1:])
    await handled(post, ctx, db, clock, how, "FO-2", shkeeper.paid_in_steps("FO-2")[1:])
    assert acquired("FO-2") == acquired("FO-1") == STORED
    paid_at = {order.order_number: order.paid_at for order in FormationOrder.select()}
    assert paid_at == {"FO-1": STORED["tx-step-2"], "FO-2": STORED["tx-step-2"]}


@pytest.mark.parametrize("how", ["spooled", "retried"])
@pytest.mark.gen_test
async def test_a_callback_listing_no_transaction_is_of_its_arrival(post, ctx, db, clock, how):
    """The fallback entry and the payment take the time the callback reached us, not the
    Monday it was handled."""
    callback = {**shkeeper.paid_in_steps("FO-3")[1], "transactions": []}
    await handled(post, ctx, db, clock, how, "FO-3", [callback])
    [entry] = LedgerEntry.select()
    assert (entry.fallback, entry.acquired_at) == (True, ARRIVALS["PAID"])
    assert FormationOrder.get().paid_at == ARRIVALS["PAID"]


@pytest.mark.parametrize("date,stored", [
    ("2026-11-20 09:41:37.250000", STORED["tx-step-2"].replace(microsecond=250000)),
    ("", None),
    ("2026-11-20T09:41:37+00:00", None),
    ("2026-11-20T09:41:37", None),
    ("2026-11-20", None),
    ("20/11/2026 09:41:37", None),
    ("2026-11-31 09:41:37", None),
    ("2026-11-20 9:41:37", None),
    ("1795167697", None),
    # Later than the callback reached us: SHKeeper's clock was ahead of ours.
    ("2026-11-20 09:50:00", None),
], ids=["microseconds", "empty", "iso-with-offset", "iso-t", "day-only", "day-first",
        "no-such-day", "one-digit-hour", "epoch", "after-arrival"])
@pytest.mark.gen_test
async def test_a_date_not_as_shkeeper_writes_it_is_the_callbacks_arrival(
        post, ctx, db, clock, date, stored):
    """Only SHKeeper's own form (`YYYY-MM-DD HH:MM:SS[.ffffff]`, UTC) is read as its
    time: anything else, or a date after the callback's arrival, gives that arrival."""
    first, second = shkeeper.paid_in_steps("FO-4")[1]["transactions"]
    callback = {**shkeeper.paid_in_steps("FO-4")[1],
                "transactions": [first, {**second, "date": date}]}
    await handled(post, ctx, db, clock, "retried", "FO-4", [callback])
    expected = stored or ARRIVALS["PAID"]
    assert acquired("FO-4") == {"tx-step-1": STORED["tx-step-1"], "tx-step-2": expected}
    assert FormationOrder.get().paid_at == expected


@pytest.mark.gen_test(timeout=60)
async def test_the_order_page_shows_a_crypto_payment_on_shkeepers_friday(
        post, ctx, db, clock, logged_in):
    """A CRTC invoice paid late on Friday, its callback spooled through a cut and handled
    on Monday: the order's timeline says paid on Friday, before the callback reached us.
    Settlement's business days do not count for it: crypto orders are not among those
    awaiting funds (their coins go through the treasury job)."""
    CrtcOrder.create(order_number="CA-7")
    transaction = shkeeper.transaction("tx-late-1", "0.0034", "326.4", trigger=True,
                                       date="2026-11-20 23:58:30")
    callback = shkeeper.invoice("CA-7", "PAID", [transaction], "0.0034", "326.4")
    clock.fixed = datetime.datetime(2026, 11, 20, 23, 59, 40, tzinfo=UTC)
    with database_down(db):
        await send(post, callback)
    clock.fixed = MONDAY
    assert await inbox.drain_spool(ctx) == 1

    order = CrtcOrder.get()
    assert (order.payment_method, order.paid_at) == (
        "crypto", datetime.datetime(2026, 11, 20, 23, 58, 30, tzinfo=UTC))
    # A card payment of the same Friday awaits its funds; the crypto one does not.
    CrtcOrder.create(order_number="CA-8", payment_status="paid", payment_method="card",
                     paid_at=order.paid_at)
    assert [waiting.order_number for waiting in through_the_door(
        settlement.waiting_orders, Transaction(ctx))] == ["CA-8"]
    rows = ROW.findall(text(await logged_in.get("/console/orders/CA-7")))
    assert ("2026-11-20 23:58:30", "ledger entry") in rows
    assert rows.index(("2026-11-20 23:58:30", "paid")) < rows.index(
        ("2026-11-20 23:59:40", "crypto event PAID")) < rows.index(
        ("2026-11-23 08:00:00", "treasury job"))
