"""The sender's order, the inbox's invariant: an event is handed to its plugin only once
every event placed before it in its stream is finished, whatever went before it (a
failure, a spool that holds calls, a full spool disk). The same under a killed or cut
drain and two processes:
tests/test_arrival_order_faults.py; over every ordering: tests/test_arrival_order_property.py."""
import asyncio
import dataclasses
import datetime
import os
import zoneinfo

import pytest

from models import ComplianceOrder, WebhookEvent
from engine import inbox, outbox, spool
from engine.claims import lease
from ops import operator
from tests import shkeeper, stripe_events as se
from tests.conftest import WEBHOOK_SECRET
from tests.service_process import database_down
from tests.waits import eventually

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
    # The database answers again; the drain has not run yet: the call joins the spool,
    # and its answer promises nothing yet.
    status, reply, _ = await post(webhook("formation/name-available"), ORDER, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "queued"})
    assert frappe.requests == [] and worker.requests == []

    assert await inbox.drain_spool(ctx) == 2
    assert [r.json["action"] for r in frappe.requests] == ["Start Name Check", "Start Filing"]
    assert [r.json["action"] for r in worker.requests] == ["name_search", "file_entity"]
    assert {event.status for event in WebhookEvent.select()} == {"processed"}

    # Nothing waits now: a call goes straight to the database again.
    status, _, _ = await post(webhook("formation/ready"), ORDER, AUTH)
    assert status == 200 and [r.json["action"] for r in worker.requests][-1] == "deliver"


STEPS = [("formation/submitted", {"state_code": "WY", "entity_name": "Acme LLC"},
          "Start Name Check", "name_search"),
         ("formation/name-available", {}, "Start Filing", "file_entity"),
         ("formation/filed-needs-ein", {}, "Start EIN", "obtain_ein")]


def frappe_modified(seconds_ago):
    """A `modified` as Frappe v15 writes it: naive text in the site's time zone
    (Asia/Kolkata on a site whose System Settings name none), with microseconds."""
    moment = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
        seconds=seconds_ago)
    return moment.astimezone(zoneinfo.ZoneInfo("Asia/Kolkata")).strftime(
        "%Y-%m-%d %H:%M:%S.%f")


@pytest.mark.gen_test
@pytest.mark.parametrize("arrival", ["in the document's order", "last step first"])
async def test_steps_spooled_in_an_outage_are_each_handled_in_the_documents_order(
        post, db, ctx, worker, frappe, smtp, arrival):
    """Three steps of one document sent during a database cut, each naming its save
    (`modified`): each is answered `queued` (it is spooled: its action is not sent yet),
    and once the spool drains each is handled, in the order of its save, however they
    came. (The drain once took the last step stored for a handled newer change and
    dropped the other two as older.)"""
    steps = [(path, {**ORDER, **extra, "modified": frappe_modified(3 - n)})
             for n, (path, extra, _, _) in enumerate(STEPS)]
    with database_down(db):
        for path, body in (steps if arrival == "in the document's order" else
                           [steps[2], steps[0], steps[1]]):
            status, reply, _ = await post(webhook(path), body, AUTH)
            assert (status, reply) == (200, {"received": True, "action": "queued"})
    assert frappe.requests == [] and worker.requests == []

    assert await inbox.drain_spool(ctx) == 3
    assert [r.json["action"] for r in frappe.requests] == [step[2] for step in STEPS]
    assert [r.json["action"] for r in worker.requests] == [step[3] for step in STEPS]
    assert {event.status for event in WebhookEvent.select()} == {"processed"}
    await outbox.send_due(ctx)
    assert smtp.messages == []


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
    assert (status, reply) == (200, {"received": True, "action": "queued"})

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
    await eventually(lambda: worker.requests, interval=0.01)
    status, _, _ = await post(webhook("formation/ready"), {**ORDER, "order_number": "FO-2"},
                              AUTH)
    assert status == 200 and WebhookEvent.select().count() == 1
    worker.hold.set()
    assert await draining == 2
    assert [r.json["order_number"] for r in worker.requests] == ["FO-1", "FO-2"]


@pytest.mark.gen_test
async def test_a_spool_that_holds_calls_but_cannot_take_more_stores_a_call_and_holds_it(
        post, ctx, clock, worker, caplog):
    # The live file's name is taken by a directory: the spool holds "calls" it can
    # neither drain nor append to. Refusing every call would stop the service; the call
    # is stored instead, and handled once the calls before it could be: here never, so a
    # lease after it came, as a call whose handler died is.
    clock.set(2026, 11, 20, 9, 0)
    os.makedirs(os.path.join(ctx.settings.spool_dir, spool.LIVE_NAME))
    status, reply, _ = await post(webhook("formation/ready"), ORDER, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "queued"})
    assert [e.status for e in WebhookEvent.select()] == ["received"]
    assert worker.requests == []
    assert "new calls are stored and handled after them" in caplog.text

    clock.advance(seconds=lease(ctx).total_seconds() + 1)
    assert await inbox.retry_due(ctx) == 1
    assert [e.status for e in WebhookEvent.select()] == ["processed"]
    assert [r.json["action"] for r in worker.requests] == ["deliver"]


