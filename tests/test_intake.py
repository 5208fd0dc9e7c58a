"""Orders in (docs/ORDERS.md): the orders API (`PUT`/`GET /api/v1/orders/<kind>/<number>`)
and `receiver.py orders import FILE`, one contract: the shop's fields are set, the
service's refused by name, every call idempotent; and the calls waiting for an order not
there yet are made due the moment it arrives."""
import asyncio
import dataclasses
import datetime
import functools
import json
import os
import re
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from domain import intake
from engine import claims, inbox
from engine.transaction import Transaction
from models import (
    ORDER_MODELS, UTC, BundleOrder, ComplianceOrder, CrtcOrder, FormationOrder, OrderChange,
    WebhookEvent,
)
from tests import shkeeper
from tests.door import through_the_door
from tests.ops_helpers import ROOT, Service
from tests.terminal import OnATerminal
from tests.test_cli import cli_env, run

KEY = "orders-api-key-for-the-tests-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
NOW = datetime.datetime(2026, 11, 20, 9, 0, tzinfo=UTC)
# An order number of each kind, with its kind's prefix.
PREFIX = {"formation": "FO-", "compliance": "CO-", "bundle": "BU-", "canada_crtc": "CA-"}


@pytest.fixture
def settings(settings):
    return dataclasses.replace(settings, orders_api_key=KEY,
                               crypto_processor_api_key=shkeeper.API_KEY)


@pytest.fixture
def put(post):
    """PUT (or another method) to the orders API; returns (status, parsed body, response)."""
    async def send(kind, number, body, headers=AUTH, method="PUT"):
        path = f"/api/v1/orders/{kind}/{urllib.parse.quote(number, safe='')}"
        return await post(path, body, headers, method=method)
    return send


def rows():
    return {(kind, order.order_number) for kind, model in ORDER_MODELS.items()
            for order in model.select()}


# --- the API -------------------------------------------------------------------------------

@pytest.mark.gen_test
async def test_a_put_creates_the_order_and_the_same_put_again_changes_nothing(put, clock):
    clock.fixed = NOW
    body = {"customer_email": "fay@example.com", "customer_name": "Fay Radio Ltd",
            "service_name": "CRTC registration", "total_cents": 12900, "currency": "cad",
            "discount_code": "FALL26"}
    status, created, response = await put("canada_crtc", "CA-0042", body)
    assert status == 201 and response.headers["Location"] == "/api/v1/orders/canada_crtc/CA-0042"
    assert created["kind"] == "canada_crtc" and created["order_number"] == "CA-0042"
    assert created["shop"] == {**body, "currency": "CAD", "parent_order_number": None,
                               "amb_annual_price_cents": None}
    assert created["service"]["payment_status"] == "pending_payment"
    assert created["service"]["funds_available"] is False
    assert created["created_at"] == NOW.isoformat()
    order = CrtcOrder.get(CrtcOrder.order_number == "CA-0042")
    assert (order.total_cents, order.currency, order.payment_status) == (12900, "CAD",
                                                                         "pending_payment")

    assert (created["outcome"], created["changed"]) == ("created", {})

    # The same PUT again says that it changed nothing, and records nothing.
    clock.fixed = NOW + datetime.timedelta(hours=1)
    status, again, response = await put("canada_crtc", "CA-0042", body)
    assert status == 200 and "Location" not in response.headers
    assert again == {**created, "outcome": "unchanged"}
    status, got, _ = await put("canada_crtc", "CA-0042", None, method="GET")
    described = {name: value for name, value in created.items()
                 if name not in ("outcome", "changed")}
    assert (status, got) == (200, described)
    assert rows() == {("canada_crtc", "CA-0042")}
    assert [row.field for row in OrderChange.select()] == ["order"]


