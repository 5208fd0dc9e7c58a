"""BEHAVIOUR.md 4.1: the twenty workflow-system webhooks, against real peers on loopback."""
import asyncio
import base64
import dataclasses
import datetime
import hashlib
import hmac
import json

import pytest

from models import ComplianceOrder, CrtcOrder, Outbox, WebhookEvent
from domain import fulfillment
from plugins import registries
from tests.conftest import WEBHOOK_SECRET, table_away
from tests.service_process import database_down
from tests.waits import eventually

ORDER = {"order_name": "ORD-2026-0042", "order_number": "FO-10042"}
AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}

# BEHAVIOUR.md 4.1, row by row: path, extra body fields, workflow action, job, extra job
# fields, answer.
SPEC_TABLE = [
    ("formation/submitted", {"state_code": "WY", "entity_name": "Acme Holdings LLC"},
     "Start Name Check", "name_search", {}, "name_search_dispatched"),
    ("formation/name-available", {}, "Start Filing", "file_entity", {}, "filing_dispatched"),
    ("formation/filed-needs-ein", {}, "Start EIN", "obtain_ein", {}, "ein_dispatched"),
    ("formation/filed-skip-ein", {}, "Skip EIN", "generate_docs", {}, "doc_gen_dispatched"),
    ("formation/ein-obtained", {}, "Generate Docs", "generate_docs", {}, "doc_gen_dispatched"),
    ("formation/approved", {}, "Mark Ready", None, {}, "marked_ready"),
    ("formation/ready", {}, None, "deliver", {}, "delivery_dispatched"),
    ("service/queued", {"service_slug": "boi-report"}, None, "process_compliance_service",
     {}, "service_processing_dispatched"),
    ("service/approved", {}, None, "deliver", {}, "delivery_dispatched"),
    ("crtc/awaiting-funds", {}, None, "register_awaiting_funds",
     {"order_type": "canada_crtc"}, "registered_awaiting_funds"),
    ("crtc/funds-available", {}, None, "file_bc_incorporation", {}, "incorporation_dispatched"),
    ("crtc/incorporated", {"incorporation_number": "BC1234567"}, None, "generate_crtc_docs",
     {}, "crtc_docs_dispatched"),
    ("crtc/ready-for-review", {}, None, "notify_admin_review", {"order_type": "canada_crtc"},
     "admin_notified"),
    ("crtc/approved", {}, None, "ship_binder", {}, "shipping_dispatched"),
    ("crtc/delivered", {}, None, "mark_delivered", {"order_type": "canada_crtc"},
     "delivery_recorded"),
    ("crtc/domain-ready", {}, None, None, {}, "domain_ready_acknowledged"),
    ("crtc/phone-ready", {}, None, None, {}, "phone_ready_acknowledged"),
    ("crtc/banking-ready", {}, None, None, {}, "banking_ready_acknowledged"),
    ("crtc/bits-filed", {}, None, None, {}, "bits_filed_acknowledged"),
    ("crtc/ccts-ready", {}, None, None, {}, "ccts_ready_acknowledged"),
]


def url(path):
    return f"/api/v1/webhooks/{path}"


def test_every_path_of_the_spec_has_exactly_one_plugin():
    fulfillment_reports = [f"fulfillment/{status}" for status in fulfillment.STATES]
    assert registries()["workflow"].keys() == sorted(
        [row[0] for row in SPEC_TABLE] + fulfillment_reports)
    assert len(SPEC_TABLE) == 20


@pytest.mark.parametrize("path,extra,action,job,constants,answer", SPEC_TABLE,
                         ids=[row[0] for row in SPEC_TABLE])
