"""Reconciliation with Frappe (domain/reconcile.py): a state change whose webhook never
came (Frappe v15 tries three times within about 5 s, then never again) is found through
Frappe's list API and handled as the webhook would have been; a webhook before or after
it, a second run, or two runs at once cause nothing new."""
import asyncio
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import re
import threading
import zoneinfo

import pytest

from domain import reconcile
from engine import spool
from engine.db import Circuit
from models import UTC, Outbox, ReconcileRun, WebhookEvent
from settings import ConfigurationError, Settings
from tests.conftest import WEBHOOK_SECRET
from tests.console_helpers import Operator, console_settings, text
from tests.test_cli import cli_env, run_async
from tests.test_ops_endpoints import samples, value
from tests.frappe_site import FrappeSite, frappe_text
from tests.service_process import postgres_only
from tests.terminal import OnATerminal
from tests.service_process import database_down

FORMATION, CRTC = "Formation Order", "CRTC Order"
FIELDS = {FORMATION: ["order_number", "state_code", "entity_name", "notes"],
          CRTC: ["order_number", "incorporation_number", "notes"]}
AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET}
# The site's System Settings time zone: an empty one is Asia/Kolkata in Frappe v15.
ZONE = zoneinfo.ZoneInfo("Asia/Kolkata")
NOW = datetime.datetime(2026, 11, 25, 13, 0, tzinfo=UTC)


@pytest.fixture
def site(io_loop):
    frappe = FrappeSite(FIELDS)
    yield frappe
    frappe.stop()


def configure(ctx, **changes):
    """New settings for the context and its Frappe client alike."""
    ctx.settings = ctx.workflow.settings = dataclasses.replace(ctx.settings, **changes)


@pytest.fixture
def settings(settings, site):
    return dataclasses.replace(console_settings(settings), workflow_url=site.url)


@pytest.fixture
def rctx(ctx, clock):
    clock.fixed = NOW
    return ctx


def local(minutes_ago, microseconds=123456):
    """A Frappe `modified`: that many minutes before NOW, in the site's time zone."""
    return (NOW - datetime.timedelta(minutes=minutes_ago)).astimezone(ZONE).replace(
        tzinfo=None, microsecond=microseconds)


def ready(site, n, minutes_ago=30, microseconds=0):
    """The n-th of many documents in Ready (names and order numbers numbered by n)."""
    return site.add(FORMATION, f"FORM-{n:05}", "Ready", local(minutes_ago, microseconds),
                    order_number=f"FO-{n}")


def submitted(site, name="FORM-00001", number="FO-9001", minutes_ago=10, **extra):
    return site.add(FORMATION, name, "Submitted", local(minutes_ago), order_number=number,
                    state_code="DE", entity_name='Probe "Quote" LLC', **extra)


def webhook_body(document, *fields):
    """What Frappe v15 sends for the guide's template: `{{ doc.x | tojson }}` rendered,
    json.loads'ed and sent as json.dumps(data, default=str)."""
    body = {"order_name": document["name"], "order_number": document["order_number"],
            "modified": frappe_text(document["modified"]),
            **{field: document[field] for field in fields}}
    return json.dumps(body, default=str)


def reconciled():
    return list(WebhookEvent.select().where(WebhookEvent.reconciled == True))  # noqa: E712


@pytest.mark.gen_test(timeout=30)
async def test_a_change_whose_webhook_never_came_is_handled_as_the_webhook_would_be(
        rctx, site, worker, post):
    document = submitted(site)
    counts = await reconcile.reconcile_workflow(rctx)
    assert (counts.listed, counts.handled, counts.already) == (1, 1, 0)
    [event] = reconciled()
    assert (event.source, event.event_type, event.status, event.order_number) == (
        "workflow", "formation/submitted", "processed", "FO-9001")
    # The webhook's fields, and the change as Frappe's workflow log has it in place of
    # the document's `modified`: the entry, and the span its save lies in.
    webhook = json.loads(webhook_body(document, "state_code", "entity_name"))
    del webhook["modified"]
    assert json.loads(event.payload) == {
        **webhook, "workflow_entry": "c000000001", "entered_after": None,
        "entered_at": "2026-11-25 18:20:00.163456"}
    # The plugin's effects: the same job and action a webhook causes.
    [job] = [r.json for r in worker.requests]
    assert job == {"action": "name_search", "order_name": "FORM-00001",
                   "order_number": "FO-9001", "state_code": "DE",
                   "entity_name": 'Probe "Quote" LLC'}
    assert [json.loads(a["doc"])["name"] for a in site.actions] == ["FORM-00001"]
    assert [a["action"] for a in site.actions] == ["Start Name Check"]