@pytest.mark.gen_test(timeout=30)
async def test_a_call_the_full_spool_disk_cannot_take_is_handled_after_the_spooled_ones(
        post, db, ctx, worker, frappe, small_filesystem):
    """Calls of FO-10042 wait in the spool; its disk fills up; the next call of the order
    cannot join them, and the database answers again: it is stored, and handled once the
    drain has handled the spooled ones, not before them."""
    ctx.settings = dataclasses.replace(ctx.settings, spool_dir=str(small_filesystem / "spool"))
    with database_down(db):
        status, _, _ = await post(webhook("formation/submitted"),
                                  {**ORDER, "state_code": "WY", "entity_name": "Acme LLC"},
                                  AUTH)
    assert status == 200
    fill(small_filesystem)
    # Longer than the room left in the spool file's last page, which a full disk keeps.
    status, reply, _ = await post(webhook("formation/name-available"),
                                  {**ORDER, "note": "x" * 8192}, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "queued"})
    assert [e.status for e in WebhookEvent.select()] == ["received"]
    assert worker.requests == [] and frappe.posts == []

    assert await inbox.drain_spool(ctx) == 1
    assert [r.json["action"] for r in worker.requests] == ["name_search", "file_entity"]
    assert [r.json["action"] for r in frappe.posts] == ["Start Name Check", "Start Filing"]
    assert {event.status for event in WebhookEvent.select()} == {"processed"}


def fill(folder):
    """Write until the filesystem of `folder` has no room left."""
    with open(folder / "filler", "wb", buffering=0) as filler:
        with pytest.raises(OSError):
            while True:
                filler.write(b"x" * 65536)


# --- A failed event holds the later events of its order ----------------------------------------

def report(post, status, number="CO-1"):
    """The worker's report that compliance order `number` moved to `status`."""
    return post(webhook(f"fulfillment/{status}"), {"order_number": number},
                {**AUTH, "Idempotency-Key": f"{number}-{status}"})


def compliance_order(number="CO-1", **fields):
    return ComplianceOrder.create(order_number=number, customer_email="ada@example.test",
                                  customer_name="Ada", service_name="IFTA filing", **fields)


def events_by_status():
    return [(e.event_type, e.status)
            for e in WebhookEvent.select().order_by(WebhookEvent.received_at, WebhookEvent.id)]


@pytest.mark.gen_test
async def test_a_failed_event_holds_the_later_events_of_its_order_until_it_is_finished(
        post, ctx, clock):
    """The worker reports a move before the order is in (the first fails); the order comes
    in; the next report is held behind the first, not refused for coming first, and both
    are handled in turn when the first is retried."""
    clock.set(2026, 11, 20, 9, 0)
    # Neither is handled when answered: the first fails, the second waits behind it.
    queued = (200, {"received": True, "action": "queued"})
    assert (await report(post, "authorization_required"))[:2] == queued
    compliance_order()
    assert (await report(post, "authorization_signed"))[:2] == queued
    assert events_by_status() == [("fulfillment/authorization_required", "failed"),
                                  ("fulfillment/authorization_signed", "received")]
    assert ComplianceOrder.get().fulfillment_status is None

    clock.advance(hours=1)
    assert await inbox.retry_due(ctx) == 2
    assert events_by_status() == [("fulfillment/authorization_required", "processed"),
                                  ("fulfillment/authorization_signed", "processed")]
    assert ComplianceOrder.get().fulfillment_status == "authorization_signed"


@pytest.mark.gen_test
async def test_a_claim_the_database_cut_short_goes_once_it_answers_not_a_lease_later(
        post, ctx, clock, db):
    """Two instances under load, a 7.6 s cut: events claimed as it began kept their claims
    for the lease (60 s) and held their streams behind them (266-2,176 events 40-76 s).
    A claim whose handling the database cut short is given back at the next retry that
    reaches it: the event and the one held behind it go then."""
    clock.set(2026, 11, 20, 9, 0)
    await report(post, "authorization_required")  # fails: the order is not in yet
    compliance_order()
    await report(post, "authorization_signed")  # held behind it
    clock.advance(hours=1)
    [claimed] = await inbox.claim(ctx, WebhookEvent, inbox._due(ctx), limit=1)
    with database_down(db):
        assert await inbox.process(ctx, claimed) == "failed"
    clock.advance(seconds=5)  # the database back, well within the claim's lease
    assert await inbox.retry_due(ctx) == 2
    assert events_by_status() == [("fulfillment/authorization_required", "processed"),
                                  ("fulfillment/authorization_signed", "processed")]