@pytest.mark.gen_test
async def test_webhook_applies_action_dispatches_job_and_answers(
        post, worker, frappe, path, extra, action, job, constants, answer):
    if path == "crtc/delivered":  # its holdback is recorded on the order (test_holdback.py)
        CrtcOrder.create(order_number=ORDER["order_number"])
    body = {**ORDER, **extra}
    status, reply, response = await post(url(path), body, AUTH)

    assert (status, reply) == (200, {"received": True, "action": answer})
    assert response.headers["Content-Type"].startswith("application/json")

    if job:
        [request] = worker.requests
        assert (request.method, request.path) == ("POST", "/jobs")
        assert request.headers["Content-Type"] == "application/json"
        assert request.json == {"action": job, **body, **constants}
        assert len(request.headers["Idempotency-Key"]) >= 16
    else:
        assert worker.requests == []

    if action:
        [request] = frappe.requests
        assert (request.method, request.path) == (
            "POST", "/api/method/frappe.model.workflow.apply_workflow")
        assert request.headers["Authorization"] == "token wf-key:wf-secret"
        assert request.headers["X-Frappe-Site-Name"] == "erp.example.test"
        assert request.headers["X-Workflow-Site-Name"] == "erp.example.test"
        assert request.json == {
            "cmd": "frappe.model.workflow.apply_workflow",
            "doc": json.dumps({"doctype": "Formation Order", "name": ORDER["order_name"]}),
            "action": action,
        }
    else:
        assert frappe.requests == []

    [event] = WebhookEvent.select()
    assert (event.source, event.event_type, event.status) == ("workflow", path, "processed")
    assert event.order_number == ORDER["order_number"]
    assert [row.status for row in Outbox.select()] == ["sent"] * (bool(job) + bool(action))


@pytest.mark.parametrize("headers", [
    {}, {"X-Webhook-Secret": "wrong"}, {"X-Webhook-Secret": WEBHOOK_SECRET + "x"},
    {"X-Webhook-Secret": ""}, {"x-webhook-secret": WEBHOOK_SECRET[:-1]},
], ids=["missing", "wrong", "longer", "empty", "prefix"])
@pytest.mark.gen_test
async def test_wrong_or_missing_secret_is_401_and_nothing_happens(post, worker, frappe, headers):
    status, reply, _ = await post(url("formation/submitted"),
                                  {**ORDER, "state_code": "WY", "entity_name": "Acme"}, headers)
    assert (status, reply) == (401, {"error": "Unauthorized"})
    assert worker.requests == [] and frappe.requests == []
    assert WebhookEvent.select().count() == 0 and Outbox.select().count() == 0


@pytest.mark.parametrize("headers,why", [
    ({}, "no X-Webhook-Secret"),
    ({"X-Webhook-Secret": "wrong-secret-value"}, "X-Webhook-Secret does not match WEBHOOK_SECRET"),
], ids=["missing", "wrong"])
@pytest.mark.gen_test
async def test_a_refused_secret_is_logged_with_its_reason_not_its_value(
        post, caplog, headers, why):
    assert (await post(url("formation/ready"), ORDER, headers))[0] == 401
    assert refusals_logged(caplog, why) == 1
    assert "wrong-secret-value" not in caplog.text and WEBHOOK_SECRET not in caplog.text


def refusals_logged(caplog, why):
    """How many WARNING lines name the path, the sender's address and `why`."""
    return sum(r.levelname == "WARNING" and why in r.getMessage()
               and "/api/v1/webhooks/formation/ready" in r.getMessage()
               and "127.0.0.1" in r.getMessage() for r in caplog.records)


@pytest.mark.gen_test
async def test_a_body_that_is_not_json_is_logged_as_the_reason_of_its_400(post, caplog):
    assert (await post(url("formation/ready"), b"order_name=FO-1", AUTH))[0] == 400
    assert refusals_logged(caplog, "invalid JSON body") == 1


@pytest.mark.gen_test
async def test_auth_is_checked_before_the_body(post):
    status, reply, _ = await post(url("formation/ready"), b"not json", {})
    assert (status, reply) == (401, {"error": "Unauthorized"})