@pytest.mark.gen_test(timeout=30)
async def test_the_list_call_is_frappes_list_api_in_the_sites_time_zone(rctx, site, worker):
    submitted(site)
    await reconcile.reconcile_workflow(rctx)
    formation = [q for q in site.listings()
                 if "order_number" in q["fields"] and "entity_name" in q["fields"]]
    [query] = formation
    assert json.loads(query["fields"]) == sorted(
        ["name", "modified", "workflow_state", "order_number", "state_code", "entity_name"])
    # The first run looks a day back, in the site's local time (Frappe's System Settings,
    # read from Frappe: no WORKFLOW_TIME_ZONE is set); every document saved since, in
    # whatever state (its log says which states it went through).
    assert json.loads(query["filters"]) == [["modified", ">=", "2026-11-24 18:30:00.000000"]]
    assert (query["limit_start"], query["limit_page_length"]) == ("0", "100")
    assert site.requests[0].headers["X-Frappe-Site-Name"] == "erp.example.test"


@pytest.mark.gen_test(timeout=30)
async def test_a_webhook_first_then_reconciliation_causes_nothing_new(rctx, site, worker, post):
    document = submitted(site)
    status, _, _ = await post("/api/v1/webhooks/formation/submitted",
                              webhook_body(document, "state_code", "entity_name"), AUTH)
    assert status == 200 and len(worker.requests) == 1
    counts = await reconcile.reconcile_workflow(rctx)
    assert (counts.handled, counts.already) == (0, 1)
    assert WebhookEvent.select().count() == 1 and len(worker.requests) == 1


@pytest.mark.gen_test(timeout=30)
async def test_a_document_saved_again_in_the_same_state_is_not_a_new_change(
        rctx, site, worker, post):
    document = submitted(site, minutes_ago=20)
    await post("/api/v1/webhooks/formation/submitted",
               webhook_body(document, "state_code", "entity_name"), AUTH)
    # An edited note: `modified` moves on, the state does not (and no webhook is sent).
    submitted(site, minutes_ago=10, notes="called the customer")
    counts = await reconcile.reconcile_workflow(rctx)
    assert (counts.handled, counts.already) == (0, 1)
    assert len(worker.requests) == 1 and WebhookEvent.select().count() == 1


@pytest.mark.gen_test(timeout=30)
async def test_reconciliation_first_then_the_webhook_causes_nothing_new(
        rctx, site, worker, post):
    document = submitted(site, microseconds=0)
    await reconcile.reconcile_workflow(rctx)
    assert len(worker.requests) == 1
    body = webhook_body(document, "state_code", "entity_name")
    # The list showed "... 18:20:00"; the webhook's `modified` has microseconds written out as Frappe's now() does.
    late = body.replace(frappe_text(document["modified"]),
                        document["modified"].strftime("%Y-%m-%d %H:%M:%S.%f"))
    status, reply, _ = await post("/api/v1/webhooks/formation/submitted", late, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "name_search_dispatched"})
    assert WebhookEvent.select().count() == 1 and len(worker.requests) == 1
    assert len(site.actions) == 1


@pytest.mark.gen_test(timeout=30)
async def test_a_second_run_and_two_runs_at_once_cause_nothing_new(rctx, site, worker,
                                                                   caplog):
    for n in range(3):
        submitted(site, name=f"FORM-{n:05}", number=f"FO-{n}")
    first, second = await asyncio.gather(reconcile.reconcile_workflow(rctx),
                                         reconcile.reconcile_workflow(rctx))
    assert first.handled + second.handled == 3
    caplog.clear()
    caplog.set_level(logging.INFO)
    again = await reconcile.reconcile_workflow(rctx)
    assert (again.handled, again.already) == (0, 3)
    # Its count says it, not an INFO line per change it found again, run after run.
    assert [r.getMessage() for r in caplog.records if "duplicate" in r.getMessage()] == []
    assert WebhookEvent.select().count() == 3 and len(worker.requests) == 3