@pytest.mark.gen_test
async def test_a_put_sets_the_fields_it_names_and_null_or_empty_clears_one(put, clock):
    clock.fixed = NOW
    await put("compliance", "CO-7", {"customer_email": "a@example.com", "service_slug": "ifta",
                                     "customer_name": "Ada"})
    clock.fixed = NOW + datetime.timedelta(minutes=5)
    status, order, _ = await put("compliance", "CO-7", {"service_slug": "ucr",
                                                        "customer_name": None,
                                                        "customer_email": " "})
    assert status == 200
    assert order["shop"]["service_slug"] == "ucr" and order["shop"]["customer_name"] is None
    assert order["shop"]["customer_email"] is None
    assert order["updated_at"] == (NOW + datetime.timedelta(minutes=5)).isoformat()
    stored = ComplianceOrder.get(ComplianceOrder.order_number == "CO-7")
    assert (stored.service_slug, stored.customer_name, stored.customer_email) == ("ucr", None,
                                                                                  None)


SERVICE_OWNED = [(kind, field) for kind in intake.KINDS for field in intake.service_fields(kind)]


@pytest.mark.parametrize("kind,field", SERVICE_OWNED)
@pytest.mark.gen_test
async def test_a_field_the_service_owns_is_refused_by_name_and_nothing_is_written(
        put, kind, field):
    first, second = f"{PREFIX[kind]}1", f"{PREFIX[kind]}2"
    ORDER_MODELS[kind].create(order_number=first)
    before = {name: getattr(ORDER_MODELS[kind].get(), name) for name in intake.service_fields(kind)}
    status, reply, _ = await put(kind, first, {"customer_name": "Changed", field: "paid"})
    assert status == 400 and reply["field"] == field
    assert reply["error"].startswith(f"{field} is the service's to set, not the shop's")
    after = ORDER_MODELS[kind].get()
    assert after.customer_name is None
    assert {name: getattr(after, name) for name in intake.service_fields(kind)} == before
    status, reply, _ = await put(kind, second, {field: None})
    assert (status, reply["field"]) == (400, field) and rows() == {(kind, first)}


@pytest.mark.parametrize("kind,body,field,says", [
    ("formation", {"nickname": "x"}, "nickname", "unknown field: nickname"),
    ("formation", {"service_slug": "ifta"}, "service_slug",
     "service_slug is not a field of formation orders"),
    ("compliance", {"total_cents": 5}, "total_cents",
     "total_cents is not a field of compliance orders"),
    ("formation", {"id": 7}, "id", "id is the service's to set"),
    ("formation", {"created_at": "2026-01-01"}, "created_at", "created_at is the service's"),
    ("formation", {"order_number": "FO-2"}, "order_number",
     'order_number is "FO-1" (the path\'s), not "FO-2"'),
    ("formation", {"kind": "bundle"}, "kind", 'kind is "formation" (the path\'s), not "bundle"'),
    ("formation", {"customer_email": "not an address"}, "customer_email",
     "customer_email must be an e-mail address"),
    ("formation", {"customer_name": 7}, "customer_name", "customer_name must be text or null"),
    ("formation", {"customer_name": "A\x00B"}, "customer_name",
     "customer_name must not hold control characters"),
    ("formation", {"service_name": "x" * 256}, "service_name",
     "service_name is longer than 255 characters"),
    ("formation", {"parent_order_number": "FO-1"}, "parent_order_number",
     "parent_order_number must not be the order's own number"),
    ("formation", {"parent_order_number": "FO 1"}, "parent_order_number",
     "parent_order_number must be 1 to 255 ASCII letters and digits"),
    ("canada_crtc", {"total_cents": 7.8}, "total_cents",
     "total_cents must be a whole number of cents (the currency's minor units), 0 or more, "
     "got 7.8"),
    ("canada_crtc", {"total_cents": True}, "total_cents", "total_cents must be a whole number"),
    ("canada_crtc", {"total_cents": -1}, "total_cents", "total_cents must be a whole number"),
    ("canada_crtc", {"total_cents": "780"}, "total_cents", "total_cents must be a whole number"),
    ("canada_crtc", {"amb_annual_price_cents": 2 ** 63}, "amb_annual_price_cents",
     "amb_annual_price_cents must be a whole number"),
    ("canada_crtc", {"currency": "dollars"}, "currency",
     "currency must be an ISO 4217 code such as USD or CAD"),
])
@pytest.mark.gen_test
async def test_a_wrong_field_is_400_naming_it(put, kind, body, field, says):
    number = f"{PREFIX[kind]}1"
    status, reply, _ = await put(kind, number, body)
    assert status == 400 and reply["field"] == field and reply["error"].startswith(says), reply
    assert rows() == set()


