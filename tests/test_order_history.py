"""An order is a record with a history (docs/ORDERS.md, "An order's history"): every change
of an order, by the orders API, an import, a webhook's handling or a scheduled job, is kept
with who made it, when, and each field's old and new values; a paid order's amounts are
changed only by a call that says it means it; the console's timeline shows the changes
and the order as it was created."""
import dataclasses
import datetime
import json
import logging
import urllib.parse

import pytest

from domain import orders
from engine.transaction import Transaction
from models import UTC, CrtcOrder, FormationOrder, OrderChange, WebhookEvent
from tests import shkeeper
from tests.console_helpers import (  # noqa: F401 (fixtures)
    Operator, console_settings, logged_in, operator, text,
)
from tests.door import through_the_door
from tests.test_cli import run

KEY = "orders-api-key-for-the-tests-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
NOW = datetime.datetime(2026, 11, 20, 9, 0, tzinfo=UTC)
FAY = {"customer_email": "fay@example.com", "customer_name": "Fay Radio Ltd",
       "service_name": "CRTC registration", "total_cents": 12900, "currency": "CAD"}


@pytest.fixture
def settings(settings):
    return dataclasses.replace(console_settings(settings), orders_api_key=KEY,
                               crypto_processor_api_key=shkeeper.API_KEY)


@pytest.fixture
def put(post):
    async def send(kind, number, body, query=""):
        path = f"/api/v1/orders/{kind}/{urllib.parse.quote(number, safe='')}{query}"
        return await post(path, body, AUTH, method="PUT")
    return send


def history(number="CA-0042"):
    return [(row.field, json.loads(row.old_value or "null"), json.loads(row.new_value),
             row.changed_by, row.event_id)
            for row in OrderChange.select().where(OrderChange.order_number == number)
            .order_by(OrderChange.id)]


async def paid_in_cad(client, base_url, number="CA-0042"):
    """SHKeeper's callback paying the order 129.00 CAD, handled as it arrives."""
    callback = shkeeper.paid(number, balance_fiat="129.00", fiat="CAD")
    response = await client.fetch(base_url + shkeeper.URL, method="POST",
                                  body=shkeeper.encode(callback),
                                  headers=shkeeper.key_headers())
    assert response.code == 202
    order = CrtcOrder.get(CrtcOrder.order_number == number)
    assert order.payment_status == "paid"
    assert (order.payment_amount, order.payment_currency) == (12900, "CAD")
    return WebhookEvent.get(WebhookEvent.order_number == number)


@pytest.mark.gen_test
async def test_a_paid_order_s_amounts_are_refused_409_naming_the_field(
        put, clock, client, base_url, telegram):
    clock.fixed = NOW
    assert (await put("canada_crtc", "CA-0042", FAY))[0] == 201
    await paid_in_cad(client, base_url)
    recorded = history()

    for body, field in (({"total_cents": 99999, "currency": "USD"}, "total_cents"),
                        ({"currency": "USD"}, "currency"),
                        ({"amb_annual_price_cents": 5000}, "amb_annual_price_cents"),
                        ({"customer_name": "Fay", "total_cents": 1}, "total_cents")):
        status, reply, _ = await put("canada_crtc", "CA-0042", body)
        assert (status, reply["field"]) == (409, field), reply
        assert reply["error"].startswith("order CA-0042 is paid (CAD 129.00 received): "
                                         f"{field} stays "), reply
        assert "?amend_paid=1" in reply["error"]
        # Nothing written, not even the row's other fields.
        order = CrtcOrder.get()
        assert (order.total_cents, order.currency, order.customer_name) == (
            12900, "CAD", "Fay Radio Ltd")
        assert history() == recorded

    # The same amounts again, and a field that is not money, are taken as before.
    status, reply, _ = await put("canada_crtc", "CA-0042", {**FAY, "customer_name": "Fay R."})
    assert (status, reply["outcome"]) == (200, "updated")
    assert reply["changed"] == {"customer_name": {"old": "Fay Radio Ltd", "new": "Fay R."}}


@pytest.mark.gen_test
async def test_an_order_not_paid_changes_its_amounts_without_being_asked_twice(put, clock):
    clock.fixed = NOW
    await put("canada_crtc", "CA-0042", FAY)
    status, reply, _ = await put("canada_crtc", "CA-0042", {"total_cents": 99999,
                                                            "currency": "USD"})
    assert (status, reply["outcome"]) == (200, "updated")
    assert reply["changed"] == {"total_cents": {"old": 12900, "new": 99999},
                                "currency": {"old": "CAD", "new": "USD"}}


