"""What intake takes (docs/ORDERS.md, domain/order_checks.py): an order number its kind's
callbacks find and a link can carry, an ISO 4217 currency, text a database stores; each
bad value answered 400 naming its field by the orders API, and named by its line by the
import, the file's other rows kept. A crypto callback finds the order stored under its
number before it reads a kind from the prefix."""
import datetime
import json

import pytest

from domain import intake
from engine import inbox
from engine.transaction import Transaction
from models import UTC, CrtcOrder, FormationOrder, LedgerEntry, TreasuryJob, WebhookEvent
from tests import shkeeper
from tests.door import through_the_door
from tests.test_cli import run
from tests.test_intake import AUTH, put, rows, settings  # noqa: F401 (fixtures)

NOW = datetime.datetime(2026, 11, 20, 9, 0, tzinfo=UTC)
LINKS = "order_number must be 1 to 255 ASCII letters and digits, with - _ or . between them"


# --- the orders API ------------------------------------------------------------------------

@pytest.mark.parametrize("kind,number,says", [
    ("formation", ".", f'{LINKS} (it is part of links and paths); "." must start and end'),
    ("formation", "..", f'{LINKS} (it is part of links and paths); ".." must start and end'),
    ("formation", "FO-..", f"{LINKS}"),
    ("formation", "FO-1.", f"{LINKS}"),
    ("formation", "FO-1\u202e", f'{LINKS} (it is part of links and paths); "FO-1\\u202e" holds '
                                "U+202E (RIGHT-TO-LEFT OVERRIDE)"),
    ("formation", "FO-\u200b1", f"{LINKS} (it is part of links and paths); "
                                '"FO-\\u200b1" holds U+200B (ZERO WIDTH SPACE)'),
    ("formation", "FO-1\x85", f'{LINKS} (it is part of links and paths); "FO-1\\u0085" holds '
                              "U+0085 (a control character)"),
    ("formation", "FO-\u00e91", f"{LINKS}"),
    ("formation", "fo-6003", 'order_number "fo-6003": write its prefix FO- in capitals (the '
                             "prefix FO- names a formation order; fo- names none)"),
    ("formation", "6003", 'order_number "6003": a formation order\'s number starts with FO-, '
                          "the prefix the crypto processor's callbacks find its kind by"),
    ("bundle", "FO-1", 'order_number "FO-1": a bundle order\'s number starts with BU-'),
    ("canada_crtc", "FO-1", 'order_number "FO-1": a canada_crtc order\'s number starts with '
                            "CA- or with none of FO-, BU-, CO-"),
    ("canada_crtc", "ca-1", 'order_number "ca-1": write its prefix CA- in capitals'),
])
@pytest.mark.gen_test
async def test_an_order_number_its_kind_s_callbacks_or_a_link_would_miss_is_400(
        put, kind, number, says):
    status, reply, _ = await put(kind, number, {})
    assert (status, reply["field"]) == (400, "order_number"), reply
    assert reply["error"].startswith(says), reply["error"]
    assert rows() == set()


@pytest.mark.gen_test
async def test_an_escaped_dot_dot_in_the_path_is_400_and_stores_nothing(post):
    status, reply, _ = await post("/api/v1/orders/formation/FO-%2e%2e", b"{}", AUTH,
                                  method="PUT")
    assert (status, reply["field"]) == (400, "order_number")
    assert rows() == set()


@pytest.mark.parametrize("kind,number", [("formation", "FO-6003"), ("canada_crtc", "CA-1"),
                                         ("canada_crtc", "X-1"), ("canada_crtc", "6003"),
                                         ("bundle", "BU-2026.11_a")])
@pytest.mark.gen_test
async def test_a_number_with_its_kind_s_prefix_is_taken(put, kind, number):
    assert (await put(kind, number, {}))[0] == 201
    assert rows() == {(kind, number)}


@pytest.mark.parametrize("body,field,says", [
    ({"currency": "CAN"}, "currency", 'currency must be an ISO 4217 code such as USD or CAD, '
                                      'got "CAN"'),
    ({"currency": "ABC"}, "currency", "currency must be an ISO 4217 code"),
    ({"currency": "ZZZ"}, "currency", "currency must be an ISO 4217 code"),
    ({"currency": "XAU"}, "currency", "currency XAU has no minor unit in ISO 4217"),
    ({"customer_name": "\ud800"}, "customer_name",
     "customer_name holds a lone surrogate, U+D800"),
    ({"customer_email": "a\udfff@example.com"}, "customer_email",
     "customer_email holds a lone surrogate, U+DFFF"),
    ({"\ud800": "x"}, "\ud800", 'unknown field: "\\ud800"'),
    ({"parent_order_number": "fo-1"}, "parent_order_number",
     'parent_order_number "fo-1": write its prefix FO- in capitals'),
    ({"parent_order_number": ".."}, "parent_order_number", "parent_order_number must be 1 to"),
    ({"customer_name": "Ana\x9b"}, "customer_name",
     "customer_name must not hold control characters"),
    ({"total_cents": "\u00b2"}, "total_cents",
     'total_cents must be a whole number of cents (the currency\'s minor units), 0 or more, '
     'got "\\u00b2"'),
])
@pytest.mark.gen_test
async def test_a_value_no_order_can_hold_is_400_naming_its_field(put, body, field, says):
    status, reply, _ = await put("canada_crtc", "CA-1", body)
    assert (status, reply["field"]) == (400, field), reply
    assert reply["error"].startswith(says), reply["error"]
    assert rows() == set()