@pytest.mark.gen_test(timeout=30)
async def test_an_order_back_in_a_state_it_had_left_is_a_new_change(rctx, site, worker, post):
    document = submitted(site, minutes_ago=60)
    await post("/api/v1/webhooks/formation/submitted",
               webhook_body(document, "state_code", "entity_name"), AUTH)
    moved = site.add(FORMATION, "FORM-00001", "Name Available", local(50),
                     order_number="FO-9001")
    await post("/api/v1/webhooks/formation/name-available", webhook_body(moved), AUTH)
    # Sent back to Submitted while the service was down: the webhook was lost.
    submitted(site, minutes_ago=10)
    counts = await reconcile.reconcile_workflow(rctx)
    assert counts.handled == 1
    assert [e.event_type for e in WebhookEvent.select().order_by(WebhookEvent.id)] == [
        "formation/submitted", "formation/name-available", "formation/submitted"]
    assert reconciled()[-1].event_type == "formation/submitted"


@pytest.mark.gen_test(timeout=30)
async def test_crtc_states_map_to_their_paths_and_the_waiting_state_is_a_setting(
        rctx, site, worker):
    configure(rctx, workflow_reconcile_states=(
        ("crtc/awaiting-funds", "Waiting For Deposit"),))
    site.add(CRTC, "CRTC-00001", "Waiting For Deposit", local(10), order_number="CA-1")
    site.add(CRTC, "CRTC-00002", "Awaiting Funds", local(10), order_number="CA-2")
    counts = await reconcile.reconcile_workflow(rctx)
    assert counts.handled == 1
    [event] = reconciled()
    assert (event.event_type, event.order_number) == ("crtc/awaiting-funds", "CA-1")
    assert worker.requests[0].json["action"] == "register_awaiting_funds"


def test_the_state_mapping_defaults_and_its_setting():
    defaults = dict(Settings.from_env({}).workflow_reconcile_states)
    assert defaults["crtc/awaiting-funds"] == "Awaiting Funds"
    assert defaults["crtc/funds-available"] == "Client Selection"
    assert defaults["formation/submitted"] == "Submitted"
    waiting = Settings.from_env({"CRTC_WAITING_STATE": "Deposit Pending"})
    assert (waiting.crtc_waiting_state, dict(waiting.workflow_reconcile_states)[
        "crtc/awaiting-funds"]) == ("Deposit Pending", "Deposit Pending")
    custom = Settings.from_env({"WORKFLOW_RECONCILE_STATES":
                                "formation/ready = Done, crtc/incorporated=Incorporated"})
    assert custom.workflow_reconcile_states == (("formation/ready", "Done"),
                                                ("crtc/incorporated", "Incorporated"))
    for wrong in ("formation/ready", "service/queued=Queued", "=Done"):
        with pytest.raises(ConfigurationError, match="WORKFLOW_RECONCILE_STATES"):
            Settings.from_env({"WORKFLOW_RECONCILE_STATES": wrong})
    with pytest.raises(ConfigurationError, match="WORKFLOW_TIME_ZONE"):
        Settings.from_env({"WORKFLOW_TIME_ZONE": "Mars/Olympus"})


@pytest.mark.gen_test(timeout=30)
async def test_a_change_younger_than_the_settle_time_is_left_to_its_webhook(
        rctx, site, worker, clock):
    submitted(site, minutes_ago=1)
    assert (await reconcile.reconcile_workflow(rctx)).handled == 0
    clock.advance(minutes=5)
    assert (await reconcile.reconcile_workflow(rctx)).handled == 1


@pytest.mark.gen_test(timeout=60)
async def test_runs_page_through_the_list_and_stop_at_the_cap(
        rctx, site, worker, monkeypatch):
    # Smaller than in service, so that few documents show the paging and the cap.
    monkeypatch.setattr(reconcile, "PAGE_SIZE", 10)
    monkeypatch.setattr(reconcile, "MAX_DOCUMENTS_PER_RUN", 15)
    for n in range(23):
        ready(site, n, microseconds=n)
    first = await reconcile.reconcile_workflow(rctx)
    assert (first.listed, first.handled) == (15, 15)
    pages = [(json.loads(q["filters"])[0][2], q["limit_start"], q["limit_page_length"])
             for q in site.listings() if "entity_name" in q["fields"]]
    # The second page begins at the tenth document's time, past the one read there.
    assert pages[1] == (frappe_text(local(30, microseconds=9)), "1", "10")
    assert [page[1:] for page in pages] == [("0", "10"), ("1", "10")]
    # The next run goes on from the last document looked at.
    second = await reconcile.reconcile_workflow(rctx)
    assert (second.handled, second.already) == (8, 1)
    assert WebhookEvent.select().count() == 23
    assert len({e.order_number for e in reconciled()}) == 23