@pytest.mark.parametrize("number", ["FO 1", "FO/1", "FO?1", "FO#1", "FO%1", "FO\\1", "F\tO",
                                    "x" * 256])
@pytest.mark.gen_test
async def test_an_order_number_a_path_cannot_carry_is_400(put, number):
    status, reply, _ = await put("formation", number, {})
    assert (status, reply["field"]) == (400, "order_number")
    assert rows() == set()


@pytest.mark.parametrize("body", [b"", b"[]", b"{", b'"text"', b"\xff"])
@pytest.mark.gen_test
async def test_a_body_that_is_not_a_json_object_is_400(put, body):
    status, reply, _ = await put("formation", "FO-1", body)
    assert (status, reply) == (400, {"error": "invalid JSON body"})


@pytest.mark.gen_test
async def test_a_body_over_16_kib_is_413_from_its_headers(put):
    status, reply, _ = await put("formation", "FO-1", {"customer_name": "x" * 17000})
    assert (status, reply) == (413, {"error": "request body too large"})


@pytest.mark.gen_test
async def test_an_unknown_kind_is_404_for_put_and_get(put):
    for method in ("PUT", "GET"):
        status, reply, _ = await put("orders", "FO-1", {}, method=method)
        assert status == 404 and reply["error"].startswith("unknown kind: orders (the kinds: "
                                                           "formation, compliance, bundle, "
                                                           "canada_crtc)")


@pytest.mark.gen_test
async def test_get_of_an_order_not_there_is_404_and_names_its_kind_if_another(put):
    FormationOrder.create(order_number="FO-9")
    assert (await put("bundle", "BU-1", None, method="GET"))[:2] == (
        404, {"error": "no bundle order BU-1"})
    assert (await put("bundle", "FO-9", None, method="GET"))[:2] == (
        404, {"error": "no bundle order FO-9 (it is a formation order)"})


@pytest.mark.gen_test
async def test_one_number_is_one_order_a_put_of_another_kind_is_409(put):
    # A shop writing the tables can give a number another kind's prefix; intake cannot.
    CrtcOrder.create(order_number="BU-1", customer_name="Kept")
    status, reply, _ = await put("bundle", "BU-1", {"customer_name": "Other"})
    assert (status, reply) == (409, {"error": "order BU-1 is a canada_crtc order",
                                     "field": "order_number"})
    assert rows() == {("canada_crtc", "BU-1")} and CrtcOrder.get().customer_name == "Kept"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": f"Bearer {KEY}x"},
                                     {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": KEY}, {"X-Api-Key": KEY}],
                         ids=["none", "wrong", "longer", "basic", "bare", "other-header"])
@pytest.mark.gen_test
async def test_without_the_bearer_key_every_call_is_401_and_nothing_written(put, headers):
    FormationOrder.create(order_number="FO-1", customer_name="Dana")
    for method in ("PUT", "GET"):
        status, reply, response = await put("formation", "FO-1", {"customer_name": "Eve"},
                                            headers=headers, method=method)
        assert (status, reply) == (401, {"error": "Unauthorized"})
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="orders"'
    assert (await put("nowhere", "FO-1", {}, headers=headers))[0] == 401
    assert FormationOrder.get().customer_name == "Dana" and rows() == {("formation", "FO-1")}


@pytest.mark.parametrize("env", ["development", "production"])
@pytest.mark.gen_test
async def test_with_no_key_set_the_api_is_closed_and_the_log_names_the_setting(
        put, ctx, caplog, env):
    ctx.settings = dataclasses.replace(ctx.settings, orders_api_key="", env=env)
    for headers in ({}, {"Authorization": "Bearer "}, AUTH):
        status, reply, _ = await put("formation", "FO-1", {}, headers=headers)
        assert (status, reply) == (401, {"error": "Unauthorized"})
    assert rows() == set()
    assert "orders API: ORDERS_API_KEY is not set: every call is refused" in caplog.text