@pytest.mark.parametrize("raw", [
    b"", b"not json", b'{"order_name": ', b"[1, 2]", b'"a string"', b"null", b"\xff\xfe",
], ids=["empty", "text", "truncated", "array", "string", "null", "not-utf8"])
@pytest.mark.gen_test
async def test_body_that_is_not_a_json_object_is_400(post, worker, raw):
    status, reply, _ = await post(url("formation/ready"), raw, AUTH)
    assert (status, reply) == (400, {"error": "invalid JSON body"})
    assert worker.requests == [] and WebhookEvent.select().count() == 0


@pytest.mark.parametrize("path,body,field", [
    ("formation/ready", {"order_number": "FO-1"}, "order_name"),
    ("formation/ready", {"order_name": "FO-1"}, "order_number"),
    ("formation/ready", {"order_name": "", "order_number": "FO-1"}, "order_name"),
    ("formation/ready", {"order_name": "  ", "order_number": "FO-1"}, "order_name"),
    ("formation/ready", {"order_name": "FO-1", "order_number": None}, "order_number"),
    ("formation/submitted", {**ORDER, "entity_name": "Acme"}, "state_code"),
    ("formation/submitted", {**ORDER, "state_code": "WY"}, "entity_name"),
    ("crtc/incorporated", ORDER, "incorporation_number"),
    ("formation/ready", {}, "order_name"),
])
@pytest.mark.gen_test
async def test_missing_field_is_400_naming_the_first_one(post, worker, path, body, field):
    status, reply, _ = await post(url(path), body, AUTH)
    assert (status, reply) == (400, {"error": f"missing field: {field}"})
    assert worker.requests == [] and WebhookEvent.select().count() == 0


@pytest.mark.parametrize("value", [10042, 10042.0, True, ["FO-1"], {"n": "FO-1"}],
                         ids=["integer", "float", "boolean", "list", "object"])
@pytest.mark.gen_test
async def test_a_field_of_another_type_is_400_saying_it_must_be_a_string(
        post, worker, caplog, value):
    """A Frappe template that writes {{ doc.order_number }} unquoted sends a number."""
    status, reply, _ = await post(url("formation/ready"), {**ORDER, "order_number": value},
                                  AUTH)
    assert (status, reply) == (400, {"error": "order_number must be a string"})
    assert worker.requests == [] and WebhookEvent.select().count() == 0
    assert refusals_logged(caplog, "order_number must be a string") == 1


@pytest.mark.parametrize("raw,field", [
    (b'{"order_name": "A\\u0000", "order_number": "FO-1"}', "order_name"),
    (b'{"order_name": "A", "order_number": "FO-1\\u0000"}', "order_number"),
    (b'{"order_name": "A", "order_number": "FO-1\\n2"}', "order_number"),
], ids=["nul-name", "nul-number", "newline"])
@pytest.mark.gen_test
async def test_control_characters_in_a_field_are_400(post, worker, raw, field):
    status, reply, _ = await post(url("crtc/approved"), raw, AUTH)
    assert (status, reply) == (400, {"error": f"invalid field: {field}"})
    assert worker.requests == [] and WebhookEvent.select().count() == 0


@pytest.mark.parametrize("path", ["formation/unknown", "crtc/ready", "nothing/here"])
@pytest.mark.gen_test
async def test_unknown_path_is_404(post, path):
    status, reply, _ = await post(url(path), ORDER, AUTH)
    assert (status, reply) == (404, {"error": "not found"})


@pytest.mark.gen_test
async def test_get_on_a_webhook_is_405(http_client, base_url):
    response = await http_client.fetch(base_url + url("formation/ready"), raise_error=False)
    assert response.code == 405
    assert json.loads(response.body) == {"error": "method not allowed"}


@pytest.mark.gen_test
async def test_oversize_body_is_413_without_being_stored(post, ctx, worker):
    padding = "x" * (ctx.settings.max_body_bytes + 1)
    status, reply, _ = await post(url("formation/ready"), {**ORDER, "pad": padding}, AUTH)
    assert (status, reply) == (413, {"error": "request body too large"})
    assert WebhookEvent.select().count() == 0 and worker.requests == []