@pytest.mark.gen_test
async def test_a_value_nested_past_the_parser_is_400_naming_its_field(put):
    depth = 8000
    body = '{"customer_name": "Ana", "service_name": ' + "[" * depth + "]" * depth + "}"
    status, reply, _ = await put("formation", "FO-1", body.encode())
    assert (status, reply) == (400, {
        "error": "service_name nests arrays or objects more than 200 deep (a shop field is "
                 "text or a number)", "field": "service_name"})
    assert rows() == set()
    # Shallow enough to be read: the field's own check names it.
    status, reply, _ = await put("formation", "FO-1", {"service_name": [[["x"]]]})
    assert (status, reply["field"]) == (400, "service_name")


@pytest.mark.gen_test
async def test_a_body_broken_otherwise_is_still_invalid_json(put):
    assert (await put("formation", "FO-1", b'{"customer_name": [[["x"]]'))[:2] == (
        400, {"error": "invalid JSON body"})


# --- the import command --------------------------------------------------------------------

def imported(tmp_path, database_url, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return run(database_url, "orders", "import", str(path))


GOOD_AROUND = "kind,order_number,customer_name,total_cents,currency\n" \
    "formation,FO-1,Ana,,\n{bad}\nbundle,BU-1,Eve,,\n"


@pytest.mark.parametrize("bad,says", [
    ("canada_crtc,CA-2,Gus,\u00b2,CAD",
     'line 3: total_cents must be a whole number of cents (the currency\'s minor units), 0 or '
     'more, got "\\u00b2"'),
    ("canada_crtc,CA-2,Gus,\u0661\u0662,CAD", "line 3: total_cents must be a whole number"),
    ("canada_crtc,CA-2,Gus,780,CAN",
     'line 3: currency must be an ISO 4217 code such as USD or CAD, got "CAN"'),
    ("formation,fo-6003,Gus,,",
     'line 3: order_number "fo-6003": write its prefix FO- in capitals (the prefix FO- names a '
     "formation order; fo- names none)"),
    ("formation,6003,Gus,,", 'line 3: order_number "6003": a formation order\'s number starts '
                             "with FO-"),
    ("formation,FO-2," + "x" * 10_000_000 + ",,",
     "line 3: a cell longer than 131072 characters (no field holds more than 255)"),
    ("formation,FO-2,\"" + "x" * 100_000 + "\",,",
     "line 3: customer_name is longer than 255 characters"),
    ("Formatio,FO-2,Gus,,", "line 3: unknown kind: Formatio (the kinds: formation, compliance, "
                            "bundle, canada_crtc)"),
], ids=["superscript", "arabic-digits", "currency", "lower-case", "no-prefix", "10-MB-cell",
        "long-cell", "kind"])
def test_a_bad_cell_is_named_by_its_line_and_the_rows_around_it_are_stored(
        tmp_path, database_url, bad, says):
    result = imported(tmp_path, database_url, "orders.csv",
                      GOOD_AROUND.format(bad=bad).encode())
    assert result.returncode == 1 and result.stderr.startswith(says), result.stderr[-2000:]
    assert len(result.stderr.splitlines()) == 1
    assert result.stdout == "3 row(s): 2 created, 0 updated, 0 unchanged, 1 bad\n"
    assert rows() == {("formation", "FO-1"), ("bundle", "BU-1")}


def test_kinds_are_read_in_any_case(tmp_path, database_url):
    result = imported(tmp_path, database_url, "orders.csv",
                      b"kind,order_number\nFormation,FO-1\n BUNDLE ,BU-1\n")
    assert (result.returncode, result.stderr) == (0, "")
    assert rows() == {("formation", "FO-1"), ("bundle", "BU-1")}


def json_lines(*lines):
    return "".join(line + "\n" for line in lines).encode()


ANA = json.dumps({"kind": "formation", "order_number": "FO-1", "customer_name": "Ana"})
EVE = json.dumps({"kind": "bundle", "order_number": "BU-1", "customer_name": "Eve"})


@pytest.mark.parametrize("bad,says", [
    ('{"kind": "formation", "order_number": "FO-2", "customer_name": "\\ud800"}',
     "line 2: customer_name holds a lone surrogate, U+D800 (half of a character: the sender's "
     "text was cut or mis-encoded)"),
    ('{"kind": "formation\\ud800", "order_number": "FO-2"}',
     'line 2: unknown kind: "formation\\ud800"'),
    ('{"kind": "formation", "order_number": "FO-2\\ud800"}',
     'line 2: order_number must be 1 to 255 ASCII letters and digits, with - _ or . between '
     'them (it is part of links and paths); "FO-2\\ud800" holds U+D800 (a lone surrogate)'),
    ('{"kind": "formation", "order_number": "FO-2", "service_name": ' + "[" * 50_000
     + "]" * 50_000 + "}",
     "line 2: service_name nests arrays or objects more than 200 deep (a shop field is text "
     "or a number)"),
    ('{"kind": "formation", "order_number": "FO-2", "customer_name": "' + "x" * 10_000_000
     + '"}', "line 2: customer_name is longer than 255 characters"),
    ('{"kind": "canada_crtc", "order_number": "CA-2", "currency": "ZZZ"}',
     'line 2: currency must be an ISO 4217 code such as USD or CAD, got "ZZZ"'),
], ids=["surrogate", "surrogate-kind", "surrogate-number", "50000-deep", "10-MB-value",
        "currency"])
def test_a_bad_json_line_is_named_and_the_lines_around_it_are_stored(
        tmp_path, database_url, bad, says):
    result = imported(tmp_path, database_url, "orders.jsonl", json_lines(ANA, bad, EVE))
    assert result.returncode == 1 and result.stderr.startswith(says), result.stderr[-2000:]
    assert len(result.stderr.splitlines()) == 1
    assert result.stdout == "3 row(s): 2 created, 0 updated, 0 unchanged, 1 bad\n"
    assert rows() == {("formation", "FO-1"), ("bundle", "BU-1")}


def test_a_json_line_holding_a_unicode_line_separator_is_one_line(tmp_path, database_url):
    name = json.dumps({"kind": "formation", "order_number": "FO-2",
                       "customer_name": "Ana\u2028Maria"}, ensure_ascii=False)
    result = imported(tmp_path, database_url, "orders.jsonl", json_lines(ANA, name, EVE))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == "3 row(s): 3 created, 0 updated, 0 unchanged, 0 bad\n"


@pytest.mark.parametrize("data,says", [
    ("kind;order_number;customer_name\nformation;FO-1;Ana\n".encode(),
     "line 1: the header must start with kind,order_number: its columns are separated by "
     "semicolons, not commas (a spreadsheet's export where the decimal mark is a comma); "
     "export it with commas"),
    ("kind\torder_number\nformation\tFO-1\n".encode(),
     "line 1: the header must start with kind,order_number: its columns are separated by "
     "tabs, not commas"),
    ("kind,order_number,customer_name\nformation,FO-1,Ana\nbundle,BU-1,"
     "Eve\u2019s Shop\n".encode("cp1252"),
     "line 3: not UTF-8 text (byte 0x92): it reads as Windows-1252, the encoding of a "
     "spreadsheet's plain CSV export on Windows; export it as CSV UTF-8"),
], ids=["semicolons", "tabs", "windows-1252"])
def test_an_export_mistake_is_named_as_such_and_nothing_is_stored(
        tmp_path, database_url, data, says):
    result = imported(tmp_path, database_url, "orders.csv", data)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(f"receiver: {tmp_path / 'orders.csv'}: {says}")
    assert result.stderr.endswith("; nothing stored\n")
    assert rows() == set()


# --- a crypto callback finds its order ---------------------------------------------------------

@pytest.mark.parametrize("number", ["fo-6003", "6003"])
@pytest.mark.gen_test
async def test_a_crypto_callback_completes_the_order_stored_under_its_number(
        post, telegram, number):
    # Written by a shop sharing the database: intake refuses such a number, a table does not.
    FormationOrder.create(order_number=number)
    status, reply, _ = await post(shkeeper.URL, shkeeper.paid(number), shkeeper.key_headers())
    assert (status, reply) == (202, {"received": True})
    assert FormationOrder.get().payment_status == "paid"
    assert WebhookEvent.get().status == "processed"
    assert TreasuryJob.get().order_type == LedgerEntry.get().order_type == "formation"


@pytest.mark.gen_test
async def test_a_callback_for_an_order_not_there_waits_by_its_prefix_and_finds_it_later(
        post, ctx, clock, telegram):
    clock.fixed = NOW
    status, reply, _ = await post(shkeeper.URL, shkeeper.paid("7001"), shkeeper.key_headers())
    assert (status, reply) == (202, {"received": True, "error": "internal"})
    event = WebhookEvent.get()
    assert event.status == "failed" and "no canada_crtc order 7001" in event.last_error
    FormationOrder.create(order_number="7001")
    through_the_door(intake.make_waiting_due, Transaction(ctx), "7001", clock.fixed)
    assert await inbox.retry_due(ctx) == 1
    assert WebhookEvent.get().status == "processed"
    assert FormationOrder.get().payment_status == "paid" and CrtcOrder.select().count() == 0