@pytest.mark.gen_test
async def test_the_key_never_appears_in_the_logs(put, caplog):
    await put("formation", "FO-1", {}, headers={"Authorization": "Bearer guess-0rders-key"})
    await put("formation", "FO-1", {})
    assert "guess-0rders-key" not in caplog.text and KEY not in caplog.text


@pytest.mark.gen_test
async def test_concurrent_puts_of_a_new_order_create_it_once(put):
    replies = await asyncio.gather(*(put("bundle", "BU-7", {"customer_name": "Gus"})
                                     for _ in range(6)))
    assert sorted(status for status, _, _ in replies) == [200] * 5 + [201]
    assert rows() == {("bundle", "BU-7")}


# --- the calls waiting for an order ------------------------------------------------------------

async def crypto_paid(client, base_url, number, txid="tx-paid-1"):
    response = await client.fetch(base_url + shkeeper.URL, method="POST",
                                  body=shkeeper.encode(shkeeper.paid(number, txid=txid)),
                                  headers=shkeeper.key_headers())
    assert response.code == 202


@pytest.mark.gen_test
async def test_a_call_for_an_order_not_there_waits_and_is_due_the_moment_it_arrives(
        put, ctx, clock, client, base_url, telegram):
    clock.fixed = NOW
    await crypto_paid(client, base_url, "CA-9")
    # The second waits behind the first, which failed: an order's calls go in turn.
    await crypto_paid(client, base_url, "CA-9", txid="tx-paid-2")
    event, second = WebhookEvent.select().order_by(WebhookEvent.id)
    assert event.status == "failed" and event.next_attempt_at > NOW
    assert second.status == "received"
    waiting = through_the_door(intake.waiting_calls, Transaction(ctx))
    assert (waiting.calls, waiting.orders, waiting.oldest) == (2, 1, [("CA-9", 2, NOW)])

    clock.fixed = NOW + datetime.timedelta(seconds=5)
    assert (await put("canada_crtc", "CA-9", {"total_cents": 780}))[0] == 201
    event = WebhookEvent.get_by_id(event.id)
    assert event.status == "failed" and event.next_attempt_at == clock.fixed
    assert await inbox.retry_due(ctx) == 2
    assert {e.status for e in WebhookEvent.select()} == {"processed"}
    assert through_the_door(intake.waiting_calls, Transaction(ctx)).calls == 0
    assert CrtcOrder.get().payment_status == "paid"


@pytest.mark.gen_test
async def test_an_update_or_another_order_makes_no_call_due(put, ctx, clock, client, base_url):
    clock.fixed = NOW
    await crypto_paid(client, base_url, "CA-9")
    await put("canada_crtc", "CA-8", {})
    await put("canada_crtc", "CA-8", {"total_cents": 5})
    [event] = WebhookEvent.select()
    assert event.next_attempt_at > NOW
    assert through_the_door(intake.waiting_calls, Transaction(ctx)).oldest == [("CA-9", 1, NOW)]


@pytest.mark.gen_test
async def test_a_child_s_call_waiting_for_its_parent_is_due_when_the_parent_arrives(
        put, ctx, clock, client, base_url, worker, telegram):
    """A child order's payment re-dispatches its parent: a parent not there yet leaves the
    call failed (the child paid), and the parent's arrival makes it due."""
    clock.fixed = NOW
    CrtcOrder.create(order_number="CA-21", parent_order_number="CO-20")
    await crypto_paid(client, base_url, "CA-21")
    [event] = WebhookEvent.select()
    assert event.status == "failed" and CrtcOrder.get().payment_status == "paid"

    clock.fixed = NOW + datetime.timedelta(seconds=5)
    await put("compliance", "CO-20", {"service_slug": "ifta"})
    assert WebhookEvent.get_by_id(event.id).next_attempt_at == clock.fixed
    assert await inbox.retry_due(ctx) == 1
    assert WebhookEvent.get_by_id(event.id).status == "processed"
    assert [json.loads(job.body)["action"] for job in worker.posts] == [
        "process_compliance_service"]


