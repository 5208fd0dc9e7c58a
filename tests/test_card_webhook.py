"""BEHAVIOUR.md 4.2 processing order for POST /api/v1/webhooks/card-processor: configuration,
signatures, the inbox, duplicates and handling errors. Events are signed in the test the
way Stripe signs them."""
import asyncio
import dataclasses
import datetime
import json
import time

import pytest

from models import CrtcOrder, FormationOrder, Outbox, WebhookEvent
from domain import card_events
from engine import inbox, spool
from tests import stripe_events as se
from tests.service_process import database_down
from tests.stripe_events import RECEIVED, deliver, settings  # noqa: F401 (fixture)

MISSING = (400, {"error": "Missing signature header"})
REFUSED = (400, {"error": "Webhook signature verification failed"})


def paid_session(order_number="FO-1", **kwargs):
    return se.event("checkout.session.completed",
                    se.checkout_session(order_number, "formation", **kwargs))


@pytest.fixture
def fixed_clock(clock):
    clock.set(2026, 11, 20, 9, 0, 0)
    return clock


# --- 1. not configured ----------------------------------------------------------------------

@pytest.mark.parametrize("unset", [{"stripe_secret_key": ""}, {"stripe_webhook_secrets": ()}],
                         ids=["no-secret-key", "no-webhook-secret"])
@pytest.mark.gen_test
async def test_not_configured_answers_received_and_ignores_the_event(post, ctx, clock, unset):
    ctx.settings = dataclasses.replace(ctx.settings, **unset)
    FormationOrder.create(order_number="FO-1")
    assert (await deliver(post, clock, paid_session()))[:2] == RECEIVED
    assert (await post(se.CARD_URL, b"anything", {}))[:2] == RECEIVED
    assert WebhookEvent.select().count() == 0
    assert FormationOrder.get().payment_status == "pending_payment"


# --- 2. and 3. the signature ------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Stripe-Signature": ""}, {"Processor-Signature": " "}],
                         ids=["absent", "empty", "blank"])
@pytest.mark.gen_test
async def test_missing_signature_header_is_400(post, headers):
    assert (await post(se.CARD_URL, se.raw_of(paid_session()), headers))[:2] == MISSING
    assert WebhookEvent.select().count() == 0


@pytest.mark.parametrize("header", ["Processor-Signature", "Stripe-Signature",
                                    "processor-signature"])
@pytest.mark.gen_test
async def test_either_signature_header_is_accepted(post, clock, header):
    FormationOrder.create(order_number="FO-1")
    assert (await deliver(post, clock, paid_session(), header=header))[:2] == RECEIVED
    assert FormationOrder.get().payment_status == "paid"


def good_v1(raw, timestamp):
    return se.sign(raw, se.SECRET, timestamp).split(",")[1]


@pytest.mark.parametrize("make_header", [
    lambda raw, t: "garbage",
    lambda raw, t: f"t=soon,{good_v1(raw, t)}",
    lambda raw, t: good_v1(raw, t),
    lambda raw, t: f"t={t}",
    lambda raw, t: f"t={t},v0={good_v1(raw, t)[3:]}",
    lambda raw, t: f"t={t},v1=",
    lambda raw, t: f"t={t + 1},{good_v1(raw, t)}",
    lambda raw, t: f"t={t}, {good_v1(raw, t)}",
    lambda raw, t: f"t,{good_v1(raw, t)}",
], ids=["garbage", "timestamp-not-a-number", "no-timestamp", "no-signature", "wrong-scheme",
        "empty-signature", "other-timestamp", "space-before-v1",
        "timestamp-without-value"])
@pytest.mark.gen_test
async def test_malformed_signature_header_is_refused(post, fixed_clock, make_header):
    raw = se.raw_of(paid_session())
    header = make_header(raw, int(fixed_clock().timestamp()))
    assert (await post(se.CARD_URL, raw, {"Stripe-Signature": header}))[:2] == REFUSED
    assert WebhookEvent.select().count() == 0