# --- service/queued: BEHAVIOUR.md 4.1 rule 1 -------------------------------------------------

async def queued(post, worker, body):
    status, reply, _ = await post(url("service/queued"), body, AUTH)
    assert (status, reply) == (200, {"received": True,
                                     "action": "service_processing_dispatched"})
    [request] = worker.requests
    return request.json["service_slug"]


@pytest.mark.gen_test
async def test_service_slug_given_is_passed_on(post, worker):
    ComplianceOrder.create(order_number=ORDER["order_number"], service_slug="from-db")
    assert await queued(post, worker, {**ORDER, "service_slug": "given"}) == "given"


@pytest.mark.parametrize("body_slug", [None, ""], ids=["absent", "empty"])
@pytest.mark.gen_test
async def test_service_slug_absent_is_looked_up_by_order_number(post, worker, body_slug):
    ComplianceOrder.create(order_number=ORDER["order_number"], service_slug="annual-report")
    ComplianceOrder.create(order_number="CO-OTHER", service_slug="other")
    body = dict(ORDER) if body_slug is None else {**ORDER, "service_slug": body_slug}
    assert await queued(post, worker, body) == "annual-report"


@pytest.mark.gen_test
async def test_service_slug_of_an_unknown_order_is_empty_and_the_job_still_goes(post, worker):
    assert await queued(post, worker, ORDER) == ""


@pytest.mark.gen_test
async def test_service_slug_lookup_failure_is_empty_and_the_job_still_goes(post, worker, db):
    with table_away(db, "compliance_orders"):
        assert await queued(post, worker, ORDER) == ""
    [event] = WebhookEvent.select()
    assert event.status == "processed"


# --- downstream failures never change the answer ----------------------------------------

SUBMITTED = {**ORDER, "state_code": "WY", "entity_name": "Acme Holdings LLC"}


def frappe_body(body):
    """The bytes current Frappe sends and stores for its retries (frappe.as_json)."""
    return json.dumps(body, indent=1, sort_keys=True, separators=(",", ": ")).encode()


# Frappe's own headers: the Webhook Headers table only, no Content-Type.
FRAPPE_HEADERS = {"X-Webhook-Secret": WEBHOOK_SECRET}


@pytest.mark.gen_test
async def test_worker_down_still_answers_and_keeps_the_job_pending(post, worker, frappe):
    worker.stop()
    status, reply, _ = await post(url("formation/submitted"), SUBMITTED, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "name_search_dispatched"})
    job = Outbox.get(Outbox.kind == "job")
    assert (job.status, job.attempts) == ("pending", 1)
    assert "connect" in job.last_error.lower() or "refused" in job.last_error.lower()
    assert json.loads(job.payload) == {"action": "name_search", "payload": SUBMITTED}
    assert Outbox.get(Outbox.kind == "workflow_action").status == "sent"


@pytest.mark.gen_test
async def test_worker_500_still_answers_and_keeps_the_job_for_retry(post, worker, clock):
    worker.fail_with(500)
    clock.set(2026, 11, 23, 9, 0, 0)
    status, reply, _ = await post(url("formation/ready"), ORDER, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "delivery_dispatched"})
    job = Outbox.get(Outbox.kind == "job")
    assert (job.status, job.attempts) == ("pending", 1)
    assert job.last_error.startswith("HTTP 500")
    assert job.next_attempt_at > clock()


@pytest.mark.gen_test
async def test_worker_refusing_with_400_parks_the_job_dead(post, worker):
    worker.fail_with(400, {"error": "unknown action"})
    status, _, _ = await post(url("formation/ready"), ORDER, AUTH)
    assert status == 200
    job = Outbox.get(Outbox.kind == "job")
    assert (job.status, job.attempts) == ("dead", 1)