@pytest.mark.gen_test(timeout=90)
async def test_the_service_handles_a_waiting_call_as_the_order_arrives_not_at_its_retry(
        tmp_path, database_url, client, telegram):
    """`serve` with a scheduler tick of an hour: only the order's arrival can have the
    waiting call handled while the test waits."""
    service = Service(str(tmp_path / "service.log"), {
        "DATABASE_URL": database_url, "SPOOL_DIR": str(tmp_path / "spool"),
        "ORDERS_API_KEY": KEY, "CRYPTO_PROCESSOR_API_KEY": shkeeper.API_KEY,
        "SCHEDULER_TICK_SECONDS": "3600", "TELEGRAM_API_URL": telegram.url,
        "TELEGRAM_BOT_TOKEN": "123:bot", "TELEGRAM_CHAT_ID": "-1"})
    await service.start()
    try:
        await service.wait_ready(client)
        await crypto_paid(client, service.url, "CA-77")
        assert WebhookEvent.get().status == "failed"
        response = await client.fetch(service.url + "/api/v1/orders/canada_crtc/CA-77",
                                      method="PUT", body="{}", headers=AUTH)
        assert response.code == 201
        deadline = asyncio.get_running_loop().time() + 30
        while CrtcOrder.get().payment_status != "paid":
            assert asyncio.get_running_loop().time() < deadline, service.log()
            await asyncio.sleep(0.1)
    finally:
        service.kill()
    assert WebhookEvent.get().status == "processed"
    assert "canada_crtc order CA-77 created through the orders API; 1 waiting call(s) due " \
           "now" in service.log()


# --- the import command ------------------------------------------------------------------------

CSV = """kind,order_number,customer_email,customer_name,service_slug,total_cents,currency
canada_crtc,CA-1,fay@example.com,Fay Radio Ltd,,12900,CAD
compliance,CO-1,dana@example.com,"Dana Trucking
LLC",ifta,,

formation,FO-1,bad address,Ana,,,
compliance,CO-2,,Ben,,780,
canada_crtc,CA-2,gus@example.com,Gus,,7.80,
bundle,BU-1,eve@example.com,Eve,,,
nope,X-1,,,,,
canada_crtc,CA-1,fay@example.com,Fay again,,12900,CAD
canada_crtc,CA-3,,,,
compliance,CO-3,dana@example.com,"Dana Trucking, LLC",ifta,,
"""
CSV_BAD = [
    "line 3: customer_name must not hold control characters",
    "line 6: customer_email must be an e-mail address",
    "line 7: total_cents is not a field of compliance orders",
    "line 8: total_cents must be a whole number of cents (the currency's minor units), 0 or "
    'more, got "7.80"',
    "line 10: unknown kind: nope (the kinds: formation, compliance, bundle, canada_crtc)",
    "line 11: order CA-1 is on line 2 too",
    "line 12: 6 values for the header's 7 columns",
]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_an_import_stores_the_good_rows_names_each_bad_one_by_line_and_exits_1(
        tmp_path, database_url, migrated_db):
    path = write(tmp_path, "orders.csv", CSV)
    first = run(database_url, "orders", "import", path)
    assert first.returncode == 1, first.stderr
    assert first.stderr.splitlines() == CSV_BAD
    assert first.stdout == "10 row(s): 3 created, 0 updated, 0 unchanged, 7 bad\n"
    assert rows() == {("canada_crtc", "CA-1"), ("compliance", "CO-3"), ("bundle", "BU-1")}
    fay = CrtcOrder.get()
    assert (fay.customer_name, fay.total_cents, fay.currency) == ("Fay Radio Ltd", 12900, "CAD")
    dana = ComplianceOrder.get()
    assert (dana.customer_name, dana.service_slug) == ("Dana Trucking, LLC", "ifta")

    second = run(database_url, "orders", "import", path)
    assert (second.returncode, second.stderr.splitlines()) == (1, CSV_BAD)
    assert second.stdout == "10 row(s): 0 created, 0 updated, 3 unchanged, 7 bad\n"