@pytest.mark.gen_test
async def test_amend_paid_changes_a_paid_order_and_its_history_and_log_say_so(
        put, clock, client, base_url, telegram, caplog):
    clock.fixed = NOW
    await put("canada_crtc", "CA-0042", FAY)
    event = await paid_in_cad(client, base_url)
    clock.fixed = later = NOW + datetime.timedelta(hours=2)
    caplog.set_level(logging.INFO, logger="receiver.orders")
    status, reply, _ = await put("canada_crtc", "CA-0042",
                                 {"total_cents": 99999, "currency": "USD"}, "?amend_paid=1")
    assert (status, reply["outcome"]) == (200, "updated")
    assert reply["shop"]["total_cents"] == 99999 and reply["shop"]["currency"] == "USD"
    assert reply["changed"] == {"total_cents": {"old": 12900, "new": 99999},
                                "currency": {"old": "CAD", "new": "USD"}}

    api = "orders API from 127.0.0.1"
    entries = history()
    assert entries[0] == ("order", None, {**FAY, "amb_annual_price_cents": None,
                                          "discount_code": None, "parent_order_number": None},
                          api, None)
    # The payment's changes, by its event.
    by_event = {field: (old, new) for field, old, new, by, event_id in entries
                if event_id == event.id}
    assert by_event["payment_status"] == ("pending_payment", "paid")
    assert by_event["payment_amount"] == (None, 12900)
    assert {by for _, _, _, by, event_id in entries if event_id == event.id} == {
        f"event #{event.id} (crypto PAID)"}
    assert entries[-2:] == [("currency", "CAD", "USD", api, None),
                            ("total_cents", 12900, 99999, api, None)]
    assert {row.changed_at for row in OrderChange.select().where(
        OrderChange.field == "total_cents")} == {later}

    [line] = [record for record in caplog.records if "through the orders API" in
              record.getMessage() and "updated" in record.getMessage()]
    assert line.levelname == "WARNING"
    assert line.getMessage() == (
        'canada_crtc order CA-0042 updated through the orders API: total_cents 12900 -> '
        '99999, currency "CAD" -> "USD" (a paid order\'s amounts, as the call said it '
        'meant: amend_paid)')


@pytest.mark.parametrize("query", ["?amend_paid=yes", "?amend_paid=2"])
@pytest.mark.gen_test
async def test_an_amend_paid_that_is_not_1_or_0_is_400_naming_it(put, query):
    status, reply, _ = await put("canada_crtc", "CA-0042", FAY, query)
    assert (status, reply["field"]) == (400, "amend_paid")
    assert CrtcOrder.select().count() == 0


@pytest.mark.gen_test
async def test_a_put_that_changes_nothing_says_so_and_records_nothing(put, clock):
    clock.fixed = NOW
    await put("formation", "FO-1", {"customer_name": "Ana"})
    clock.fixed = NOW + datetime.timedelta(minutes=5)
    status, reply, _ = await put("formation", "FO-1", {"customer_name": " Ana "})
    assert (status, reply["outcome"], reply["changed"]) == (200, "unchanged", {})
    assert reply["updated_at"] == NOW.isoformat()
    assert [field for field, *_ in history("FO-1")] == ["order"]


def test_a_workflow_document_name_and_a_job_s_changes_are_recorded_by_who_made_them(ctx,
                                                                                   clock):
    clock.fixed = NOW
    FormationOrder.create(order_number="FO-1", order_name="FORM-1")
    tx = Transaction(ctx, by="the holdback job")
    assert through_the_door(orders.remember_order_name, ctx, tx, "FO-1", "FORM-2")
    order = through_the_door(tx.lock_order, "formation", "FO-1")
    order.append_note("looked at")
    order.customer_name = "set back"
    order.customer_name = None  # set back to what it was: no change
    through_the_door(tx.save, order)
    assert history("FO-1") == [("order_name", "FORM-1", "FORM-2", "the holdback job", None),
                               ("notes", "", "looked at", "the holdback job", None)]
    assert FormationOrder.get().notes == "looked at"


# --- the import ---------------------------------------------------------------------------

def write(tmp_path, text):
    path = tmp_path / "orders.csv"
    path.write_text(text, encoding="utf-8")
    return str(path)


CSV = ("kind,order_number,customer_name,total_cents,currency\n"
       "canada_crtc,CA-0042,Fay Radio Ltd,99999,USD\n"
       "canada_crtc,CA-0043,Gus Radio,500,CAD\n"
       "canada_crtc,CA-0044,Hal Radio,700,CAD\n")