@pytest.mark.gen_test
async def test_worker_answering_2xx_that_is_not_json_has_the_job(post, worker, caplog):
    # The status is the worker's word that it took the job; sending it again would only
    # run it twice (tests/test_outbox_destinations.py has the other shapes).
    worker.body = b"<html>job queued</html>"
    status, _, _ = await post(url("formation/ready"), ORDER, AUTH)
    assert status == 200
    job = Outbox.get(Outbox.kind == "job")
    assert job.status == "sent" and len(worker.requests) == 1
    assert "worker answered HTTP 200 with a reply that is not JSON" in caplog.text


@pytest.mark.gen_test
async def test_frappe_417_is_final_and_the_webhook_still_answers(post, worker, frappe):
    frappe.fail_with(417, {"exc_type": "WorkflowTransitionError",
                           "exception": "Not a valid Workflow Action"})
    status, reply, _ = await post(url("formation/submitted"), SUBMITTED, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "name_search_dispatched"})
    action = Outbox.get(Outbox.kind == "workflow_action")
    assert (action.status, action.attempts) == ("dead", 1)
    assert action.last_error.startswith("HTTP 417")
    assert Outbox.get(Outbox.kind == "job").status == "sent"


@pytest.mark.gen_test
async def test_frappe_down_still_answers(post, worker, frappe):
    frappe.stop()
    status, reply, _ = await post(url("formation/approved"), ORDER, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "marked_ready"})
    assert Outbox.get(Outbox.kind == "workflow_action").status == "pending"


@pytest.mark.gen_test(timeout=20)
async def test_a_slow_worker_does_not_delay_other_requests(post, worker):
    """The worker holds twelve jobs unanswered while a request with no job comes: it is
    answered all the same (were it to wait behind them, it would never be)."""
    worker.hold = asyncio.Event()
    slow = [asyncio.ensure_future(post(url("formation/ready"),
                                       {**ORDER, "order_number": f"FO-{n}"}, AUTH))
            for n in range(12)]
    await eventually(lambda: worker.in_flight == 12, interval=0.01)
    status, reply, _ = await post(url("crtc/domain-ready"), ORDER, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "domain_ready_acknowledged"})
    assert worker.in_flight == 12
    worker.hold.set()
    results = await asyncio.gather(*slow)
    assert [r[0] for r in results] == [200] * 12
    assert Outbox.select().where(Outbox.status == "sent").count() == 12


@pytest.mark.gen_test(timeout=20)
async def test_the_answer_comes_within_the_budget_and_the_slow_job_is_sent_after(
        post, worker, frappe, ctx):
    """Frappe waits 5 s for an answer; a worker slower than the budget does not hold it."""
    ctx.settings = dataclasses.replace(ctx.settings, workflow_answer_budget_seconds=0.2)
    worker.hold = asyncio.Event()
    raw = frappe_body(SUBMITTED)
    status, reply, _ = await post(url("formation/submitted"), raw, FRAPPE_HEADERS)
    assert (status, reply) == (200, {"received": True, "action": "name_search_dispatched"})
    # Answered while the worker had the job and had not answered it yet.
    assert len(worker.requests) == 1 and not worker.hold.is_set()
    job = Outbox.get(Outbox.kind == "job")
    assert (job.status, job.attempts, job.last_error) == ("pending", 0, None)
    assert Outbox.get(Outbox.kind == "workflow_action").status == "sent"

    worker.hold.set()
    await ctx.drain_background()
    job = Outbox.get(Outbox.kind == "job")
    assert (job.status, job.attempts) == ("sent", 1)
    assert WebhookEvent.get().status == "processed"


@pytest.mark.gen_test(timeout=20)
async def test_a_worker_slower_than_the_timeout_leaves_the_job_pending(post, worker, ctx):
    worker.delay = ctx.settings.outbound_timeout_seconds + 2
    status, reply, _ = await post(url("formation/ready"), ORDER, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "delivery_dispatched"})
    job = Outbox.get(Outbox.kind == "job")
    assert job.status == "pending" and "timeout" in job.last_error.lower()


