"""BEHAVIOUR.md 4.3 at the HTTP boundary: SHKeeper's callbacks, authenticated the way SHKeeper
authenticates them, against a real database and real peers."""
import dataclasses
import hashlib
import json
from decimal import Decimal
import logging
import os

import jinja2
import pytest

from models import (
    BundleOrder, ComplianceOrder, CrtcOrder, FormationOrder, LedgerEntry, Outbox,
    TreasuryJob, WebhookEvent,
)
from engine import inbox, outbox
from tests import shkeeper
from tests.conftest import table_away
from tests.shkeeper import API_KEY, URL, key_headers, signed_headers
from tests.service_process import database_down


@pytest.fixture
def settings(settings):
    return dataclasses.replace(settings, crypto_processor_api_key=API_KEY)


def nothing_happened(telegram):
    assert WebhookEvent.select().count() == 0
    assert TreasuryJob.select().count() == 0 and LedgerEntry.select().count() == 0
    assert Outbox.select().count() == 0 and telegram.requests == []


def unpaid(model=CrtcOrder, number="CA-1001"):
    return model.get(model.order_number == number).payment_status == "pending_payment"


# --- authentication ------------------------------------------------------------------------

@pytest.mark.parametrize("header", ["X-Shkeeper-Api-Key", "X-Crypto-Processor-Api-Key"])
@pytest.mark.gen_test
async def test_the_key_in_either_header_is_accepted(post, telegram, header):
    CrtcOrder.create(order_number="CA-1001")
    status, reply, _ = await post(URL, shkeeper.paid("CA-1001"), key_headers(header=header))
    assert (status, reply) == (202, {"received": True})
    assert CrtcOrder.get().payment_status == "paid"


@pytest.mark.parametrize("headers", [
    {}, key_headers("wrong"), key_headers(API_KEY + "x"), key_headers(API_KEY[:-1]),
    key_headers(""), key_headers(API_KEY.upper()),
    {**key_headers(), "X-Crypto-Processor-Api-Key": "wrong"},
], ids=["missing", "wrong", "longer", "prefix", "empty", "case", "one-of-two-wrong"])
@pytest.mark.gen_test
async def test_a_wrong_or_missing_key_is_401_and_nothing_else(post, telegram, headers):
    CrtcOrder.create(order_number="CA-1001")
    status, reply, _ = await post(URL, shkeeper.paid("CA-1001"), headers)
    assert (status, reply) == (401, {"error": "invalid api key"})
    nothing_happened(telegram)
    assert unpaid()


@pytest.mark.gen_test
async def test_the_key_is_checked_before_the_body(post, telegram):
    status, reply, _ = await post(URL, b"not json", key_headers("wrong"))
    assert (status, reply) == (401, {"error": "invalid api key"})
    nothing_happened(telegram)


@pytest.mark.parametrize("with_key", [True, False], ids=["with-key-header", "signature-only"])
@pytest.mark.gen_test
async def test_a_valid_shkeeper_signature_is_accepted(post, clock, telegram, with_key):
    clock.set(2026, 11, 20, 9, 0)
    CrtcOrder.create(order_number="CA-1001")
    raw = shkeeper.encode(shkeeper.paid("CA-1001"))
    headers = signed_headers(raw, int(clock().timestamp()) - 299, with_key=with_key)
    status, reply, _ = await post(URL, raw, headers)
    assert (status, reply) == (202, {"received": True})
    assert CrtcOrder.get().payment_status == "paid"


def _tampered(raw, now):
    return raw.replace(b"7.8", b"9.8"), signed_headers(raw, now)


def _stale(raw, now):
    return raw, signed_headers(raw, now - 301)


def _future(raw, now):
    return raw, signed_headers(raw, now + 301)


def _other_key(raw, now):
    return raw, {**signed_headers(raw, now, api_key="someone-else"), "X-Shkeeper-Api-Key": API_KEY}


def _no_timestamp(raw, now):
    headers = signed_headers(raw, now)
    del headers["X-Shkeeper-Timestamp"]
    return raw, headers


def _no_signature(raw, now):
    headers = signed_headers(raw, now)
    del headers["X-Shkeeper-Signature"]
    return raw, headers


