"""What the console says of each effect: its name on the order's timeline with every
attempt and every operator's retry under it, what a waiting or logged row waits for, and
the effect's own page (the request as sent without credentials, every attempt, the cause,
retry and give-up as recorded actions)."""
import re

import pytest

from engine import outbox
from engine.outbox import Effects
from models import ConsoleAction, CrtcOrder, Outbox
from ops import console
from tests.console_helpers import (  # noqa: F401 (fixture)
    console_settings, logged_in, notice, operator, refused, text,
)
from tests.door import name_search_jobs, through_the_door
from tests.test_cli import at, outbox_row

SUBMITTED = {"order_name": "ORD-1", "order_number": "FO-1", "state_code": "WY",
             "entity_name": "Acme LLC"}
WEBHOOK_HEADERS = {"X-Webhook-Secret": "test-webhook-secret"}


@pytest.fixture
def settings(settings):
    return console_settings(settings)


def timeline_lines(page):
    """The timeline's rows as "what | detail" texts, tags and phone-width labels
    stripped."""
    table = re.sub(r'<span class="cell-label">.*?</span>', "", page.split("Timeline", 1)[1])
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for row in rows]
    return [" | ".join(re.sub(r"<[^>]+>", "", cell).strip() for cell in row[1:3])
            for row in cells if len(row) >= 3]


def the_job():
    return Outbox.get(Outbox.kind == "job")


@pytest.mark.gen_test(timeout=60)
async def test_the_timeline_names_each_effect_with_its_attempts_and_retries(
        logged_in, post, worker, clock):
    clock.set(2026, 11, 20, 9, 0)
    worker.fail_with(503, {"error": "worker busy"})
    await post("/api/v1/webhooks/formation/submitted", SUBMITTED, WEBHOOK_HEADERS)
    assert the_job().status == "pending"
    clock.set(2026, 11, 20, 9, 5)
    worker.status, worker.body = 200, {"ok": True, "job_id": "job-1"}
    await logged_in.act(f"/console/outbox/{the_job().id}/retry")
    assert the_job().status == "sent"

    lines = timeline_lines(text(await logged_in.get("/console/orders/FO-1")))
    job = next(i for i, line in enumerate(lines) if line.startswith("worker job name_search"))
    assert "caused by event #" in lines[job] and "now sent" in lines[job]
    assert lines[job + 1].startswith("attempt 1 | HTTP 503 in ")
    assert "will retry" in lines[job + 1]
    assert lines[job + 2].startswith("retry effect by Dana | sent")
    assert lines[job + 3].startswith("attempt 2 | HTTP 200 in ") and "sent" in lines[job + 3]
    assert not any("effect job" in line for line in lines)


@pytest.mark.gen_test(timeout=60)
async def test_waiting_and_logged_effects_say_what_they_wait_for(logged_in, ctx, clock):
    ctx.settings.__dict__.update(worker_url="", telegram_bot_token="")
    effects = Effects(ctx)
    through_the_door(effects.job, "name_search", {"order_number": "FO-1"}, key="job-FO-1")
    through_the_door(effects.alert, "FO-1 paid", key="alert-FO-1", order_number="FO-1")
    await outbox.deliver(ctx, effects.rows)
    assert {row.status for row in Outbox.select()} == {"waiting", "logged"}
    lines = timeline_lines(text(await logged_in.get("/console/orders/FO-1")))
    assert "now | waits for its destination to be configured: WORKER_URL is not set" in lines
    assert any(line.startswith("now | logged, not sent (final): TELEGRAM_BOT_TOKEN")
               for line in lines)
    assert "alert to Telegram | now logged" in lines
    assert not any("next try" in line for line in lines)


@pytest.mark.gen_test(timeout=60)
async def test_the_order_created_row_shows_the_order_as_created(logged_in, clock):
    CrtcOrder.create(order_number="CA-9", customer_name="Rae Radio Ltd", total_cents=78000,
                     payment_status="paid", paid_at=at(2026, 11, 2), created_at=at(2026, 11, 1))
    lines = timeline_lines(text(await logged_in.get("/console/orders/CA-9")))
    # A CRTC order has its currency (USD by default): the line said "(currency not given)".
    assert lines[0] == "canada_crtc order created | Rae Radio Ltd, $780.00"
    assert lines[1].startswith("paid")