# --- deliveries and duplicates -----------------------------------------------------------

@pytest.mark.gen_test
async def test_a_redelivery_of_the_same_call_is_acknowledged_once_and_acted_on_once(
        post, worker, frappe):
    answers = await asyncio.gather(*(post(url("formation/submitted"), SUBMITTED, AUTH)
                                     for _ in range(5)))
    assert {(a[0], json.dumps(a[1])) for a in answers} == {
        (200, json.dumps({"received": True, "action": "name_search_dispatched"}))}
    assert len(worker.requests) == 1 and len(frappe.requests) == 1
    assert WebhookEvent.select().count() == 1


# When current Frappe re-sends a failed delivery, counted from the first attempt: after
# 5 min, 30 min, 2 h, 5 h, 10 h and 10 h (each up to 5 min late: its scheduler's tick).
FRAPPE_RETRIES_AFTER = [5, 35, 155, 455, 1055, 1655]


@pytest.mark.parametrize("first_at", [(9, 0, 0), (9, 59, 59)], ids=["hour-start", "hour-end"])
@pytest.mark.gen_test
async def test_frappes_retries_within_the_window_dispatch_nothing_twice(
        post, worker, frappe, clock, first_at):
    clock.set(2026, 11, 23, *first_at)
    first = clock()
    raw = frappe_body({**SUBMITTED, "workflow_state": "Name Check"})
    assert (await post(url("formation/submitted"), raw, FRAPPE_HEADERS))[0] == 200
    for minutes in [*FRAPPE_RETRIES_AFTER, 1650, 36 * 60 - 1]:
        clock.fixed = first + datetime.timedelta(minutes=minutes)
        status, reply, _ = await post(url("formation/submitted"), raw, FRAPPE_HEADERS)
        assert (status, reply) == (200, {"received": True, "action": "name_search_dispatched"})
    assert len(worker.requests) == 1 and len(frappe.requests) == 1
    assert WebhookEvent.select().count() == 1

    clock.fixed = first + datetime.timedelta(hours=37)
    await post(url("formation/submitted"), raw, FRAPPE_HEADERS)
    assert len(worker.requests) == 2 and WebhookEvent.select().count() == 2
    assert len({r.headers["Idempotency-Key"] for r in worker.requests}) == 2


@pytest.mark.gen_test
async def test_the_dedup_window_follows_its_setting(post, worker, ctx, clock):
    ctx.settings = dataclasses.replace(ctx.settings, workflow_dedup_hours=2)
    clock.set(2026, 11, 23, 9, 30, 0)
    await post(url("formation/ready"), ORDER, AUTH)
    clock.advance(hours=1, minutes=59)
    await post(url("formation/ready"), ORDER, AUTH)
    assert len(worker.requests) == 1
    clock.advance(hours=1, minutes=2)
    await post(url("formation/ready"), ORDER, AUTH)
    assert len(worker.requests) == 2


# Hour 1,000,000 since the epoch begins on 2084-01-29 at 16:00 UTC. A window whose hours
# have as many digits is looked up as one range of keys; one that spans the change, key
# by key.
@pytest.mark.parametrize("first_at, hours_in_window", [
    ((2084, 1, 29, 6, 30), (9, 10, 15, 36)),  # hour 999,990: a range, then keys
    ((2084, 1, 29, 16, 10), (1, 35, 36)),  # hour 1,000,000: keys, then a range of 7 digits
], ids=["six-digit-hours", "seven-digit-hours"])
@pytest.mark.gen_test
async def test_the_dedup_window_holds_where_the_hours_gain_a_digit(
        post, worker, clock, first_at, hours_in_window):
    clock.set(*first_at, 0)
    first = clock()
    other = {**ORDER, "order_number": "FO-10043"}
    await post(url("formation/ready"), ORDER, AUTH)
    for hours in hours_in_window:
        clock.fixed = first + datetime.timedelta(hours=hours)
        await post(url("formation/ready"), ORDER, AUTH)
        await post(url("formation/ready"), other, AUTH)
        assert len(worker.requests) == 2  # the other body's first copy, once
    clock.fixed = first + datetime.timedelta(hours=37)
    await post(url("formation/ready"), ORDER, AUTH)
    assert len(worker.requests) == 3


