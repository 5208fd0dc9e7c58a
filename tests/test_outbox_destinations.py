"""Each destination on its own: an order's effects are ordered per destination only, an
effect whose destination is not configured waits (and goes out once the service starts
with it), an alert or mail with nowhere to go says it was only logged, a 2xx that is not
JSON is delivered. Real peers on loopback, the real database, a controlled clock."""
import asyncio
import dataclasses
import datetime
import json
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.context import Context
from engine import outbox, retry
from engine.outbox import Effects
from models import Outbox
from scheduler import Scheduler
from tests.conftest import WEBHOOK_SECRET
from tests.test_faults import figures
from tests.waits import eventually
from tests.door import new_row_id, through_the_door

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}


def submitted(number):
    return {"order_name": f"ORD-{number}", "order_number": f"FO-{number}",
            "state_code": "WY", "entity_name": "Acme LLC"}


def webhook(path):
    return f"/api/v1/webhooks/{path}"


@pytest.fixture
def full_settings(settings):
    """Every destination configured: the settings of a service restarted after the
    operator filled in what was missing."""
    return settings


@pytest.fixture
def settings(full_settings, request):
    """The settings with the destinations named by the test's `unset` marker left out."""
    marker = request.node.get_closest_marker("unset")
    return dataclasses.replace(full_settings, **dict.fromkeys(marker.args, "")) if marker \
        else full_settings


async def two_steps_of_one_order(post, clock):
    """FO-1 submitted, then its name found available: two jobs and two actions."""
    clock.set(2026, 11, 20, 9, 0)
    for path in ("formation/submitted", "formation/name-available"):
        status, _, _ = await post(webhook(path), submitted(1), AUTH)
        assert status == 200