@pytest.mark.gen_test
async def test_the_timestamp_is_read_as_the_library_reads_it(post, fixed_clock):
    """Stripe's library takes `t=<t>=<junk>` as <t>; so do we (not a crash, not a bypass)."""
    FormationOrder.create(order_number="FO-1")
    raw = se.raw_of(paid_session())
    t = int(fixed_clock().timestamp())
    header = f"t={t}=0,{good_v1(raw, t)}"
    assert (await post(se.CARD_URL, raw, {"Stripe-Signature": header}))[:2] == RECEIVED
    stale = f"t={t - 301}=0,{good_v1(raw, t - 301)}"
    assert (await post(se.CARD_URL, raw, {"Stripe-Signature": stale}))[:2] == REFUSED


@pytest.mark.gen_test
async def test_wrong_secret_is_refused(post, clock):
    assert (await deliver(post, clock, paid_session(), secret="whsec_other"))[:2] == REFUSED


@pytest.mark.gen_test
async def test_tampered_body_is_refused(post, fixed_clock):
    FormationOrder.create(order_number="FO-2")
    raw = se.raw_of(paid_session("FO-1"))
    signature = se.sign(raw, se.SECRET, int(fixed_clock().timestamp()))
    tampered = raw.replace(b"FO-1", b"FO-2")
    assert (await post(se.CARD_URL, tampered, {"Stripe-Signature": signature}))[:2] == REFUSED
    assert FormationOrder.get().payment_status == "pending_payment"


@pytest.mark.parametrize("age,answer", [
    (0, RECEIVED), (300, RECEIVED), (301, REFUSED), (3600, REFUSED),
    (-300, RECEIVED), (-301, REFUSED), (-86400, REFUSED),
], ids=["now", "300s-old", "301s-old", "hour-old", "300s-ahead", "301s-ahead", "day-ahead"])
@pytest.mark.gen_test
async def test_signature_time_must_be_within_300_seconds_either_way(
        post, fixed_clock, age, answer):
    FormationOrder.create(order_number="FO-1")
    assert (await deliver(post, fixed_clock, paid_session(), age=age))[:2] == answer
    assert WebhookEvent.select().count() == (answer == RECEIVED)


@pytest.mark.gen_test
async def test_the_log_tells_a_stale_signature_from_a_wrong_secret(post, fixed_clock, caplog):
    """Both are answered alike (the sender learns nothing); the operator reads which."""
    stale = await deliver(post, fixed_clock, paid_session(), age=301)
    wrong = await deliver(post, fixed_clock, paid_session(), secret="whsec_other")
    assert stale[:2] == wrong[:2] == REFUSED
    refusals = [r.getMessage() for r in caplog.records
                if "signature verification failed" in r.getMessage()]
    assert len(refusals) == 2
    assert "right secret, but 301 s ago" in refusals[0]
    assert "no secret in STRIPE_WEBHOOK_SECRET signs this body" in refusals[1]
    assert se.SECRET not in caplog.text and "whsec_other" not in caplog.text


@pytest.mark.gen_test
async def test_the_time_check_uses_real_time_when_the_clock_is_not_fixed(post, clock):
    FormationOrder.create(order_number="FO-1")
    raw = se.raw_of(paid_session())
    stale = {"Stripe-Signature": se.sign(raw, se.SECRET, int(time.time()) - 400)}
    assert (await post(se.CARD_URL, raw, stale))[:2] == REFUSED
    assert (await deliver(post, clock, raw=raw))[:2] == RECEIVED


@pytest.mark.gen_test
async def test_rotation_any_configured_secret_verifies(post, ctx, fixed_clock):
    ctx.settings = dataclasses.replace(ctx.settings,
                                       stripe_webhook_secrets=("whsec_old", "whsec_new"))
    for number, secret in enumerate(["whsec_old", "whsec_new"]):
        FormationOrder.create(order_number=f"FO-{number}")
        evt = paid_session(f"FO-{number}")
        assert (await deliver(post, fixed_clock, evt, secret=secret))[:2] == RECEIVED
    assert (await deliver(post, fixed_clock, paid_session(), secret=se.SECRET))[:2] == REFUSED
    assert FormationOrder.select().where(FormationOrder.payment_status == "paid").count() == 2