@pytest.mark.gen_test
async def test_an_earlier_event_given_up_or_refused_lets_the_held_ones_go_in_turn(
        post, ctx, clock, smtp):
    """Given up by the retry policy (dead, the administrator told) or refused for good
    (rejected): finished either way, and the events behind it are handled in their turn."""
    clock.set(2026, 11, 20, 9, 0)
    ctx.settings = dataclasses.replace(ctx.settings, inbox_max_attempts=2)
    await report(post, "authorization_required", "CO-1")
    await report(post, "awaiting_intake", "CO-1")
    await report(post, "authorization_required", "CO-2")
    await report(post, "awaiting_intake", "CO-2")
    # CO-1 never comes; CO-2 comes where the move it was first told of cannot start.
    compliance_order("CO-2", fulfillment_status="completed")
    clock.advance(hours=1)
    await inbox.retry_due(ctx)
    assert events_by_status() == [
        ("fulfillment/authorization_required", "dead"),  # CO-1, given up
        ("fulfillment/awaiting_intake", "failed"),  # CO-1: its turn came; no order still
        ("fulfillment/authorization_required", "rejected"),  # CO-2: completed is final
        ("fulfillment/awaiting_intake", "rejected")]
    dead = WebhookEvent.get(WebhookEvent.status == "dead")
    await outbox.send_due(ctx)
    assert [m["Subject"] for _, m in smtp.messages] == [f"Webhook event #{dead.id} given up"]


@pytest.mark.gen_test
async def test_events_of_other_orders_and_of_no_order_wait_for_nothing(post, ctx, worker):
    await report(post, "authorization_required", "CO-1")  # fails: no such order
    compliance_order("CO-2")
    await report(post, "authorization_required", "CO-2")
    status, _, _ = await post(webhook("formation/ready"), ORDER, AUTH)
    assert status == 200
    assert events_by_status() == [("fulfillment/authorization_required", "failed"),
                                  ("fulfillment/authorization_required", "processed"),
                                  ("formation/ready", "processed")]
    assert [r.json["action"] for r in worker.requests] == ["deliver"]


@pytest.fixture
def payment_senders(settings):
    """The suite's settings with the card and crypto processors configured."""
    return se.with_payment_processors(settings)


@pytest.mark.gen_test
async def test_one_senders_failure_holds_no_other_senders_facts_of_the_order(
        post, ctx, clock, payment_senders):
    """CRTC order CA-1's fulfilment report failed; its card and crypto payments that come
    next are of other streams (each sender's own), and are handled at once."""
    ctx.settings = payment_senders
    await report(post, "authorization_required", "CA-1")  # fails: no compliance order
    card = se.event("payment_intent.succeeded", se.payment_intent("CA-1", "canada_crtc"))
    assert (await se.deliver(post, clock, card))[:2] == se.RECEIVED
    raw = shkeeper.encode(shkeeper.paid("CA-1"))
    status, _, _ = await post(shkeeper.URL, raw, shkeeper.key_headers())
    assert status == 202
    statuses = dict(events_by_status())
    assert statuses["fulfillment/authorization_required"] == "failed"
    assert "received" not in (statuses["payment_intent.succeeded"], statuses["PAID"])


@pytest.mark.gen_test
async def test_an_earlier_event_given_up_by_an_operator_lets_the_held_ones_go(post, ctx, clock):
    clock.set(2026, 11, 20, 9, 0)
    await report(post, "authorization_required")  # fails: the order is not in
    compliance_order()
    await report(post, "awaiting_intake")  # held behind the first
    first = WebhookEvent.get(WebhookEvent.event_type == "fulfillment/authorization_required")
    clock.advance(minutes=2)  # its next try come and gone: no handling holds it
    await ctx.db(lambda: operator.give_up_event(ctx, first.id, "sent by mistake",
                                                ("Dana", "127.0.0.1")))
    assert await inbox.retry_due(ctx) == 1
    assert events_by_status() == [("fulfillment/authorization_required", "dead"),
                                  ("fulfillment/awaiting_intake", "processed")]
    assert ComplianceOrder.get().fulfillment_status == "awaiting_intake"


@pytest.mark.gen_test
async def test_a_dead_event_overtaken_by_its_orders_later_calls_is_replayed_only_when_forced(
        post, ctx, clock, smtp):
    """Given up, it let the later calls of its order go; replayed now it would be handled
    after them: `replay` and `replay --failed` leave it unless forced."""
    clock.set(2026, 11, 20, 9, 0)
    ctx.settings = dataclasses.replace(ctx.settings, inbox_max_attempts=1)
    await report(post, "authorization_required")  # dead at once: the order is not in
    compliance_order()
    await report(post, "awaiting_intake")
    first, later = WebhookEvent.select().order_by(WebhookEvent.id)
    assert (first.status, later.status) == ("dead", "processed")
    with pytest.raises(operator.Refused, match="add --force"):
        await operator.replay(ctx, first.id)
    assert await operator.replay_failed(ctx) == []
    assert await operator.replay(ctx, first.id, force=True) == "processed"