@pytest.mark.gen_test
async def test_an_idempotency_key_header_decides_what_is_a_duplicate(post, worker, clock):
    await post(url("formation/ready"), ORDER, {**AUTH, "Idempotency-Key": "fire-1"})
    await post(url("formation/ready"), ORDER, {**AUTH, "Idempotency-Key": "fire-1"})
    await post(url("formation/ready"), ORDER, {**AUTH, "Idempotency-Key": "fire-2"})
    assert len(worker.requests) == 2
    # The key alone decides: the same key long after the window is still the same call.
    clock.advance(hours=48)
    await post(url("formation/ready"), ORDER, {**AUTH, "Idempotency-Key": "fire-1"})
    assert len(worker.requests) == 2


# --- the optional Frappe signature -------------------------------------------------------

def frappe_signature(secret, raw):
    return base64.b64encode(hmac.new(secret.encode(), raw, hashlib.sha256).digest()).decode()


@pytest.fixture
def signing_secret(ctx):
    ctx.settings = ctx.settings.__class__(**{**ctx.settings.__dict__,
                                             "workflow_webhook_signing_secret": "frappe-sign"})
    return "frappe-sign"


@pytest.mark.gen_test
async def test_frappe_signature_is_verified_when_configured(
        post, worker, signing_secret, caplog):
    raw = json.dumps(ORDER).encode()
    good = {**AUTH, "X-Frappe-Webhook-Signature": frappe_signature(signing_secret, raw)}
    bad = {**AUTH, "X-Frappe-Webhook-Signature": frappe_signature("other", raw)}
    assert (await post(url("formation/ready"), raw, bad))[:2] == (401, {"error": "Unauthorized"})
    assert (await post(url("formation/ready"), raw, AUTH))[:2] == (401, {"error": "Unauthorized"})
    assert "X-Frappe-Webhook-Signature does not sign the body with " in caplog.text
    assert "no X-Frappe-Webhook-Signature (WORKFLOW_WEBHOOK_SIGNING_SECRET is set)" in caplog.text
    assert signing_secret not in caplog.text
    status, reply, _ = await post(url("formation/ready"), raw, good)
    assert (status, reply) == (200, {"received": True, "action": "delivery_dispatched"})
    assert len(worker.requests) == 1


# --- database down -----------------------------------------------------------------------

@pytest.mark.gen_test
async def test_database_and_spool_down_is_not_acknowledged_as_received(post, worker, db, ctx):
    ctx.settings = dataclasses.replace(ctx.settings, spool_dir="/dev/null/spool")
    with database_down(db):
        status, reply, _ = await post(url("formation/ready"), ORDER, AUTH)
    assert status == 503 and reply == {"error": "temporarily unavailable"}
    assert worker.requests == []


@pytest.mark.gen_test
async def test_a_form_url_encoded_frappe_webhook_is_read_as_the_json_it_is(post, worker):
    """Frappe's "Form URL-Encoded" structure sends a JSON object built from the Data
    table, serialised as frappe.as_json does (indent 1, sorted keys), with no Content-Type
    of its own; a client that adds one sends the form type."""
    raw = json.dumps({"modified": "2026-11-20 09:00:12.123456", **ORDER}, indent=1,
                     sort_keys=True, separators=(",", ": ")).encode()
    headers = {"X-Webhook-Secret": WEBHOOK_SECRET,
               "Content-Type": "application/x-www-form-urlencoded"}
    status, reply, _ = await post(url("formation/ready"), raw, headers)
    assert (status, reply) == (200, {"received": True, "action": "delivery_dispatched"})
    assert worker.requests[0].json["order_number"] == ORDER["order_number"]