@pytest.mark.gen_test(timeout=60)
async def test_a_document_saved_again_while_paging_does_not_hide_another(
        rctx, site, worker, monkeypatch):
    # A document of the first page saved again before the second page is asked for
    # leaves the listed window (its modified is now past it): a page asked by offset
    # would start one document too far and never see the one it skipped.
    monkeypatch.setattr(reconcile, "PAGE_SIZE", 10)
    documents = [ready(site, n, microseconds=n) for n in range(23)]
    list_documents = rctx.workflow.list_documents

    async def saved_again_after_the_first_page(*args):
        page = await list_documents(*args)
        documents[0]["modified"] = local(0)
        return page
    monkeypatch.setattr(rctx.workflow, "list_documents", saved_again_after_the_first_page)
    counts = await reconcile.reconcile_workflow(rctx)
    # The one saved again is listed again at its new time, and found handled.
    assert (counts.listed, counts.handled, counts.already) == (24, 23, 1)
    assert len({e.order_number for e in reconciled()}) == 23


@pytest.mark.gen_test(timeout=60)
async def test_documents_of_one_time_are_paged_through_by_count(rctx, site, worker,
                                                                monkeypatch):
    monkeypatch.setattr(reconcile, "PAGE_SIZE", 10)
    for n in range(23):
        ready(site, n)
    counts = await reconcile.reconcile_workflow(rctx)
    assert (counts.listed, counts.handled) == (23, 23)
    pages = [(json.loads(q["filters"])[0][2], q["limit_start"]) for q in site.listings()
             if "entity_name" in q["fields"]]
    same_time = reconcile.canonical_modified(frappe_text(local(30, microseconds=0)))
    assert [start for _, start in pages] == ["0", "10", "20"]
    assert {lower for lower, _ in pages[1:]} == {same_time}


@pytest.mark.gen_test(timeout=60)
async def test_a_run_since_a_later_time_does_not_skip_what_the_cursor_had_left(
        rctx, site, worker, monkeypatch):
    monkeypatch.setattr(reconcile, "PAGE_SIZE", 10)
    monkeypatch.setattr(reconcile, "MAX_DOCUMENTS_PER_RUN", 10)
    for n in range(15):
        ready(site, n, minutes_ago=60 - n)
    assert (await reconcile.reconcile_workflow(rctx)).handled == 10  # capped: 5 left
    # The operator asks for the last half hour only: FORM-00010..14 (50 to 46 minutes
    # ago) lie before it, and the next scheduled run must still look at them.
    since = await reconcile.reconcile_workflow(rctx, since=NOW - datetime.timedelta(
        minutes=30))
    assert since.listed == 0
    after = await reconcile.reconcile_workflow(rctx)
    assert after.handled == 5
    assert len({e.order_number for e in reconciled()}) == 15


@pytest.mark.gen_test(timeout=30)
async def test_later_runs_start_where_the_last_one_ended_with_an_overlap(rctx, site, worker,
                                                                        clock):
    await reconcile.reconcile_workflow(rctx)
    run = ReconcileRun.get(ReconcileRun.doctype == FORMATION)
    # Settled up to NOW - 120 s; the next run starts 10 minutes before that.
    assert run.cursor == "2026-11-25 18:18:00.000000" and run.succeeded_at == NOW
    clock.advance(minutes=5)
    await reconcile.reconcile_workflow(rctx)
    filters = json.loads([q for q in site.listings() if "entity_name" in q["fields"]][-1]["filters"])
    assert filters[0] == ["modified", ">=", "2026-11-25 18:18:00.000000"]


@pytest.mark.parametrize("outage", ["stopped", (401, "AuthenticationError"),
                                    (403, "PermissionError"), (500, "ImportError")])