def test_a_dry_run_says_what_the_import_would_do_and_stores_nothing(
        tmp_path, database_url, migrated_db):
    """`orders import --dry-run`: every row checked as the import checks it, the database's
    refusals included (a number of another kind), its answer the import's, nothing kept."""
    path = write(tmp_path, "orders.csv", CSV)
    dry = run(database_url, "orders", "import", "--dry-run", path)
    assert dry.returncode == 1 and dry.stderr.splitlines() == CSV_BAD
    assert dry.stdout == ("10 row(s): 3 would be created, 0 would be updated, 0 unchanged, "
                          "7 bad (dry run: nothing stored)\n")
    assert rows() == set() and OrderChange.select().count() == 0

    assert run(database_url, "orders", "import", path).returncode == 1
    changes = OrderChange.select().count()
    ComplianceOrder.create(order_number="CA-3")  # CA-3's number taken by another kind
    again = write(tmp_path, "again.csv", "kind,order_number,customer_name\n"
                  "canada_crtc,CA-1,Fay Radio Inc\ncanada_crtc,CA-3,Cy\n")
    dry = run(database_url, "orders", "import", "--dry-run", again)
    assert dry.returncode == 1
    assert dry.stderr.splitlines() == ["line 3: order CA-3 is a compliance order"]
    assert dry.stdout.startswith("2 row(s): 0 would be created, 1 would be updated, ")
    assert CrtcOrder.get().customer_name == "Fay Radio Ltd"
    assert OrderChange.select().count() == changes


def test_json_lines_are_imported_under_the_same_contract(tmp_path, database_url):
    lines = [{"kind": "formation", "order_number": "FO-1", "customer_name": "Ana"},
             {"kind": "canada_crtc", "order_number": "CA-1", "total_cents": 780},
             {"kind": "canada_crtc", "order_number": "CA-2", "payment_status": "paid"},
             [1, 2], {"order_number": "FO-3"},
             {"kind": "canada_crtc", "order_number": "CA-3", "total_cents": "780"}]
    text = "\n".join(json.dumps(line) for line in lines[:3]) + "\n\nnot json\n" + \
        "\n".join(json.dumps(line) for line in lines[3:]) + "\n"
    result = run(database_url, "orders", "import", write(tmp_path, "orders.jsonl", text))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "line 3: payment_status is the service's to set, not the shop's: the orders API "
        "never changes it (docs/ORDERS.md)",
        "line 5: not a JSON object", "line 6: not a JSON object", "line 7: kind is missing (the kinds: formation, compliance, bundle, canada_crtc)",
        "line 8: total_cents must be a whole number of cents (the currency's minor units), "
        '0 or more, got "780"']
    assert result.stdout == "7 row(s): 2 created, 0 updated, 0 unchanged, 5 bad\n"
    assert CrtcOrder.get().total_cents == 780 and CrtcOrder.get().payment_status == \
        "pending_payment"


def test_a_good_file_exits_0_and_a_changed_one_updates(tmp_path, database_url):
    path = write(tmp_path, "a.csv", "kind,order_number,customer_name\nformation,FO-1,Ana\n"
                                    "bundle,BU-1,Eve\n")
    assert run(database_url, "orders", "import", path).stdout == \
        "2 row(s): 2 created, 0 updated, 0 unchanged, 0 bad\n"
    path = write(tmp_path, "b.csv", "\ufeffkind,order_number,customer_name\r\n"
                                    "formation,FO-1,Ana Maria\r\nbundle,BU-1,Eve\r\n")
    result = run(database_url, "orders", "import", path)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == "2 row(s): 0 created, 1 updated, 1 unchanged, 0 bad\n"
    assert FormationOrder.get().customer_name == "Ana Maria"


@pytest.mark.parametrize("text,says", [
    ("order_number,kind\nFO-1,formation\n", "line 1: the header must start with kind,order_number"),
    ("kind,order_number,payment_status\n", "line 1: payment_status is the service's to set"),
    ("kind,order_number,colour\n", "line 1: unknown field: colour"),
    ("", "line 1: no header (kind,order_number,<field>...)"),
    ("kind,order_number\nformation,FO-\xe9\n".encode("latin-1"), "line 2: not UTF-8 text"),
])
def test_a_file_that_cannot_be_read_is_named_and_nothing_is_stored(tmp_path, database_url,
                                                                    text, says):
    path = tmp_path / "orders.csv"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    result = run(database_url, "orders", "import", str(path))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"receiver: {path}: {says}")
    assert result.stderr.endswith("; nothing stored\n") and rows() == set()