@pytest.mark.gen_test
async def test_a_header_with_one_signature_per_secret_verifies(post, fixed_clock):
    """During a rotation Stripe signs with each secret: t=..,v1=<old>,v1=<new>."""
    FormationOrder.create(order_number="FO-1")
    raw = se.raw_of(paid_session())
    t = int(fixed_clock().timestamp())
    other = se.sign(raw, "whsec_retired", t).split(",")[1]
    header = f"t={t},{other},{good_v1(raw, t)}"
    assert (await post(se.CARD_URL, raw, {"Stripe-Signature": header}))[:2] == RECEIVED


@pytest.mark.gen_test
async def test_raw_body_with_odd_whitespace_and_non_ascii_verifies_and_is_kept_as_sent(
        post, clock):
    FormationOrder.create(order_number="FO-1", customer_name="Zoë Ångström")
    evt = paid_session()
    evt["data"]["object"]["customer_details"]["name"] = "Zoë Ångström — 東京"
    raw = ("\r\n  " + json.dumps(evt, ensure_ascii=False, indent="\t",
                                 separators=(" ,", " :  ")) + " \n\n").encode("utf-8")
    assert (await deliver(post, clock, raw=raw))[:2] == RECEIVED
    stored = WebhookEvent.get()
    assert stored.payload.encode("utf-8") == raw
    assert stored.status == "processed" and FormationOrder.get().payment_status == "paid"


@pytest.mark.gen_test
async def test_a_body_that_is_not_utf8_cannot_be_verified(post, clock):
    raw = b'{"id": "evt_1", "type": "balance.available", "x": "\xff\xfe"}'
    assert (await deliver(post, clock, raw=raw))[:2] == REFUSED


@pytest.mark.gen_test
async def test_oversize_body_is_413(post, ctx, clock):
    raw = b" " * (ctx.settings.max_body_bytes + 1)
    status, reply, _ = await deliver(post, clock, raw=raw)
    assert (status, reply) == (413, {"error": "request body too large"})


# --- 4. handling ------------------------------------------------------------------------------

@pytest.mark.parametrize("raw,reason", [
    (b"not json at all", "not a JSON object"),
    (b"[1, 2, 3]", "not a JSON object"),
    (b'{"object": "event", "type": "balance.available"}', "no id"),
    (b'{"id": "evt_1", "object": "event"}', "no type"),
    (b'{"id": "evt_1", "type": "balance.available", "data": {}}', "no data.object"),
], ids=["text", "array", "no-id", "no-type", "no-object"])
@pytest.mark.gen_test
async def test_a_signed_body_that_is_not_a_stripe_event_is_kept_as_rejected(
        post, clock, raw, reason):
    """Signed by Stripe, so a retry would bring the same bytes: 200, kept for an operator."""
    assert (await deliver(post, clock, raw=raw))[:2] == RECEIVED
    assert (await deliver(post, clock, raw=raw))[:2] == RECEIVED
    [stored] = WebhookEvent.select()
    assert (stored.source, stored.status, stored.last_error) == ("card", "rejected", reason)
    assert stored.payload.encode() == raw


@pytest.mark.parametrize("where,reason", [
    ("id", "id too long"), ("type", "type too long"),
    ("object", "data.object.id too long"), ("order", "metadata.order_id too long")])
@pytest.mark.gen_test
async def test_a_signed_event_with_a_value_too_long_to_index_is_kept_as_rejected(
        post, clock, where, reason):
    evt = paid_session()
    long_value = "x" * 3000
    if where in ("id", "type"):
        evt[where] = long_value
    elif where == "object":
        evt["data"]["object"]["id"] = long_value
    else:
        evt["data"]["object"]["metadata"]["order_id"] = long_value
    assert (await deliver(post, clock, evt))[:2] == RECEIVED
    [stored] = WebhookEvent.select()
    assert (stored.status, stored.last_error, stored.order_number) == (
        "rejected", reason, None)