@pytest.mark.gen_test(timeout=30)
async def test_frappe_down_or_refusing_is_logged_once_and_retried_next_run(
        rctx, site, worker, caplog, clock, outage):
    submitted(site)
    await reconcile.reconcile_workflow(rctx)  # a first success, to keep its cursor
    cursor = ReconcileRun.get(ReconcileRun.doctype == FORMATION).cursor
    submitted(site, name="FORM-00002", number="FO-9002", minutes_ago=4)
    if outage == "stopped":
        configure(rctx, workflow_url="http://127.0.0.1:9")
    else:
        site.down_with = outage
    caplog.set_level(logging.INFO, logger="receiver.reconcile")
    for _ in range(3):
        clock.advance(minutes=5)
        counts = await reconcile.reconcile_workflow(rctx)
        assert sorted(counts.failed) == [CRTC, FORMATION] and counts.handled == 0
    lines = [r for r in caplog.records if "does not list Formation Order" in r.getMessage()]
    assert len(lines) == 1
    run = ReconcileRun.get(ReconcileRun.doctype == FORMATION)
    assert (run.cursor, run.succeeded_at) == (cursor, NOW) and run.last_error
    # Back: the change made meanwhile is found by the next run.
    configure(rctx, workflow_url=site.url)
    site.down_with = None
    clock.advance(minutes=5)
    counts = await reconcile.reconcile_workflow(rctx)
    assert counts.handled == 1 and counts.failed == []
    assert "Frappe lists Formation Order again" in caplog.text
    assert ReconcileRun.get(ReconcileRun.doctype == FORMATION).last_error is None


@pytest.mark.gen_test(timeout=30)
async def test_a_document_without_a_required_field_is_reported_not_handled(
        rctx, site, worker, caplog):
    site.add(FORMATION, "FORM-00009", "Submitted", local(10), order_number="FO-9",
             state_code=None, entity_name="X LLC")
    counts = await reconcile.reconcile_workflow(rctx)
    assert (counts.unusable, counts.handled) == (1, 0)
    assert WebhookEvent.select().count() == 0 and worker.requests == []
    assert "missing field: state_code" in caplog.text


@pytest.mark.gen_test(timeout=30)
async def test_without_frappe_configured_nothing_is_asked(rctx, site):
    configure(rctx, workflow_url="")
    counts = await reconcile.reconcile_workflow(rctx)
    assert (counts.listed, counts.failed) == (0, []) and site.requests == []


@pytest.mark.gen_test(timeout=30)
async def test_outbox_rows_of_a_reconciled_change_are_its_events(rctx, site, worker):
    submitted(site)
    await reconcile.reconcile_workflow(rctx)
    [event] = reconciled()
    kinds = sorted(row.kind for row in Outbox.select().where(Outbox.event == event.id))
    assert kinds == ["job", "workflow_action"]


def test_a_page_ending_in_a_document_without_a_time_is_followed_by_offset():
    # Not a page Frappe v15 gives (every document has its modified), but one that does
    # not say where it ended must not start the next page over again.
    lower = "2026-11-25 18:18:00.000000"
    page = [{"name": f"FORM-{n}", "modified": None} for n in range(3)]
    assert reconcile._next_page(page, 10, lower) == (13, lower)


def test_change_keys_are_one_per_document_state_and_time():
    key = reconcile.change_key("formation/ready", "FORM-1", "2026-11-25 18:00:00")
    assert key == reconcile.change_key("formation/ready", "FORM-1",
                                       "2026-11-25 18:00:00.000000")
    assert key != reconcile.change_key("formation/ready", "FORM-1",
                                       "2026-11-25 18:00:00.000001")
    assert key != reconcile.change_key("formation/approved", "FORM-1", "2026-11-25 18:00:00")
    assert key != reconcile.change_key("formation/ready", "FORM-2", "2026-11-25 18:00:00")
    assert reconcile.change_key("formation/ready", "FORM-1", "None") is None
    assert reconcile.change_key("formation/ready", "FORM-1", None) is None


