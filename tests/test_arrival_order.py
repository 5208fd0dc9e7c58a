"""Arrival order survives an outage (issue 24, part 2): while calls wait in the spool, a
new call joins them there, so it is handled after them, not before. The service itself,
started with its database down: tests/test_faults.py."""
import asyncio
import os

import pytest

from models import ComplianceOrder, WebhookEvent
from engine import inbox, spool
from tests.conftest import WEBHOOK_SECRET
from tests.service_process import database_down

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
ORDER = {"order_name": "ORD-2026-0042", "order_number": "FO-10042"}


def webhook(path):
    return f"/api/v1/webhooks/{path}"


@pytest.mark.gen_test
async def test_a_live_call_after_a_spooled_one_of_its_order_is_handled_after_it(
        post, db, ctx, worker, frappe):
    with database_down(db):
        status, _, _ = await post(webhook("formation/submitted"),
                                  {**ORDER, "state_code": "WY", "entity_name": "Acme LLC"},
                                  AUTH)
    assert status == 200
    # The database answers again; the drain has not run yet.
    status, reply, _ = await post(webhook("formation/name-available"), ORDER, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "filing_dispatched"})
    assert frappe.requests == [] and worker.requests == []

    assert await inbox.drain_spool(ctx) == 2
    assert [r.json["action"] for r in frappe.requests] == ["Start Name Check", "Start Filing"]
    assert [r.json["action"] for r in worker.requests] == ["name_search", "file_entity"]
    assert {event.status for event in WebhookEvent.select()} == {"processed"}

    # Nothing waits now: a call goes straight to the database again.
    status, _, _ = await post(webhook("formation/ready"), ORDER, AUTH)
    assert status == 200 and [r.json["action"] for r in worker.requests][-1] == "deliver"


@pytest.mark.gen_test
async def test_a_fulfilment_report_after_a_spooled_one_is_not_refused_for_coming_first(
        post, db, ctx, smtp):
    ComplianceOrder.create(order_number="CO-1", customer_email="ada@example.test",
                           customer_name="Ada", service_name="IFTA filing",
                           fulfillment_status="awaiting_secure_credentials")

    async def report(status):
        return await post(webhook(f"fulfillment/{status}"), {"order_number": "CO-1"},
                          {**AUTH, "Idempotency-Key": f"move-{status}"})
    with database_down(db):
        status, _, _ = await report("ready_to_file")
    assert status == 200
    status, reply, _ = await report("filed_waiting_state")
    assert (status, reply) == (200, {"received": True,
                                     "action": "fulfillment_status_recorded"})

    assert await inbox.drain_spool(ctx) == 2
    assert ComplianceOrder.get().fulfillment_status == "filed_waiting_state"
    assert [(e.event_type, e.status) for e in WebhookEvent.select().order_by(WebhookEvent.id)] \
        == [("fulfillment/ready_to_file", "processed"),
            ("fulfillment/filed_waiting_state", "processed")]
    assert len(smtp.messages) == 1  # the approval request of ready_to_file


@pytest.mark.gen_test
async def test_a_call_that_comes_while_the_spool_drains_waits_behind_it(
        post, db, ctx, worker):
    with database_down(db):
        await post(webhook("formation/ready"), {**ORDER, "order_number": "FO-1"}, AUTH)
    # The worker holds the first job's answer: the drain is handling the spooled call.
    worker.hold = asyncio.Event()
    draining = asyncio.ensure_future(inbox.drain_spool(ctx))
    while not worker.requests:
        await asyncio.sleep(0.01)
    status, _, _ = await post(webhook("formation/ready"), {**ORDER, "order_number": "FO-2"},
                              AUTH)
    assert status == 200 and WebhookEvent.select().count() == 1
    worker.hold.set()
    assert await draining == 2
    assert [r.json["order_number"] for r in worker.requests] == ["FO-1", "FO-2"]


@pytest.mark.gen_test
async def test_a_spool_that_holds_calls_but_cannot_take_more_lets_a_call_reach_the_database(
        post, ctx, worker, caplog):
    # The live file's name is taken by a directory: the spool holds "calls" it can
    # neither drain nor append to. Refusing every call would stop the service; the call
    # goes to the database instead, and the log says it went ahead.
    os.makedirs(os.path.join(ctx.settings.spool_dir, spool.LIVE_NAME))
    status, _, _ = await post(webhook("formation/ready"), ORDER, AUTH)
    assert status == 200
    assert [e.status for e in WebhookEvent.select()] == ["processed"]
    assert len(worker.requests) == 1
    assert "this call goes to the database, ahead of them" in caplog.text