def test_a_file_that_is_not_there_is_bad_usage(database_url, tmp_path):
    result = run(database_url, "orders", "import", str(tmp_path / "none.csv"))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"receiver: cannot read {tmp_path / 'none.csv'}: No such file or " \
                            "directory\n"


def test_an_import_makes_the_calls_waiting_for_its_orders_due(tmp_path, database_url):
    later = datetime.datetime.now(UTC) + datetime.timedelta(hours=1)
    WebhookEvent.create(source="crypto", event_type="PAID", dedup_key="k", payload="{}",
                        order_number="CA-5", status="failed", next_attempt_at=later)
    path = write(tmp_path, "o.csv", "kind,order_number\ncanada_crtc,CA-5\n")
    result = run(database_url, "orders", "import", path)
    assert result.stdout == ("1 row(s): 1 created, 0 updated, 0 unchanged, 0 bad; 1 waiting "
                             "call(s) due now (the running service handles them within "
                             "SCHEDULER_TICK_SECONDS)\n")
    assert WebhookEvent.get().next_attempt_at < later


@pytest.mark.gen_test(timeout=60)
async def test_the_import_shows_its_progress_on_a_terminal(tmp_path, database_url):
    lines = "".join(f"bundle,BU-{n},Name {n}\n" for n in range(250))
    path = write(tmp_path, "many.csv", "kind,order_number,customer_name\n" + lines)
    async with OnATerminal("orders", "import", path, env=cli_env(database_url)) as terminal:
        await terminal.finish()
    assert terminal.returncode == 0, terminal.shown
    assert re.search(r"importing: +\d+%\|[^|]*\| 250/250", terminal.shown), terminal.shown
    assert terminal.stdout == "250 row(s): 250 created, 0 updated, 0 unchanged, 0 bad\n"


# --- every ordering, every repetition --------------------------------------------------------------

ORDER_ROWS = st.lists(st.tuples(st.sampled_from(intake.KINDS), st.integers(0, 30),
                                st.sampled_from([None, "Ana", "Ben"])),
                      max_size=12, unique_by=lambda row: row[1])


@hypothesis_settings(max_examples=40, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ORDER_ROWS, st.randoms(use_true_random=False))
def test_a_file_s_rows_in_any_order_and_imported_again_give_the_same_orders(db, ctx, rows_,
                                                                           rnd):
    """The stored orders depend on the rows, not on their order in the file nor on how
    often the file is imported; a second import changes nothing."""
    def imported(ordered):
        for model in ORDER_MODELS.values():
            through_the_door(lambda model=model: model.delete().execute())
        parsed = [intake.Row(n, intake.parse(kind, f"{PREFIX[kind]}{number}",
                                             {"customer_name": name}))
                  for n, (kind, number, name) in enumerate(ordered, start=2)]
        first = through_the_door(intake.store_rows, Transaction(ctx), parsed, NOW, "rows.csv")
        again = through_the_door(intake.store_rows, Transaction(ctx), parsed, NOW, "rows.csv")
        assert (again.created, again.updated, again.unchanged) == (0, 0, len(parsed))
        assert first.created == len(parsed)
        return {(kind, order.order_number, order.customer_name)
                for kind, model in ORDER_MODELS.items() for order in model.select()}
    shuffled = list(rows_)
    rnd.shuffle(shuffled)
    expected = {(kind, f"{PREFIX[kind]}{number}", name) for kind, number, name in rows_}
    assert imported(rows_) == expected == imported(shuffled)


# --- the contract and its page ---------------------------------------------------------------------

def orders_md():
    with open(os.path.join(ROOT, "docs", "ORDERS.md"), encoding="utf-8") as page:
        return page.read()