@pytest.mark.gen_test(timeout=60)
async def test_the_last_success_shows_in_metrics_readyz_and_the_console(
        rctx, site, worker, http_server, base_url, client):
    operator = Operator(client, base_url)
    assert (await operator.log_in()).code == 302
    page = text(await operator.get("/console/"))
    assert "CRTC Order never; Formation Order never" in page
    await reconcile.reconcile_workflow(rctx)
    metrics = samples((await client.fetch(base_url + "/metrics")).body)
    assert value(metrics, "receiver_reconcile_last_success_timestamp_seconds",
                 doctype=FORMATION) == NOW.timestamp()
    ready = json.loads((await client.fetch(base_url + "/readyz")).body)
    assert ready["reconciled"] == {CRTC: NOW.isoformat(), FORMATION: NOW.isoformat()}
    page = text(await operator.get("/console/"))
    assert "CRTC Order 2026-11-25 13:00:00; Formation Order 2026-11-25 13:00:00" in page


@pytest.mark.gen_test(timeout=60)
async def test_reconciled_events_are_marked_in_the_command_line_and_the_console(
        rctx, site, worker, database_url, settings, http_server, base_url, client):
    submitted(site)
    env = {**cli_env(database_url, settings), "WORKFLOW_TIME_ZONE": "Asia/Kolkata",
           "WORKFLOW_API_KEY": "wf-key", "WORKFLOW_API_SECRET": "wf-secret"}
    ran = await run_async(env, "reconcile", "workflow", "--since", "2026-11-25T00:00Z")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == ("looked at 1 document(s): 1 change(s) handled, "
                                  "0 held behind an earlier call of their stream, "
                                  "0 already stored, 0 recorded and not handled, "
                                  "0 not usable")
    [event] = reconciled()
    listed = await run_async(env, "events", "list")
    assert "workflow (reconciled)" in listed.stdout
    shown = await run_async(env, "events", "show", str(event.id))
    assert "source:       workflow (reconciled)" in shown.stdout
    operator = Operator(client, base_url)
    await operator.log_in()
    assert "workflow (reconciled)" in text(await operator.get("/console/events"))
    assert "(reconciled)</h1>" in text(await operator.get(f"/console/events/{event.id}"))
    again = await run_async(env, "reconcile", "workflow", "--since", "2026-11-25T00:00Z")
    assert "0 change(s) handled, 0 held behind an earlier call of their stream, 1 already " \
           "stored" in again.stdout
    assert "document/s" not in ran.stderr + again.stderr  # not a terminal: no progress


@pytest.mark.gen_test(timeout=60)
async def test_the_command_shows_its_progress_on_a_terminal(
        rctx, site, worker, database_url, settings):
    submitted(site)
    env = {**cli_env(database_url, settings), "WORKFLOW_TIME_ZONE": "Asia/Kolkata",
           "WORKFLOW_API_KEY": "wf-key", "WORKFLOW_API_SECRET": "wf-secret"}
    async with OnATerminal("reconcile", "workflow", "--since", "2026-11-25T00:00Z",
                           env=env) as terminal:
        await terminal.finish()
    assert terminal.returncode == 0, terminal.shown
    # The count so far and the rate (Frappe's pages do not say how many there are).
    assert re.search(r"looking at Frappe's documents: 1document \[\d\d:\d\d, +[\d.?]+document/s\]",
                     terminal.shown), terminal.shown
    assert terminal.stdout.startswith("looked at 1 document(s): 1 change(s) handled")


@pytest.mark.gen_test(timeout=60)
async def test_the_command_says_when_frappe_does_not_list(rctx, site, database_url, settings):
    site.down_with = (401, "AuthenticationError")
    env = {**cli_env(database_url, settings), "WORKFLOW_API_KEY": "wf-key",
           "WORKFLOW_API_SECRET": "wf-secret"}
    ran = await run_async(env, "reconcile", "workflow")
    assert ran.returncode == 1
    assert "Frappe did not list Formation Order" in ran.stderr
    no_frappe = await run_async({**env, "WORKFLOW_URL": ""}, "reconcile", "workflow")
    assert no_frappe.returncode == 2 and "WORKFLOW_URL is not set" in no_frappe.stderr