@pytest.mark.gen_test
async def test_an_event_with_odd_metadata_is_stored_and_handled_without_a_crash(post, clock):
    evt = paid_session()
    evt["data"]["object"]["metadata"] = "not a map"
    assert (await deliver(post, clock, evt))[:2] == RECEIVED
    stored = WebhookEvent.get()
    assert (stored.status, stored.order_number) == ("processed", None)


@pytest.mark.gen_test
async def test_an_unknown_event_type_is_stored_and_ignored(post, clock):
    evt = se.event("customer.created", {"id": "cus_test_1", "object": "customer"})
    assert (await deliver(post, clock, evt))[:2] == RECEIVED
    stored = WebhookEvent.get()
    assert (stored.event_type, stored.status, stored.external_id) == (
        "customer.created", "ignored", evt["id"])
    assert Outbox.select().count() == 0


@pytest.mark.gen_test
async def test_a_handling_error_is_answered_200_and_left_failed_for_retry(post, clock, telegram):
    FormationOrder.create(order_number="FO-ODD")
    evt = paid_session("FO-ODD")
    evt["data"]["object"]["amount_total"] = "not cents"
    assert (await deliver(post, clock, evt))[:2] == RECEIVED
    stored = WebhookEvent.get()
    assert stored.status == "failed" and stored.next_attempt_at is not None
    assert stored.last_error.startswith("ValueError")
    assert stored.order_number == "FO-ODD"
    assert FormationOrder.get().payment_status != "paid"
    assert telegram.requests == []


@pytest.mark.gen_test
async def test_a_checkout_for_an_order_not_stored_yet_waits_for_it(post, clock, telegram):
    """The shop sends its order after the customer paid: the session is kept, waiting
    for the order's number, never retried to its end and given up."""
    assert (await deliver(post, clock, paid_session("FO-NOT-YET")))[:2] == RECEIVED
    stored = WebhookEvent.get()
    assert (stored.status, stored.waiting_for) == ("waiting", "order:FO-NOT-YET")
    assert "no formation order FO-NOT-YET yet" in stored.last_error
    assert telegram.requests == []


@pytest.mark.gen_test
async def test_a_background_handling_error_is_answered_200_too(post, ctx, clock, smtp):
    evt = se.event("charge.dispute.created", se.dispute("pi_test_x"))
    evt["data"]["object"]["amount"] = "not cents"
    assert (await deliver(post, clock, evt))[:2] == RECEIVED
    await ctx.drain_background()
    stored = WebhookEvent.get()
    assert stored.status == "failed" and "ValueError" in stored.last_error
    assert smtp.messages == []


@pytest.mark.gen_test(timeout=15)
async def test_background_types_are_answered_before_they_are_handled(
        post, ctx, clock, frappe):
    clock.set(2026, 11, 25, 9, 0)
    CrtcOrder.create(order_number="CA-1", payment_status="paid", payment_method="card",
                     paid_at=clock() - datetime.timedelta(days=7))
    # Frappe answers only once let: the answer cannot have waited for the handling.
    frappe.hold = asyncio.Event()
    answer = await deliver(post, clock, se.event("balance.available", se.balance()))
    assert answer[:2] == RECEIVED
    assert CrtcOrder.get().funds_available is False
    frappe.hold.set()
    await ctx.drain_background()
    assert CrtcOrder.get().funds_available is True
    assert WebhookEvent.get().status == "processed"


@pytest.mark.gen_test
async def test_a_database_outage_is_acknowledged_from_the_spool_and_handled_once_back(
        post, ctx, db, clock, telegram):
    FormationOrder.create(order_number="FO-1")
    evt = paid_session()
    with database_down(db):
        assert (await deliver(post, clock, evt))[:2] == RECEIVED
        assert (await deliver(post, clock, evt))[:2] == RECEIVED
    assert FormationOrder.get().payment_status == "pending_payment"
    assert await inbox.drain_spool(ctx) == 2
    stored = WebhookEvent.get()
    assert (stored.external_id, stored.status) == (evt["id"], "processed")
    assert FormationOrder.get().payment_status == "paid" and len(telegram.requests) == 1