def _timestamp_not_a_number(raw, now):
    return raw, {**signed_headers(raw, now), "X-Shkeeper-Timestamp": f"{now}.0"}


def _right_signature_wrong_key(raw, now):
    return raw, {**signed_headers(raw, now), "X-Shkeeper-Api-Key": "wrong"}


@pytest.mark.parametrize("forge", [
    _tampered, _stale, _future, _other_key, _no_timestamp, _no_signature,
    _timestamp_not_a_number, _right_signature_wrong_key,
], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.gen_test
async def test_a_bad_signature_is_refused_like_a_wrong_key(post, clock, telegram, forge):
    clock.set(2026, 11, 20, 9, 0)
    CrtcOrder.create(order_number="CA-1001")
    raw, headers = forge(shkeeper.encode(shkeeper.paid("CA-1001")), int(clock().timestamp()))
    status, reply, _ = await post(URL, raw, headers)
    assert (status, reply) == (401, {"error": "invalid api key"})
    nothing_happened(telegram)
    assert unpaid()


@pytest.mark.parametrize("env", ["development", "production"])
@pytest.mark.gen_test
async def test_no_key_configured_refuses_every_call_and_names_the_setting(
        post, ctx, telegram, caplog, clock, env):
    """No sender is open by default: an unsigned "paid" would mark the order paid. A
    signature made with an empty key is refused too."""
    ctx.settings = dataclasses.replace(ctx.settings, crypto_processor_api_key="", env=env)
    CrtcOrder.create(order_number="CA-1001")
    caplog.set_level(logging.WARNING, logger="receiver.http")
    raw = shkeeper.encode(shkeeper.paid("CA-1001", txid="tx-3"))
    calls = [(shkeeper.paid("CA-1001"), {}),
             (shkeeper.paid("CA-1001", txid="tx-2"), key_headers("anything")),
             (raw, signed_headers(raw, int(clock().timestamp()), api_key="", with_key=False))]
    for body, headers in calls:
        status, reply, _ = await post(URL, body, headers)
        assert (status, reply) == (401, {"error": "invalid api key"})
    nothing_happened(telegram)
    assert unpaid()
    [said] = [r.getMessage() for r in caplog.records
              if "CRYPTO_PROCESSOR_API_KEY" in r.getMessage()]
    assert said.endswith("crypto callback: CRYPTO_PROCESSOR_API_KEY is not set: every "
                         "callback is refused")


@pytest.mark.gen_test
async def test_the_key_never_appears_in_the_logs(post, telegram, caplog):
    caplog.set_level(logging.DEBUG)
    await post(URL, shkeeper.paid("CA-1001"), key_headers("wrong-key-guess"))
    await post(URL, shkeeper.paid("CA-1001"), key_headers())
    assert "wrong-key-guess" not in caplog.text and API_KEY not in caplog.text


# --- BEHAVIOUR.md 4.3 rules ---------------------------------------------------------------------

@pytest.mark.parametrize("external_id", [None, "", "absent"])
@pytest.mark.gen_test
async def test_no_external_id_is_202_and_nothing_else(post, telegram, smtp, external_id):
    callback = shkeeper.paid("CA-1001")
    if external_id == "absent":
        del callback["external_id"]
    else:
        callback["external_id"] = external_id
    status, reply, _ = await post(URL, callback, key_headers())
    assert (status, reply) == (202, {"received": True})
    [event] = WebhookEvent.select()
    assert (event.status, event.last_error) == ("ignored", "no external_id")
    assert TreasuryJob.select().count() == 0 and LedgerEntry.select().count() == 0
    assert Outbox.select().count() == 0 and telegram.requests == [] and smtp.messages == []


@pytest.mark.parametrize("status,paid", [
    ("PAID", False), ("OVERPAID", False), ("PARTIAL", True), ("PARTIAL", False),
])
@pytest.mark.gen_test
async def test_only_paid_true_with_paid_or_overpaid_is_processed(post, telegram, status, paid):
    CrtcOrder.create(order_number="CA-1001")
    callback = {**shkeeper.paid("CA-1001"), "status": status, "paid": paid}
    status_code, reply, _ = await post(URL, callback, key_headers())
    assert (status_code, reply) == (202, {"received": True})
    [event] = WebhookEvent.select()
    assert (event.event_type, event.status) == (status, "processed")
    assert TreasuryJob.select().count() == 0 and LedgerEntry.select().count() == 0
    assert unpaid() and telegram.requests == []


@pytest.mark.gen_test
async def test_partial_and_unconfirmed_notices_are_recorded_and_logged_only(
        post, telegram, caplog):
    CrtcOrder.create(order_number="CA-1001")
    caplog.set_level(logging.INFO, logger="receiver.crypto")
    partial = shkeeper.paid_in_steps("CA-1001")[0]
    for callback in (shkeeper.unconfirmed("CA-1001", txid="tx-step-1"), partial):
        status, reply, _ = await post(URL, callback, key_headers())
        assert (status, reply) == (202, {"received": True})
    events = list(WebhookEvent.select().order_by(WebhookEvent.id))
    assert [(e.event_type, e.status, e.order_number) for e in events] == [
        ("unconfirmed", "processed", "CA-1001"), ("PARTIAL", "processed", "CA-1001")]
    assert "tx-step-1" in caplog.text and "0.001 BTC" in caplog.text
    assert TreasuryJob.select().count() == 0 and LedgerEntry.select().count() == 0
    assert unpaid() and telegram.requests == []


@pytest.mark.gen_test
async def test_no_external_id_and_a_status_with_a_nul_is_still_kept(post, telegram):
    callback = {"status": "PAID\x00", "paid": True}
    status, reply, _ = await post(URL, callback, key_headers())
    assert (status, reply) == (202, {"received": True})
    event = WebhookEvent.get()
    assert (event.event_type, event.status) == ("unknown", "ignored")


@pytest.mark.gen_test
async def test_a_status_we_do_not_know_is_kept_as_ignored(post, telegram):
    expired = {"external_id": "CA-1001", "crypto": "BTC", "addr": "bc1q", "status": "EXPIRED"}
    status, reply, _ = await post(URL, expired, key_headers())
    assert (status, reply) == (202, {"received": True})
    assert WebhookEvent.get().status == "ignored"
    assert TreasuryJob.select().count() == 0


@pytest.mark.parametrize("order_number,model,order_type", [
    ("CA-2001", CrtcOrder, "canada_crtc"),
    ("FO-2001", FormationOrder, "formation"),
    ("BU-2001", BundleOrder, "bundle"),
    ("CO-2001", ComplianceOrder, "compliance"),
    ("XY-2001", CrtcOrder, "canada_crtc"),
    ("2001", CrtcOrder, "canada_crtc"),
    ("fo-2001", CrtcOrder, "canada_crtc"),
])
@pytest.mark.gen_test
async def test_order_type_comes_from_the_prefix(post, telegram, order_number, model, order_type):
    model.create(order_number=order_number)
    status, reply, _ = await post(URL, shkeeper.paid(order_number), key_headers())
    assert (status, reply) == (202, {"received": True})
    assert model.get(model.order_number == order_number).payment_status == "paid"
    assert TreasuryJob.get().order_type == order_type
    assert LedgerEntry.get().order_type == order_type


@pytest.mark.gen_test
async def test_a_numeric_external_id_is_read_as_its_digits(post, telegram):
    CrtcOrder.create(order_number="107")
    status, reply, _ = await post(URL, {**shkeeper.paid("x"), "external_id": 107},
                                  key_headers())
    assert (status, reply) == (202, {"received": True})
    assert CrtcOrder.get().payment_status == "paid"
    assert TreasuryJob.get().order_id == "107"


@pytest.mark.gen_test
async def test_txid_is_that_of_the_first_transaction(post, telegram):
    CrtcOrder.create(order_number="CA-1001")
    callback = shkeeper.paid_in_steps("CA-1001")[1]
    await post(URL, callback, key_headers())
    assert LedgerEntry.get().provider_ref == "tx-step-1"
    assert TreasuryJob.get().idempotency_key == "crypto-settle:CA-1001:tx-step-1"
    order = CrtcOrder.get()
    assert (order.stripe_session_id, order.payment_method) == ("crypto-tx-step-1", "crypto")


@pytest.mark.parametrize("transactions", [None, [], [{"date": "2026-11-20 09:00:00"}]],
                         ids=["absent", "empty", "no-txid"])
@pytest.mark.gen_test
async def test_txid_falls_back_to_coin_and_arrival_time(post, clock, telegram, transactions):
    clock.set(2026, 11, 20, 9, 0, 0)
    CrtcOrder.create(order_number="CA-1001")
    callback = {**shkeeper.paid("CA-1001"), "crypto": "eth-usdt"}
    if transactions is None:
        del callback["transactions"]
    else:
        callback["transactions"] = transactions
    await post(URL, callback, key_headers())
    txid = f"crypto-ETH-USDT-{int(clock().timestamp() * 1000)}"
    assert txid == "crypto-ETH-USDT-1795165200000"
    entry = LedgerEntry.get()
    assert (entry.provider_ref, entry.idempotency_key, entry.fallback) == (
        txid, "crypto-processor:CA-1001:fallback", True)
    assert CrtcOrder.get().stripe_session_id == f"crypto-{txid}"

    # SHKeeper re-sends until it sees 202; a re-send a minute later is the same event,
    # so the time in the fallback cannot make a second ledger entry.
    clock.advance(seconds=60)
    status, reply, _ = await post(URL, callback, key_headers())
    assert (status, reply) == (202, {"received": True})
    assert WebhookEvent.select().count() == 1 and LedgerEntry.select().count() == 1


@pytest.mark.gen_test
async def test_a_retried_event_keeps_its_fallback_txid(post, clock, ctx, telegram):
    clock.set(2026, 11, 20, 9, 0, 0)
    callback = {**shkeeper.paid("CA-1001"), "transactions": []}
    status, reply, _ = await post(URL, callback, key_headers())
    assert (status, reply) == (202, {"received": True, "error": "internal"})
    CrtcOrder.create(order_number="CA-1001")
    clock.advance(minutes=5)
    assert await inbox.process(ctx, WebhookEvent.get()) == "processed"
    assert LedgerEntry.get().provider_ref == "crypto-BTC-1795165200000"


# --- amounts -------------------------------------------------------------------------------

@pytest.mark.parametrize("raw_fiat,raw_coin,cents,coin", [
    ('"7.80"', '"0.00012345"', 780, "0.00012345"),
    ("7.8", "0.00012345", 780, "0.00012345"),
    ("8", "1", 800, "1"),
    ('"7.805"', '"0.1"', 781, "0.1"),
    ('"7.80499999"', '"0.1"', 780, "0.1"),
    ('"0.005"', '"0.000000000000000001"', 1, "0.000000000000000001"),
    ("19.999", "0.123456789012345678901234", 2000, "0.123456789012345678901234"),
    ('"1e2"', '"2E-8"', 10000, "0.00000002"),
], ids=["strings", "numbers", "integers", "half-up", "below-half", "tiny", "many-digits",
        "exponent"])
@pytest.mark.gen_test
async def test_amounts_are_exact_decimals_and_cents_round_half_up(
        post, telegram, raw_fiat, raw_coin, cents, coin):
    CrtcOrder.create(order_number="CA-1001")
    raw = (b'{"external_id": "CA-1001", "crypto": "btc", "fiat": "USD", "paid": true, '
           b'"status": "PAID", "balance_fiat": ' + raw_fiat.encode() +
           b', "balance_crypto": ' + raw_coin.encode() +
           b', "transactions": [{"txid": "tx-amounts", "amount_crypto": ' + raw_coin.encode() +
           b', "amount_fiat": ' + raw_fiat.encode() + b', "trigger": true}]}')
    status, reply, _ = await post(URL, raw, key_headers())
    assert (status, reply) == (202, {"received": True})
    job, entry = TreasuryJob.get(), LedgerEntry.get()
    assert (job.amount_usd_cents, entry.amount_usd_cents) == (cents, cents)
    assert job.amount_coin == entry.amount_coin == Decimal(coin)
    assert job.coin == entry.coin == "BTC"


@pytest.mark.gen_test
async def test_absent_amounts_are_zero(post, telegram):
    CrtcOrder.create(order_number="CA-1001")
    callback = shkeeper.paid("CA-1001")
    del callback["balance_fiat"], callback["balance_crypto"]
    await post(URL, callback, key_headers())
    job = TreasuryJob.get()
    assert (job.amount_coin, job.amount_usd_cents) == (0, 0)
    assert CrtcOrder.get().payment_status == "paid"


MALFORMED = [
    (b'"abc"', "balance_fiat is not a number: 'abc'"),
    (b"true", "balance_fiat is not a number: True"),
    (b"NaN", "balance_fiat is not an amount: Decimal('NaN')"),
    (b"Infinity", "balance_fiat is not an amount: Decimal('Infinity')"),
    (b'"-Infinity"', "balance_fiat is not an amount: '-Infinity'"),
    (b'"-1.00"', "balance_fiat is not an amount: '-1.00'"),
    (b'"7,80"', "balance_fiat is not a number: '7,80'"),
    (b'[7.8]', "balance_fiat is not a number: [Decimal('7.8')]"),
    (b'"1e400"', "balance_fiat is out of range: '1e400'"),
]


@pytest.mark.parametrize("value,reason", MALFORMED, ids=[m[0].decode() for m in MALFORMED])
@pytest.mark.gen_test
async def test_an_amount_that_is_not_a_number_is_rejected_and_the_admin_told(
        post, telegram, smtp, value, reason):
    CrtcOrder.create(order_number="CA-1001")
    raw = shkeeper.encode(shkeeper.paid("CA-1001")).replace(b'"balance_fiat":"7.8"',
                                                            b'"balance_fiat":' + value)
    status, reply, _ = await post(URL, raw, key_headers())
    assert (status, reply) == (202, {"received": True})
    [event] = WebhookEvent.select()
    assert (event.status, event.last_error, event.order_number) == (
        "rejected", reason, "CA-1001")
    assert event.payload == raw.decode()
    assert TreasuryJob.select().count() == 0 and unpaid() and telegram.requests == []
    [(recipients, message)] = smtp.messages
    assert recipients == ["admin@example.test"]
    assert message["Subject"] == "Crypto payment callback rejected: CA-1001"
    text = message.get_body(("plain",)).get_content()
    html = message.get_body(("html",)).get_content()
    assert "CA-1001" in text and reason in text and "NOT completed" in text
    assert reason.replace("'", "&#39;") in html


@pytest.mark.gen_test
async def test_a_malformed_callback_that_is_not_a_payment_is_rejected_quietly(
        post, telegram, smtp):
    callback = {**shkeeper.paid_in_steps("CA-1001")[0], "balance_crypto": "lots"}
    status, reply, _ = await post(URL, callback, key_headers())
    assert (status, reply) == (202, {"received": True})
    assert WebhookEvent.get().status == "rejected" and smtp.messages == []


@pytest.mark.parametrize("field,value,reason", [
    ("paid", "true", "paid is not true or false: 'true'"),
    ("transactions", "tx-1", "transactions is not a list of objects"),
    ("transactions", ["tx-1"], "transactions is not a list of objects"),
    ("transactions", [{"txid": 42}], "txid is not a string: 42"),
    ("transactions", [{"txid": "tx\x00"}], "txid is not printable text: 'tx\\x00'"),
    ("status", "PAID\x00", "status is not printable text: 'PAID\\x00'"),
    ("transactions", [{"txid": "f" * 257}], "a transaction's txid is too long"),
    # Each is part of an indexed column: past PostgreSQL's index row limit they would
    # fail to store (issue 20).
    ("status", "P" * 4000, "status is too long: '" + "P" * 56 + "..."),
    ("txid", "t" * 257, "txid is too long"),
    ("external_id", "C" * 2800, "external_id is not an order number: '" + "C" * 56 + "..."),
    ("status", 1, "status is not a string: 1"),
    ("external_id", ["CA-1001"], "external_id is not a string: ['CA-1001']"),
    ("external_id", "CA-1001\nBcc: x", "external_id is not an order number: 'CA-1001\\nBcc: x'"),
])
@pytest.mark.gen_test
async def test_other_malformed_fields_are_rejected(post, telegram, smtp, field, value, reason):
    callback = {**shkeeper.paid("CA-1001"), field: value}
    status, reply, _ = await post(URL, callback, key_headers())
    assert (status, reply) == (202, {"received": True})
    event = WebhookEvent.get()
    assert (event.status, event.last_error) == ("rejected", reason)
    [(_, message)] = smtp.messages
    assert "\n" not in message["Subject"]


@pytest.mark.parametrize("raw,reason", [
    (b"not json", "body is not JSON"), (b"", "body is not JSON"),
    (b'{"external_id": "CA-1001", ', "body is not JSON"), (b"\xff\xfe", "body is not JSON"),
    (b"[1, 2]", "body is not a JSON object"), (b"null", "body is not a JSON object"),
    (b"[" * 100_000, "body is not JSON"),
], ids=["text", "empty", "truncated", "not-utf8", "array", "null", "nested-too-deep"])
@pytest.mark.gen_test
async def test_a_body_that_is_not_a_json_object_is_rejected(post, telegram, smtp, raw, reason):
    status, reply, _ = await post(URL, raw, key_headers())
    assert (status, reply) == (202, {"received": True})
    event = WebhookEvent.get()
    assert (event.status, event.event_type, event.last_error) == ("rejected", "malformed", reason)
    assert smtp.messages == [] and telegram.requests == []


@pytest.mark.gen_test
async def test_a_large_rejected_callback_is_kept_as_its_beginning_its_size_and_its_hash(
        post, smtp):
    """500 malformed callbacks of 200 KB each, sent with the right key, made a 101 MB
    database: a call never handled is kept whole up to 16 KiB, past that as its first
    16 KiB, its size and its SHA-256. A small one is kept whole."""
    raw = shkeeper.encode({**shkeeper.paid("CA-1001"), "balance_fiat": "abc",
                           "padding": "p" * 200_000})
    small = shkeeper.encode({**shkeeper.paid("CA-1002"), "balance_fiat": "abc"})
    for body in (raw, small):
        status, _, _ = await post(URL, body, key_headers())
        assert status == 202
    large, whole = WebhookEvent.select().order_by(WebhookEvent.id)
    assert large.status == whole.status == "rejected"
    head, note = large.payload.rsplit("\n", 1)
    assert raw.decode().startswith(head) and len(head) == inbox.KEPT_OF_UNHANDLED
    assert note == (f"[cut: the first {inbox.KEPT_OF_UNHANDLED} of {len(raw)} bytes kept; "
                    f"sha256 {hashlib.sha256(raw).hexdigest()}]")
    assert whole.payload == small.decode()


@pytest.mark.gen_test
async def test_a_rejected_callback_sent_again_is_kept_once_and_mailed_once(post, smtp):
    raw = shkeeper.encode({**shkeeper.paid("CA-1001"), "balance_fiat": "abc"})
    for _ in range(3):
        status, reply, _ = await post(URL, raw, key_headers())
        assert (status, reply) == (202, {"received": True})
    assert WebhookEvent.select().count() == 1 and len(smtp.messages) == 1


@pytest.mark.gen_test
async def test_without_admin_email_a_rejection_is_only_logged(post, ctx, smtp, caplog):
    ctx.settings = dataclasses.replace(ctx.settings, admin_email="")
    status, reply, _ = await post(URL, {**shkeeper.paid("CA-1001"), "paid": "yes"},
                                  key_headers())
    assert (status, reply) == (202, {"received": True})
    assert WebhookEvent.get().status == "rejected"
    assert smtp.messages == [] and "ADMIN_EMAIL unset" in caplog.text


# --- failures ------------------------------------------------------------------------------

@pytest.mark.gen_test
async def test_an_unknown_order_keeps_the_receipt_answers_202_and_is_retried(
        post, ctx, telegram):
    status, reply, _ = await post(URL, shkeeper.paid("CA-404"), key_headers())
    assert (status, reply) == (202, {"received": True, "error": "internal"})
    event = WebhookEvent.get()
    assert event.status == "failed" and event.next_attempt_at is not None
    assert event.last_error.startswith("payment not completed: OrderNotFound")
    # The coins arrived: their record does not wait for the order to exist.
    assert TreasuryJob.select().count() == 1 and LedgerEntry.select().count() == 1
    assert telegram.requests == []

    CrtcOrder.create(order_number="CA-404")
    assert await inbox.process(ctx, WebhookEvent.get()) == "processed"
    assert CrtcOrder.get().payment_status == "paid"
    assert TreasuryJob.select().count() == 1 and LedgerEntry.select().count() == 1
    assert len(telegram.requests) == 1


@pytest.mark.gen_test
async def test_a_broken_order_table_is_an_internal_error_still_answered_202(
        post, db, telegram):
    CrtcOrder.create(order_number="CA-1001")
    with table_away(db, "crtc_orders"):
        status, reply, _ = await post(URL, shkeeper.paid("CA-1001"), key_headers())
    assert (status, reply) == (202, {"received": True, "error": "internal"})
    event = WebhookEvent.get()
    assert event.status == "failed" and event.next_attempt_at is not None
    assert TreasuryJob.select().count() == 1 and LedgerEntry.select().count() == 1
    assert telegram.requests == []


@pytest.mark.gen_test
async def test_an_error_before_the_inbox_is_an_internal_error_still_answered_202(
        post, ctx, tmp_path, smtp, caplog):
    # Mail templates that are really not there: rendering the admin's mail fails.
    ctx.templates = jinja2.Environment(loader=jinja2.FileSystemLoader(str(tmp_path)))
    raw = shkeeper.encode({**shkeeper.paid("CA-1001"), "balance_fiat": "abc"})
    status, reply, _ = await post(URL, raw, key_headers())
    assert (status, reply) == (202, {"received": True, "error": "internal"})
    assert "crypto callback could not be stored" in caplog.text
    assert smtp.messages == []


@pytest.mark.parametrize("balance_fiat,event_type,status", [
    ("7.80", "PAID", "received"), ("abc", "malformed", "rejected")])
@pytest.mark.gen_test
async def test_database_down_spools_the_callback_and_acknowledges_it(
        post, db, ctx, telegram, balance_fiat, event_type, status):
    with database_down(db):
        status_code, reply, _ = await post(
            URL, {**shkeeper.paid("CA-1001"), "balance_fiat": balance_fiat}, key_headers())
    assert (status_code, reply) == (202, {"received": True})
    with open(os.path.join(ctx.settings.spool_dir, "inbox.jsonl")) as spooled:
        [line] = spooled.read().splitlines()
    entry = json.loads(line)
    assert (entry["source"], entry["event_type"], entry["order_number"], entry["status"]) == (
        "crypto", event_type, "CA-1001", status)
    assert telegram.requests == []


@pytest.mark.gen_test
async def test_database_and_spool_down_is_503_so_shkeeper_sends_again(post, db, ctx):
    ctx.settings = dataclasses.replace(ctx.settings, spool_dir="/dev/null/spool")
    with database_down(db):
        status, reply, _ = await post(URL, shkeeper.paid("CA-1001"), key_headers())
    assert (status, reply) == (503, {"error": "temporarily unavailable"})


@pytest.mark.gen_test
async def test_an_oversize_body_is_413(post, ctx):
    padding = "x" * (ctx.settings.max_body_bytes + 1)
    status, reply, _ = await post(URL, {**shkeeper.paid("CA-1001"), "pad": padding},
                                  key_headers())
    assert (status, reply) == (413, {"error": "request body too large"})
    assert WebhookEvent.select().count() == 0


@pytest.mark.gen_test
async def test_a_rejected_paid_callback_taken_during_an_outage_is_told_to_the_admin_once(
        post, ctx, db, telegram, smtp):
    CrtcOrder.create(order_number="CA-1001")
    raw = shkeeper.encode(shkeeper.paid("CA-1001")).replace(b'"balance_fiat":"7.8"',
                                                            b'"balance_fiat":"abc"')
    with database_down(db):
        status, reply, _ = await post(URL, raw, key_headers())
    assert (status, reply) == (202, {"received": True})

    assert await inbox.drain_spool(ctx) == 1
    [event] = WebhookEvent.select()
    assert (event.status, event.last_error) == (
        "rejected", "balance_fiat is not a number: 'abc'")
    await outbox.send_due(ctx)
    [(recipients, message)] = smtp.messages
    assert recipients == ["admin@example.test"]
    assert message["Subject"] == "Crypto payment callback rejected: CA-1001"
    text = message.get_body(("plain",)).get_content()
    assert "CA-1001" in text and "not a number" in text and "NOT completed" in text
    # The sender's retry, stored again from the spool, tells nobody twice.
    with database_down(db):
        await post(URL, raw, key_headers())
    await inbox.drain_spool(ctx)
    await outbox.send_due(ctx)
    assert len(smtp.messages) == 1 and unpaid()