def test_every_column_of_an_order_is_the_shop_s_or_the_service_s():
    for kind, model in ORDER_MODELS.items():
        columns = {field.name for field in model._meta.sorted_fields}
        shop, service = set(intake.SHOP_FIELDS[kind]), set(intake.service_fields(kind))
        assert shop <= columns and not shop & service
        assert shop | service | set(intake.ROW_FIELDS) == columns


def test_orders_md_names_every_field_of_every_kind_as_the_contract_has_it():
    """The page's two tables: the shop's fields (kind by kind) and the service's."""
    page = orders_md()
    shop_table = page.split("## The shop's fields", 1)[1].split("\n## ", 1)[0]
    service_table = page.split("## The service's fields", 1)[1].split("\n## ", 1)[0]
    for field in {f for fields in intake.SHOP_FIELDS.values() for f in fields}:
        assert f"| {field} |" in shop_table, field
    for field in {f for kind in intake.KINDS for f in intake.service_fields(kind)}:
        assert f"`{field}`" in service_table, field


def test_every_migration_of_the_order_tables_is_announced_in_orders_md():
    """A shop that shares the database learns of a change to its tables from ORDERS.md's
    list: a migration that names an order table must be in it."""
    announced = orders_md().split("## Changes to the order tables", 1)[1]
    folder = os.path.join(ROOT, "migrations")
    tables = [model._meta.table_name for model in ORDER_MODELS.values()]
    for name in sorted(os.listdir(folder)):
        if not name[:4].isdigit():
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as source:
            text = source.read()
        if any(table in text for table in tables) or "ORDER_MODELS" in text:
            assert f"| {name[:-3]} |" in announced, name


@pytest.mark.gen_test(timeout=60)
async def test_the_readme_s_first_order_for_make_run_is_made_as_it_says(
        http_server, base_url, ctx):
    """The README's `make run` block and its curl, as printed, against the service (its
    address the test's): 201 and the order."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as page:
        readme = page.read()
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.DOTALL)
    [run_line] = [block for block in blocks if "make run" in block and "ORDERS_API_KEY" in block]
    [curl] = [block for block in blocks if "/api/v1/orders/" in block]
    key = re.search(r"ORDERS_API_KEY=(\S+) make run", run_line)[1]
    ctx.settings = dataclasses.replace(ctx.settings, orders_api_key=key)
    process = await asyncio.create_subprocess_exec(
        "bash", "-c", curl.replace("http://127.0.0.1:8000", base_url),
        stdout=asyncio.subprocess.PIPE)
    out, _ = await process.communicate()
    order = json.loads(out)
    assert (order["kind"], order["order_number"]) == ("formation", "FO-0001")
    assert order["shop"]["customer_email"] == "ana@example.com"
    assert FormationOrder.get().service_name == "Wyoming LLC"


@pytest.mark.gen_test
async def test_a_call_failing_while_its_order_comes_in_stays_due(ctx, clock):
    """The inbox retry holds the call (its order not there when it read); the order comes
    in and makes it due; the handling then records its failure: it stays due, not put
    off by the retry's backoff, up to hours for a call that failed often."""
    clock.fixed = NOW
    event = WebhookEvent.create(source="crypto", event_type="PAID", dedup_key="k",
                                payload="{}", order_number="CA-9", status="failed",
                                attempts=6, next_attempt_at=NOW, received_at=NOW)
    [claimed] = await claims.claim(ctx, WebhookEvent, WebhookEvent.id == event.id)
    clock.fixed = NOW + datetime.timedelta(seconds=5)
    through_the_door(functools.partial(intake.make_waiting_due, Transaction(ctx), "CA-9",
                                       clock.fixed))
    await ctx.db(functools.partial(inbox._record_failure, ctx, claimed, "no such order"))
    assert WebhookEvent.get_by_id(event.id).next_attempt_at == clock.fixed
    # Not made due meanwhile: its backoff.
    [claimed] = await claims.claim(ctx, WebhookEvent, WebhookEvent.id == event.id)
    await ctx.db(functools.partial(inbox._record_failure, ctx, claimed, "no such order"))
    assert WebhookEvent.get_by_id(event.id).next_attempt_at > clock.fixed + datetime.timedelta(
        minutes=10)