@pytest.mark.gen_test(timeout=60)
async def test_the_effect_page_shows_the_request_without_credentials_and_every_attempt(
        logged_in, post, worker, frappe, clock):
    worker.fail_with(503, {"error": "worker busy"})
    await post("/api/v1/webhooks/formation/submitted", SUBMITTED, WEBHOOK_HEADERS)
    job = the_job()
    clock.advance(minutes=2)  # past its next try's time: the buttons are offered
    page = text(await logged_in.get(f"/console/outbox/{job.id}"))
    assert "Effect #%d: worker job name_search" % job.id in page
    assert f"POST {worker.url}/jobs" in page and f"Idempotency-Key: {job.idempotency_key}" in page
    assert "&#34;action&#34;: &#34;name_search&#34;" in page or '"action": "name_search"' in page
    assert f'href="/console/events/{job.event_id}"' in page
    assert "HTTP 503" in page and "worker busy" in page
    assert '<form class="inline give-up" action="/console/outbox/%d/give-up" method="post">' \
        % job.id in page
    assert '<dd id="effect-destination">worker</dd>' in page



@pytest.mark.gen_test(timeout=60)
async def test_a_workflow_action_is_shown_without_frappes_credentials(logged_in, ctx, frappe):
    effects = Effects(ctx)
    await ctx.db(lambda: effects.workflow_action(
        "workflow_doctype", "ORD-0001", "Start Name Check", key="action-FO-1",
        order_number="FO-1"))
    [row] = effects.rows
    row_id = row.id
    shown = text(await logged_in.get(f"/console/outbox/{row_id}"))
    assert "Effect #%d: Frappe: Start Name Check on ORD-0001" % row_id in shown
    assert f"POST {frappe.url}/api/method/frappe.model.workflow.apply_workflow" in shown
    assert "Authorization: [hidden]" in shown
    assert "wf-secret" not in shown and "wf-key" not in shown


@pytest.mark.gen_test(timeout=60)
async def test_the_telegram_token_is_not_shown(logged_in, ctx, telegram):
    effects = Effects(ctx)
    await ctx.db(lambda: effects.alert("FO-1 paid", key="alert-FO-1", order_number="FO-1"))
    [row] = effects.rows
    row_id = row.id
    page = text(await logged_in.get(f"/console/outbox/{row_id}"))
    assert "alert to Telegram" in page and "/bot[hidden]/sendMessage" in page
    assert "bot-token" not in page


@pytest.mark.gen_test(timeout=60)
async def test_an_admin_mail_is_named_by_its_subject(logged_in, ctx):
    effects = Effects(ctx)
    await ctx.db(lambda: effects.email(["admin@example.test"], "Payment failed",
                                       "email/outbox_dead", key="mail-1", title="Payment failed",
                                       row=Outbox(id=1, kind="job"), attempts=1, error="x"))
    [row] = effects.rows
    row_id = row.id
    page = text(await logged_in.get(f"/console/outbox/{row_id}"))
    assert "mail to admin: Payment failed" in page and "SMTP smtp://127.0.0.1:" in page


@pytest.mark.gen_test(timeout=60)
async def test_giving_up_an_effect_is_a_recorded_post_with_its_token(logged_in, post, worker,
                                                                     clock):
    worker.fail_with(503)
    await post("/api/v1/webhooks/formation/submitted", SUBMITTED, WEBHOOK_HEADERS)
    job = the_job()
    # Within a lease of its failed try it may be on its way out again: left as it is.
    _, page = await logged_in.act(f"/console/outbox/{job.id}/give-up")
    assert refused(page) and "may be on its way out right now" in notice(page)
    assert "Give up</button>" not in text(page) and 'id="effect-held"' in text(page)
    clock.advance(minutes=2)  # past its next try's time: no send can hold it now
    forged = await logged_in.post(f"/console/outbox/{job.id}/give-up", xsrf=False)
    assert forged.code == 403 and the_job().status == "pending"
    assert (await logged_in.get(f"/console/outbox/{job.id}/give-up")).code == 405
    response, page = await logged_in.act(f"/console/outbox/{job.id}/give-up",
                                         {"reason": "the customer cancelled"})
    assert response.headers["Location"] == f"/console/outbox/{job.id}"
    assert notice(page).startswith(f"Effect #{job.id} given up: it is dead")
    assert (the_job().status, the_job().last_error) == (
        "dead", "given up by Dana: the customer cancelled")
    _, again = await logged_in.act(f"/console/outbox/{job.id}/give-up")
    assert refused(again) and "is dead already" in notice(again)
    assert [(a.action, a.target, a.outcome) for a in ConsoleAction.select()
            .where(ConsoleAction.action == "give up effect").order_by(ConsoleAction.id)][1:] == [
        ("give up effect", str(job.id), "given up by Dana: the customer cancelled"),
        ("give up effect", str(job.id), f"refused: effect #{job.id} is dead already")]
    # Retried from its page, it comes back to its page, and says so once.
    worker.status, worker.body = 200, {"ok": True}
    response, page = await logged_in.act(f"/console/outbox/{job.id}/retry",
                                         {"back": f"/console/outbox/{job.id}"})
    assert response.headers["Location"] == f"/console/outbox/{job.id}"
    assert notice(page).startswith(f"Effect #{job.id} (worker job name_search) sent at ")
    assert the_job().status == "sent" and "retry effect" in text(page)
    # A reload shows the page as it is, asks nothing again and says nothing again.
    reloaded = await logged_in.get(f"/console/outbox/{job.id}")
    assert notice(reloaded) is None and the_job().attempts == 1
    assert (await logged_in.get("/console/outbox/999999")).code == 404