# --- duplicates -------------------------------------------------------------------------------

@pytest.mark.gen_test
async def test_a_redelivered_event_id_causes_nothing_more(post, clock, telegram):
    FormationOrder.create(order_number="FO-1")
    evt = paid_session()
    for _ in range(3):
        assert (await deliver(post, clock, evt))[:2] == RECEIVED
    assert WebhookEvent.select().count() == 1 and len(telegram.requests) == 1


@pytest.mark.gen_test
async def test_a_second_event_object_for_the_same_object_and_type_is_recognised(
        post, clock, telegram):
    FormationOrder.create(order_number="FO-1")
    first = paid_session(session_id="cs_test_same")
    second = se.event("checkout.session.completed", first["data"]["object"])
    assert first["id"] != second["id"]
    await deliver(post, clock, first)
    await deliver(post, clock, second)
    assert WebhookEvent.select().count() == 1 and len(telegram.requests) == 1


@pytest.mark.gen_test(timeout=20)
async def test_the_same_payment_ten_times_at_once_pays_and_alerts_once(post, clock, telegram):
    FormationOrder.create(order_number="FO-1")
    session = se.checkout_session("FO-1", "formation")
    copies = [se.event("checkout.session.completed", session) for _ in range(5)]
    answers = await asyncio.gather(*(deliver(post, clock, evt) for evt in copies * 2))
    assert [a[:2] for a in answers] == [RECEIVED] * 10
    order = FormationOrder.get()
    assert order.payment_status == "paid" and order.stripe_session_id == session["id"]
    assert len(telegram.requests) == 1
    assert Outbox.select().count() == 1 and WebhookEvent.select().count() == 1


@pytest.mark.gen_test(timeout=20)
async def test_the_same_failure_ten_times_at_once_fails_and_mails_once(post, ctx, clock, smtp):
    FormationOrder.create(order_number="FO-1", payment_status="pending_payment")
    intent = se.payment_intent("FO-1", "formation", status="requires_payment_method",
                               last_payment_error=se.card_declined())
    copies = [se.event("payment_intent.payment_failed", intent) for _ in range(5)]
    answers = await asyncio.gather(*(deliver(post, clock, evt) for evt in copies * 2))
    assert [a[:2] for a in answers] == [RECEIVED] * 10
    await ctx.drain_background()
    order = FormationOrder.get()
    assert order.payment_status == "failed" and order.notes.count("Payment failed") == 1
    assert len(smtp.messages) == 1


# --- the contract the backfill relies on --------------------------------------------------------

def test_a_type_that_happens_once_per_object_is_one_fact_per_object(ctx):
    session = paid_session(session_id="cs_test_k")
    assert card_events.fact_key(ctx, session) == "checkout.session.completed:cs_test_k"
    balance = se.event("balance.available", se.balance(), event_id="evt_b")
    assert card_events.fact_key(ctx, balance) == "evt_b"


def test_each_failed_attempt_of_an_invoice_is_a_fact_of_its_own(ctx):
    first = se.event("invoice.payment_failed", se.invoice("sub_1", invoice_id="in_1"))
    second = se.event("invoice.payment_failed",
                      se.invoice("sub_1", invoice_id="in_1", attempt_count=2))
    assert card_events.fact_key(ctx, first) == "invoice.payment_failed:in_1:1"
    assert card_events.fact_key(ctx, second) == "invoice.payment_failed:in_1:2"


@pytest.mark.gen_test
async def test_accept_stores_and_handles_an_event_given_directly(ctx, telegram):
    FormationOrder.create(order_number="FO-1")
    evt = paid_session()
    raw = json.dumps(evt).encode()
    await card_events.accept(ctx, evt, raw)
    await card_events.accept(ctx, evt, raw)
    stored = WebhookEvent.get()
    assert (stored.source, stored.event_type, stored.external_id, stored.status) == (
        "card", "checkout.session.completed", evt["id"], "processed")
    assert FormationOrder.get().payment_status == "paid" and len(telegram.requests) == 1