async def gauges(ctx):
    """/metrics as the app renders it: {(name, labels): value}."""
    found = {}
    exposition = await ctx.metrics.exposition(ctx)
    for family in text_string_to_metric_families(exposition.decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def statuses(kind):
    return [row.status for row in Outbox.select().where(Outbox.kind == kind).order_by(Outbox.id)]


async def seconds_until_sent(ctx, clock, row_id, step_seconds=30, limit_hours=48):
    """How long (controlled clock) the scheduled sender takes to send the row."""
    started = clock()
    while Outbox.get_by_id(row_id).status != "sent":
        assert clock() - started <= datetime.timedelta(hours=limit_hours)
        clock.advance(seconds=step_seconds)
        await outbox.send_due(ctx)
    return (clock() - started).total_seconds()


# --- ordering per (order, destination) --------------------------------------------------

@pytest.mark.gen_test
async def test_a_failing_alert_holds_back_neither_the_workflow_action_nor_the_job(
        post, ctx, clock, worker, frappe, telegram):
    """The field report: Telegram answering 500 held back `Start Name Check` and the
    `name_search` job of the same order."""
    clock.set(2026, 11, 20, 9, 0)
    telegram.fail_with(500)
    alerts = Effects(ctx)
    through_the_door(alerts.alert, "FO-1 paid", key="alert-FO-1", order_number="FO-1")
    [failed] = await outbox.deliver(ctx, alerts.rows)
    assert not failed.ok and statuses("alert") == ["pending"]

    clock.advance(seconds=5)
    status, body, _ = await post(webhook("formation/submitted"), submitted(1), AUTH)

    assert (status, body["action"]) == (200, "name_search_dispatched")
    [job] = worker.requests
    assert job.json["action"] == "name_search" and job.json["order_number"] == "FO-1"
    [action] = frappe.requests
    assert action.json["action"] == "Start Name Check"
    assert statuses("job") == statuses("workflow_action") == ["sent"]
    job_row = Outbox.get(Outbox.kind == "job")
    waited = (job_row.sent_at - job_row.created_at).total_seconds()
    figures("job behind a failing alert", waited_seconds=waited)
    assert waited == 0


@pytest.mark.gen_test
async def test_an_orders_jobs_keep_their_order_while_its_mail_goes_out(
        post, ctx, clock, worker, smtp):
    clock.set(2026, 11, 20, 9, 0)
    worker.fail_with(503)
    await post(webhook("formation/submitted"), submitted(1), AUTH)
    worker.fail_with(200, {"ok": True})
    mails = Effects(ctx)
    through_the_door(mails.add, "email", {"to": ["customer@example.test"],
                                          "subject": "Your order", "text": "Hello"},
                     key="email-FO-1", order_number="FO-1")
    [mailed] = await outbox.deliver(ctx, mails.rows)  # ordered behind nothing
    await post(webhook("formation/name-available"), submitted(1), AUTH)

    assert mailed.ok and len(smtp.messages) == 1
    assert [r.json["action"] for r in worker.requests] == ["name_search"]  # the failed try
    assert statuses("job") == ["pending", "pending"]  # the second waits behind the first
    await seconds_until_sent(ctx, clock, Outbox.select().where(Outbox.kind == "job")
                             .order_by(Outbox.id.desc()).get().id, step_seconds=600)
    assert [r.json["action"] for r in worker.requests] == [
        "name_search", "name_search", "file_entity"]


@pytest.mark.gen_test
async def test_a_dead_job_holds_back_nothing(post, ctx, clock, worker):
    clock.set(2026, 11, 20, 9, 0)
    worker.responses.append((400, {"error": "bad job"}))
    await post(webhook("formation/submitted"), submitted(1), AUTH)
    await post(webhook("formation/name-available"), submitted(1), AUTH)
    assert statuses("job") == ["dead", "sent"]


# --- a destination not configured -------------------------------------------------------

@pytest.mark.gen_test
@pytest.mark.unset("workflow_url")
async def test_without_workflow_url_the_jobs_go_out_and_the_actions_wait_for_a_restart(
        post, ctx, clock, worker, frappe, full_settings):
    await two_steps_of_one_order(post, clock)

    # The order's worker jobs are not held by its waiting workflow actions.
    assert [r.json["action"] for r in worker.requests] == ["name_search", "file_entity"]
    waiting = list(Outbox.select().where(Outbox.kind == "workflow_action").order_by(Outbox.id))
    assert [(row.status, row.attempts, row.last_error) for row in waiting] == [
        ("waiting", 0, "WORKFLOW_URL is not set")] * 2
    metrics = await gauges(ctx)
    assert metrics[("receiver_outbox_waiting", (("destination", "workflow"),))] == 2
    assert metrics[("receiver_outbox_waiting", (("destination", "worker"),))] == 0
    assert metrics[("receiver_outbox_pending", ())] == 0  # not a failure, nor a backlog

    for _ in range(20):  # never retried while the setting is missing
        clock.advance(hours=7)
        await outbox.send_due(ctx)
    assert statuses("workflow_action") == ["waiting", "waiting"] and frappe.requests == []

    # The operator sets WORKFLOW_URL and restarts: the waiting rows go out at once.
    restarted = Context.create(full_settings, clock=clock)
    scheduler = Scheduler(restarted)
    await scheduler.start()
    try:
        await eventually(lambda: statuses("workflow_action") == ["sent", "sent"])
    finally:
        await scheduler.stop()
        await restarted.close()
    # (The restarted scheduler's reconciliation reads Frappe too: its GETs are left out.)
    assert [r.json["action"] for r in frappe.requests if r.method == "POST"] == [
        "Start Name Check", "Start Filing"]


@pytest.mark.gen_test
@pytest.mark.unset("worker_url")
async def test_a_waiting_job_holds_the_orders_later_jobs_in_their_order(
        post, ctx, clock, worker, frappe, full_settings):
    await two_steps_of_one_order(post, clock)
    assert statuses("job") == ["waiting", "waiting"]
    assert len(frappe.requests) == 2 and worker.requests == []

    restarted = Context.create(full_settings, clock=clock)
    assert await outbox.send_due(restarted) == 2
    await restarted.close()
    assert [r.json["action"] for r in worker.requests] == ["name_search", "file_entity"]


@pytest.mark.gen_test
@pytest.mark.unset("telegram_bot_token", "smtp_url")
async def test_an_alert_or_mail_with_nowhere_to_go_is_logged_and_says_so(ctx, clock, caplog):
    caplog.set_level(logging.INFO)
    clock.set(2026, 11, 20, 9, 0)
    effects = Effects(ctx)
    through_the_door(effects.alert, "FO-1 paid", key="alert-FO-1", order_number="FO-1")
    through_the_door(effects.add, "email",
                     {"to": ["customer@example.test"], "subject": "Hi", "text": "Hi"},
                     key="email-FO-1")
    results = await outbox.deliver(ctx, effects.rows)

    assert all(result.ok and result.logged for result in results)
    rows = list(Outbox.select().order_by(Outbox.id))
    assert [(row.status, row.last_error) for row in rows] == [
        ("logged", "TELEGRAM_BOT_TOKEN/TELEGRAM_CHAT_ID unset: logged, not sent"),
        ("logged", "SMTP_URL unset: logged, not sent")]
    assert "alert not sent" in caplog.text and "mail not sent" in caplog.text
    clock.advance(hours=7)
    assert await outbox.send_due(ctx) == 0  # final: not tried again


# --- a 2xx reply that is not JSON ---------------------------------------------------------

@pytest.mark.gen_test
@pytest.mark.parametrize("status,content_type,body", [
    (200, "text/plain", "OK"), (204, None, b""), (202, "text/html", "<p>queued</p>")])
async def test_a_2xx_reply_that_is_not_json_is_delivered_once_with_a_warning(
        ctx, clock, worker, caplog, status, content_type, body):
    clock.set(2026, 11, 20, 9, 0)
    worker.status, worker.body = status, body
    worker.content_type = content_type or "text/plain"
    effects = Effects(ctx)
    row_id = new_row_id(effects.job, "name_search", {"order_number": "FO-1"}, key="job-FO-1")
    [result] = await outbox.deliver(ctx, effects.rows)

    assert result.ok and result.status == status
    row = Outbox.get_by_id(row_id)
    assert (row.status, row.attempts) == ("sent", 1)
    for _ in range(3):
        clock.advance(hours=7)
        await outbox.send_due(ctx)
    assert len(worker.requests) == 1
    if body:
        assert f"worker answered HTTP {status} with a reply that is not JSON" in caplog.text


# --- a destination down, and the calls in flight -----------------------------------------

def jobs(ctx, count, first=1):
    """`count` jobs of as many orders, written now; their row ids."""
    effects = Effects(ctx)
    return [new_row_id(effects.job, "name_search", {"order_number": f"FO-{n}"},
                       key=f"job-FO-{n}")
            for n in range(first, first + count)]


async def worker_up(ctx):
    return (await gauges(ctx))[("receiver_destination_up", (("destination", "worker"),))]


@pytest.mark.gen_test
async def test_a_worker_down_is_left_alone_but_for_one_probe_on_a_backoff(
        ctx, clock, worker, client, base_url, app, http_server, caplog):
    clock.set(2026, 11, 20, 9, 0)
    down_after = ctx.settings.outbound_down_after
    worker.fail_with(503)
    jobs(ctx, down_after + 1)
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)
    await outbox.send_due(ctx)
    assert len(worker.requests) == down_after + 1 and await worker_up(ctx) == 0
    readiness = json.loads((await client.fetch(base_url + "/readyz")).body)
    # Told, but not a check: the webhooks are still taken, and their effects wait.
    assert readiness["destinations"]["worker"] == "down"
    assert set(readiness["checks"]) == {"database", "scheduler", "spool", "spool_drain"}

    async def tried_after(seconds, live=None):
        """Requests the worker got when `seconds` had passed and the scheduled sender
        ran, or a webhook's job (`live`, its order's number) was delivered."""
        before = len(worker.requests)
        clock.advance(seconds=seconds)
        if live is None:
            await outbox.send_due(ctx)
        else:
            await outbox.deliver(ctx, [Outbox.get_by_id(row) for row in jobs(ctx, 1, live)])
        return len(worker.requests) - before

    first_probe = retry.probes(ctx.settings).base_seconds
    assert await tried_after(first_probe - 1, live=100) == 0  # a webhook's job waits too
    assert await tried_after(2) == 1  # one probe, which fails
    assert await tried_after(2 * first_probe - 1) == 0  # the next waits twice as long
    worker.fail_with(200, {"ok": True})
    assert await tried_after(2, live=101) == 1  # a webhook's job is the probe: back up
    assert await worker_up(ctx) == 1
    await tried_after(60)  # the rows' backoffs have run out: they all go
    assert statuses("job") == ["sent"] * (down_after + 3)
    changes = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "destination worker is")]
    assert len(changes) == 2 and "down" in changes[0] and "up again" in changes[1]
    # The operator is told of both, by mail and by alert (a Telegram down is told by
    # mail, a mail server by Telegram); once each, whoever saw it.
    await ctx.drain_background()
    told = [(row.kind, json.loads(row.payload).get("subject") or json.loads(row.payload)["text"])
            for row in Outbox.select().where(Outbox.kind.in_(("email", "alert")))
            .order_by(Outbox.id)]
    down, up = "Destination worker is down: its effects wait", \
        "Destination worker is up again after 1 min: its waiting effects are being sent"
    assert told == [("email", down), ("alert", down), ("email", up), ("alert", up)]