@postgres_only
@pytest.mark.gen_test(timeout=60)
async def test_the_command_waits_for_no_run_another_process_holds(
        rctx, site, database_url, settings, other_connection):
    import scheduler
    submitted(site)
    lock_id = scheduler.JOBS_BY_NAME["reconcile"].lock_id
    cursor = other_connection.cursor()
    cursor.execute("SELECT pg_advisory_lock(%s)", (lock_id,))
    other_connection.commit()
    env = {**cli_env(database_url, settings), "WORKFLOW_TIME_ZONE": "Asia/Kolkata",
           "WORKFLOW_API_KEY": "wf-key", "WORKFLOW_API_SECRET": "wf-secret"}
    # The document was changed at NOW, the clock of the other tests: a run of the real
    # clock's day looks that far back only when told to.
    since = ("--since", "2026-11-25T00:00Z")
    ran = await run_async(env, "reconcile", "workflow", *since)
    assert ran.returncode == 1
    assert "a reconciliation is running in another process" in ran.stderr
    assert site.requests == [] and reconciled() == []
    cursor.execute("SELECT pg_advisory_unlock(%s)", (lock_id,))
    other_connection.commit()
    assert (await run_async(env, "reconcile", "workflow", *since)).returncode == 0
    assert len(reconciled()) == 1


def test_the_scheduler_runs_reconciliation_unless_turned_off():
    import scheduler
    job = scheduler.JOBS_BY_NAME["reconcile"]
    assert job.run is reconcile.reconcile_workflow and job.at_start
    assert job.every(Settings()) == 300
    assert job.every(Settings.from_env({"WORKFLOW_RECONCILE_MINUTES": "0"})) == 0


@pytest.mark.gen_test(timeout=30)
async def test_a_change_sent_again_after_the_old_window_is_still_the_same_change(
        rctx, site, worker, post, clock):
    body = webhook_body(submitted(site), "state_code", "entity_name")
    await post("/api/v1/webhooks/formation/submitted", body, AUTH)
    clock.advance(hours=40)  # past WORKFLOW_DEDUP_HOURS, which bodies without modified keep
    status, reply, _ = await post("/api/v1/webhooks/formation/submitted", body, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "name_search_dispatched"})
    assert WebhookEvent.select().count() == 1 and len(worker.requests) == 1


@pytest.mark.gen_test(timeout=30)
async def test_a_copy_stored_under_the_hourly_key_before_still_matches(
        rctx, site, worker, post, clock):
    body = webhook_body(submitted(site), "state_code", "entity_name")
    hour = int(clock().timestamp()) // 3600
    digest = hashlib.sha256(body.encode()).hexdigest()
    WebhookEvent.create(source="workflow", event_type="formation/submitted",
                        dedup_key=f"formation/submitted:{digest}:h{hour - 1}",
                        order_number="FO-9001", payload=body, status="processed")
    await post("/api/v1/webhooks/formation/submitted", body, AUTH)
    assert WebhookEvent.select().count() == 1 and worker.requests == []


@pytest.mark.gen_test(timeout=120)
async def test_a_slow_database_stops_a_run_cleanly_and_the_next_goes_on(
        rctx, site, worker, caplog, clock, db):
    """The database thread held after the first document, as a frozen database holds it
    (tests/test_door.py): the run waits WORKFLOW_RECONCILE_DATABASE_SECONDS in all, then
    stops; nothing of the second document is stored, the cursor stays, nothing is
    spooled, the circuit stays closed, and it is said once. Released, the next run goes
    on."""
    circuit = Circuit(db)
    circuit.attach()
    try:
        configure(rctx, workflow_reconcile_database_seconds=3)
        await reconcile.reconcile_workflow(rctx)  # a first run, to keep its cursor
        cursor = ReconcileRun.get(ReconcileRun.doctype == FORMATION).cursor
        for n in range(3):
            submitted(site, name=f"FORM-{n:05}", number=f"FO-{n}", minutes_ago=6 - n)
        clock.advance(minutes=5)
        caplog.set_level(logging.INFO, logger="receiver.reconcile")
        release = threading.Event()
        held = []

        def hold_the_database(looked_at, _total):
            if looked_at == 1:
                held.append(rctx.background(rctx.db(functools.partial(release.wait, 20))))

        stopped = await reconcile.reconcile_workflow(rctx, progress=hold_the_database)
        assert stopped.stopped and (stopped.listed, stopped.handled) == (1, 1)
        assert not circuit.is_open and not spool.backlog(rctx.settings.spool_dir)
        # Held again from the start: stopped again, and not said again.
        held.append(rctx.background(rctx.db(functools.partial(release.wait, 20))))
        again = await reconcile.reconcile_workflow(rctx)
        assert again.stopped and again.listed == 0 and not circuit.is_open
        release.set()
        await asyncio.gather(*held)
        assert WebhookEvent.select().count() == 1 and len(worker.requests) == 1
        run = ReconcileRun.get(ReconcileRun.doctype == FORMATION)
        assert run.cursor == cursor and run.succeeded_at == NOW
        said = [r for r in caplog.records if "reconciliation stopped" in r.getMessage()]
        assert len(said) == 1 and "after 1 document(s)" in said[0].getMessage()

        going_on = await reconcile.reconcile_workflow(rctx)
        assert not going_on.stopped and (going_on.handled, going_on.already) == (2, 1)
        assert "within WORKFLOW_RECONCILE_DATABASE_SECONDS again" in caplog.text
        assert sorted(r.json["order_number"] for r in worker.requests) == [
            "FO-0", "FO-1", "FO-2"]
        assert ReconcileRun.get(ReconcileRun.doctype == FORMATION).cursor != cursor
    finally:
        await circuit.detach()