@pytest.mark.gen_test
async def test_an_import_refuses_a_paid_order_s_amounts_by_line_and_keeps_the_others(
        put, clock, client, base_url, telegram, tmp_path, database_url):
    clock.fixed = NOW
    await put("canada_crtc", "CA-0042", FAY)
    await put("canada_crtc", "CA-0044", {"total_cents": 600, "currency": "CAD"})
    await paid_in_cad(client, base_url)
    path = write(tmp_path, CSV)

    refused = run(database_url, "orders", "import", path)
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        'line 2: order CA-0042 is paid (CAD 129.00 received): total_cents stays 12900 '
        '(asked 99999); currency stays "CAD" (asked "USD"); --amend-paid changes a paid '
        "order's total_cents, amb_annual_price_cents, currency"]
    assert refused.stdout == "3 row(s): 1 created, 1 updated, 0 unchanged, 1 bad\n"
    fay = CrtcOrder.get(CrtcOrder.order_number == "CA-0042")
    assert (fay.total_cents, fay.currency) == (12900, "CAD")
    assert CrtcOrder.get(CrtcOrder.order_number == "CA-0043").total_cents == 500
    assert history("CA-0044")[-1] == ("total_cents", 600, 700, f"import {path} line 4", None)
    assert history("CA-0043")[0][3] == f"import {path} line 3"

    amended = run(database_url, "orders", "import", "--amend-paid", path)
    assert (amended.returncode, amended.stderr) == (0, "")
    assert amended.stdout.splitlines() == [
        'line 2: order CA-0042 is paid; changed as asked: total_cents 12900 -> 99999, '
        'currency "CAD" -> "USD"',
        "3 row(s): 0 created, 1 updated, 2 unchanged, 0 bad"]
    fay = CrtcOrder.get(CrtcOrder.order_number == "CA-0042")
    assert (fay.total_cents, fay.currency, fay.customer_name) == (99999, "USD", "Fay Radio Ltd")
    assert history()[-2:] == [("currency", "CAD", "USD", f"import {path} line 2", None),
                              ("total_cents", 12900, 99999, f"import {path} line 2", None)]


# --- the console ----------------------------------------------------------------------------

def changed_line(field, detail):
    """A field's line under a change on the timeline, as the page's HTML has it."""
    return (f'<span class="cell-label">What: </span>{field}</td><td class="error">'
            f'<span class="cell-label">Detail: </span>{detail}</td>')


@pytest.mark.gen_test(timeout=60)
async def test_the_timeline_shows_each_change_and_the_order_as_it_was_created(
        put, clock, client, base_url, telegram, logged_in):
    clock.fixed = NOW
    await put("canada_crtc", "CA-0042", FAY)
    event = await paid_in_cad(client, base_url)
    clock.fixed = NOW + datetime.timedelta(hours=2)
    await put("canada_crtc", "CA-0042", {"total_cents": 99999, "currency": "USD"},
              "?amend_paid=1")

    page = text(await logged_in.get("/console/orders/CA-0042"))
    facts, timeline = page.split("Timeline")
    assert '<dd id="amount-paid">CAD 129.00</dd>' in facts
    assert '<dd id="order-total">$999.99</dd>' in facts
    created = ("canada_crtc order created by orders API from 127.0.0.1</td>"
               '<td class="error"><span class="cell-label">Detail: </span>Fay Radio Ltd, '
               "&lt;fay@example.com&gt;, CRTC registration, CAD 129.00")
    assert created in timeline
    assert "999.99" not in timeline.split("order changed by orders API")[0]
    assert "order changed by orders API from 127.0.0.1" in timeline
    assert changed_line("currency", "CAD -&gt; USD") in timeline
    assert changed_line("total_cents", "12900 -&gt; 99999") in timeline
    assert f"order changed by event #{event.id} (crypto PAID)" in timeline
    assert changed_line("payment_status", "pending_payment -&gt; paid") in timeline
    # In time order: created, paid (by the event), changed by the API.
    assert (timeline.index("order created") < timeline.index(f"by event #{event.id}")
            < timeline.index("changed by orders API"))


@pytest.mark.gen_test(timeout=60)
async def test_an_order_from_before_its_history_was_kept_is_shown_as_created_from_its_changes(
        logged_in, ctx, clock):
    """An order inserted by the shop itself has no creation row: the timeline's created
    line is its columns now with each recorded change undone."""
    clock.fixed = NOW
    CrtcOrder.create(order_number="CA-7", customer_name="Rae Radio", total_cents=780,
                     currency="CAD", created_at=NOW)
    tx = Transaction(ctx, by="an operator's test")
    order = through_the_door(tx.lock_order, "canada_crtc", "CA-7")
    order.total_cents, order.customer_name = 5000, "Rae R."
    through_the_door(tx.save, order)
    page = text(await logged_in.get("/console/orders/CA-7"))
    assert "Rae Radio, CAD 7.80" in page
    assert "customer_name, total_cents" in page
    assert changed_line("customer_name", "Rae Radio -&gt; Rae R.") in page
    assert changed_line("total_cents", "780 -&gt; 5000") in page
    assert '<dd id="amount-paid">-</dd>' in page