@pytest.mark.gen_test
async def test_the_backlog_never_holds_the_calls_kept_for_live_sends(ctx, clock, worker):
    clock.set(2026, 11, 20, 9, 0)
    limit = ctx.settings.outbound_max_in_flight
    backlog_share = limit - limit // 4
    worker.hold = asyncio.Event()  # the worker holds every answer: a slow recovery
    jobs(ctx, backlog_share + 2)
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)
    scheduled = asyncio.ensure_future(outbox.send_due(ctx))
    await eventually(lambda: len(worker.requests) == backlog_share)
    await asyncio.sleep(0.2)  # a while for a send past its share: a negative, shown by time
    assert len(worker.requests) == backlog_share  # no more than its share

    live = Effects(ctx)
    through_the_door(live.job, "name_search", {"order_number": "FO-LIVE"}, key="job-FO-LIVE")
    request = asyncio.ensure_future(outbox.deliver(ctx, live.rows))
    await eventually(lambda: len(worker.requests) == backlog_share + 1)
    assert worker.requests[-1].json["order_number"] == "FO-LIVE"
    in_flight = (await gauges(ctx))[("receiver_destination_in_flight",
                                      (("destination", "worker"),))]
    assert in_flight == backlog_share + 1

    worker.hold.set()
    assert await scheduled == backlog_share + 2
    [result] = await request
    assert result.ok and worker.most_in_flight == backlog_share + 1