def test_an_effect_whose_payload_is_not_json_is_named_by_its_kind(ctx):
    assert console.effect_name(ctx, Outbox(kind="job", payload="not json")) == "job"


@pytest.mark.gen_test(timeout=60)
async def test_the_overview_shows_each_destinations_health(logged_in, ctx, clock, worker,
                                                           frappe):
    clock.set(2026, 11, 20, 9, 0)
    frappe.fail_with(401, {"exc_type": "AuthenticationError"})
    worker.stop()
    effects = Effects(ctx)
    name_search_jobs(effects, range(ctx.settings.outbound_down_after))
    through_the_door(effects.workflow_action, "workflow_doctype", "ORD-1", "Start Name Check",
                     key="action-1")
    await outbox.deliver(ctx, effects.rows)
    page = text(await logged_in.get("/console/"))
    rows = dict(re.findall(r'<span class="cell-label">Destination: </span>(\w+)</td>(.*?)</tr>',
                           page.split('id="destinations"')[1].split("</table>")[0], re.S))
    cells = {name: re.sub(r"<[^>]+>", "", row).split() for name, row in rows.items()}
    worker_row = " ".join(cells["worker"])
    assert "State: down since 2026-11-20 09:00:00" in worker_row
    assert "Next probe: 2026-11-20 09:00:05" in worker_row
    workflow_row = " ".join(cells["workflow"])
    assert "State: credentials refused since 2026-11-20 09:00:00" in workflow_row
    assert "Credentials: refused: HTTP 401" in workflow_row
    assert 'id="last-reconciliation"' in page


@pytest.mark.gen_test(timeout=60)
async def test_an_effect_whose_payload_does_not_read_as_a_request_is_shown_as_stored(
        logged_in):
    row = Outbox.create(kind="job", payload='{"token": "t0ps3cret"}', idempotency_key="odd",
                        order_number="FO-1")
    response = await logged_in.get(f"/console/outbox/{row.id}")
    assert response.code == 200 and "it does not read as a request" in text(response)
    assert "t0ps3cret" not in text(response) and "[hidden]" in text(response)


@pytest.mark.gen_test(timeout=60)
async def test_a_retry_left_to_the_scheduler_says_what_it_waits_for_not_that_it_failed(
        logged_in, ctx, clock, worker):
    clock.set(2026, 11, 23, 12, 0)
    earlier = outbox_row(status="pending", key="earlier")
    behind = outbox_row(status="dead", key="behind")
    _, page = await logged_in.act(f"/console/outbox/{behind.id}/retry")
    assert notice(page) == (
        f"Effect #{behind.id} (worker job deliver) back in line, due now, after effect "
        f"#{earlier.id} of its order (pending): it goes once that one is sent or given up.")
    assert not refused(page) and worker.requests == []

    Outbox.delete().execute()
    alone = outbox_row(status="dead", key="alone")
    destination = ctx.destinations.of("job")
    destination.up, destination.probe_at = False, at(2026, 11, 23, 12, 5)
    _, page = await logged_in.act(f"/console/outbox/{alone.id}/retry")
    assert notice(page) == (
        f"Effect #{alone.id} (worker job deliver) back in line, due now; worker is down: it "
        "goes once a probe finds it back (the next at 2026-11-23 12:05:00 UTC).")
    assert worker.requests == [] and Outbox.get_by_id(alone.id).status == "pending"

    destination.up = True
    ctx.settings.__dict__.update(worker_url="")
    unconfigured = outbox_row(status="dead", key="unconfigured")
    _, page = await logged_in.act(f"/console/outbox/{unconfigured.id}/retry")
    assert notice(page) == (
        f"Effect #{unconfigured.id} (worker job deliver) not sent: it waits for its "
        "destination to be configured: WORKER_URL is not set; it goes once the setting is "
        "there.")