@pytest.mark.gen_test(timeout=60)
async def test_the_command_says_when_the_run_stopped_at_its_database_allowance(
        rctx, site, worker, database_url, settings):
    submitted(site)
    env = {**cli_env(database_url, settings), "WORKFLOW_TIME_ZONE": "Asia/Kolkata",
           "WORKFLOW_API_KEY": "wf-key", "WORKFLOW_API_SECRET": "wf-secret",
           # Spent at the first wait: a database slower than any allowance.
           "WORKFLOW_RECONCILE_DATABASE_SECONDS": "0.000001"}
    ran = await run_async(env, "reconcile", "workflow", "--since", "2026-11-25T00:00Z")
    assert ran.returncode == 1
    assert "stopped before the end" in ran.stderr and "Traceback" not in ran.stderr
    assert WebhookEvent.select().count() == 0 and worker.requests == []


def test_the_database_allowance_of_a_run_is_a_setting():
    assert Settings().workflow_reconcile_database_seconds == 60
    assert Settings.from_env({"WORKFLOW_RECONCILE_DATABASE_SECONDS": "2.5"}) \
        .workflow_reconcile_database_seconds == 2.5
    for wrong in ("0", "-1", "inf"):
        with pytest.raises(ConfigurationError, match="WORKFLOW_RECONCILE_DATABASE_SECONDS"):
            Settings.from_env({"WORKFLOW_RECONCILE_DATABASE_SECONDS": wrong})


@pytest.mark.gen_test(timeout=30)
async def test_a_webhook_held_past_the_settle_time_of_a_document_saved_since_is_not_handled_again(
        rctx, site, worker, post):
    """The webhook of the change to Submitted waits in Frappe's queue; meanwhile the
    document is saved again in the same state, and a run finds it (under the later
    `modified`). The webhook that comes at last names the earlier `modified`."""
    held = webhook_body(submitted(site, minutes_ago=20), "state_code", "entity_name")
    submitted(site, minutes_ago=10, notes="called the customer")
    assert (await reconcile.reconcile_workflow(rctx)).handled == 1
    status, reply, _ = await post("/api/v1/webhooks/formation/submitted", held, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "name_search_dispatched"})
    assert WebhookEvent.select().count() == 1
    assert len(worker.requests) == 1 and len(site.actions) == 1


@pytest.mark.gen_test(timeout=30)
async def test_a_late_webhook_of_a_later_return_to_the_state_is_a_new_change(
        rctx, site, worker, post):
    submitted(site, minutes_ago=40)
    assert (await reconcile.reconcile_workflow(rctx)).handled == 1
    moved = site.add(FORMATION, "FORM-00001", "Name Available", local(30),
                     order_number="FO-9001")
    await post("/api/v1/webhooks/formation/name-available", webhook_body(moved), AUTH)
    back = webhook_body(submitted(site, minutes_ago=20), "state_code", "entity_name")
    status, _, _ = await post("/api/v1/webhooks/formation/submitted", back, AUTH)
    assert status == 200
    assert [r.json["action"] for r in worker.requests].count("name_search") == 2


@pytest.mark.gen_test(timeout=30)
async def test_a_late_webhook_while_the_database_is_down_is_spooled_as_any_other(
        rctx, site, worker, post, db):
    held = webhook_body(submitted(site, minutes_ago=20), "state_code", "entity_name")
    with database_down(db):
        status, reply, _ = await post("/api/v1/webhooks/formation/submitted", held, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "queued"})
    assert spool.backlog(rctx.settings.spool_dir)
