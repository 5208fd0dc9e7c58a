"""Every Frappe state change handled once, by webhook or by reconciliation, each one, in
order: the findings of the run against a real Frappe v15.54.1 site, each played with the
site's own answers (tests/frappe_site.py: its list, its workflow log through get_docinfo,
its time zone through get_time_zone) and a controlled clock."""
import dataclasses
import json

import pytest

from clients.http import Result
from domain import reconcile
from engine import inbox, outbox
from models import Outbox, ReconcileRun, WebhookEvent
from tests.conftest import WEBHOOK_SECRET
from tests.service_process import database_down
from tests.test_ops_endpoints import samples, value
from tests.test_reconcile import (  # noqa: F401 (fixtures)
    CRTC, FORMATION, NOW, configure, local, rctx, reconciled, settings, site, submitted,
    webhook_body)

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET}


def jobs(worker):
    return [(r.json["action"], r.headers["Idempotency-Key"]) for r in worker.posts]


def notices():
    return [json.loads(row.payload)["subject"] for row in
            Outbox.select().where(Outbox.kind == "email").order_by(Outbox.id)]


def incorporated(site, minutes_ago=20):
    """CA-3005 through Client Selection (30 minutes ago) to Incorporated, by ops."""
    site.add(CRTC, "CRTC-00005", "Client Selection", local(30), order_number="CA-3005")
    return site.add(CRTC, "CRTC-00005", "Incorporated", local(minutes_ago),
                    order_number="CA-3005", incorporation_number="BC1234567")


@pytest.mark.gen_test(timeout=30)
async def test_two_states_entered_in_an_outage_are_both_handled_in_the_order_entered(
        rctx, site, worker):
    """CA-3005 went Client Selection -> Incorporated while the service was down: its
    file_bc_incorporation job was never sent (the run saw only the current state)."""
    incorporated(site)
    counts = await reconcile.reconcile_workflow(rctx)
    assert (counts.handled, counts.already) == (2, 0)
    assert [action for action, _ in jobs(worker)] == ["file_bc_incorporation",
                                                     "generate_crtc_docs"]
    assert [e.event_type for e in reconciled()] == ["crtc/funds-available",
                                                    "crtc/incorporated"]


@pytest.mark.gen_test(timeout=30)
async def test_a_late_webhook_of_the_earlier_state_and_an_edit_handle_nothing_again(
        rctx, site, worker, post, clock):
    """The real run: Frappe's RQ worker stopped, its webhooks came late; the late one of
    the earlier state became the order's newest event, an ops user edited a note, and
    the next run handled the current state again, its job under a new Idempotency-Key."""
    document = incorporated(site)
    await reconcile.reconcile_workflow(rctx)
    late = webhook_body({**document, "modified": local(30)})
    status, _, _ = await post("/api/v1/webhooks/crtc/funds-available", late, AUTH)
    assert status == 200
    site.edit(CRTC, "CRTC-00005", local(5), notes="called the client")
    clock.advance(minutes=5)
    counts = await reconcile.reconcile_workflow(rctx)
    assert counts.handled == 0
    clock.advance(minutes=5)
    await reconcile.reconcile_workflow(rctx)
    sent = jobs(worker)
    assert [action for action, _ in sent] == ["file_bc_incorporation", "generate_crtc_docs"]
    assert len({key for _, key in sent}) == 2
    assert WebhookEvent.select().count() == 2


@pytest.mark.gen_test(timeout=30)
async def test_a_change_whose_predecessors_webhook_has_not_come_is_placed_after_it_by_the_log(
        rctx, site, worker, post, clock):
    """The real site after an outage: Frappe's worker, behind with its retries, delivered
    Incorporated's webhook before Client Selection's (and before the start-up run).
    Handled alone, generate_crtc_docs went first and Client Selection's change was then
    older than the one handled: file_bc_incorporation was never sent. The workflow log
    places Client Selection first; its webhook, when it comes, is that same change."""
    document = incorporated(site, minutes_ago=1)
    status, reply, _ = await post("/api/v1/webhooks/crtc/incorporated",
                                  webhook_body(document, "incorporation_number"), AUTH)
    assert (status, reply) == (200, {"received": True, "action": "crtc_docs_dispatched"})
    assert [action for action, _ in jobs(worker)] == ["file_bc_incorporation",
                                                     "generate_crtc_docs"]
    late = webhook_body({**document, "modified": local(30)})
    status, reply, _ = await post("/api/v1/webhooks/crtc/funds-available", late, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "incorporation_dispatched"})
    # A run finds both changes in the log: each is the one already stored.
    clock.advance(minutes=5)
    counts = await reconcile.reconcile_workflow(rctx)
    assert (counts.handled, counts.already) == (0, 2)
    assert [action for action, _ in jobs(worker)] == ["file_bc_incorporation",
                                                     "generate_crtc_docs"]
    assert WebhookEvent.select().count() == 2 and notices() == []


@pytest.mark.gen_test(timeout=30)
async def test_a_webhook_older_than_the_state_handled_is_history_however_soon_it_comes(
        rctx, site, worker, post, clock):
    """Frappe's list not answering, Incorporated's change was handled alone; Client
    Selection's webhook came 6 s after it (a second Frappe worker): older than the change
    handled, it is recorded and never handled, however soon it comes (it was handled as
    new within the old settle time, its job after generate_crtc_docs)."""
    site.add(CRTC, "CRTC-00005", "Client Selection", local(0.2), order_number="CA-3005")
    document = site.add(CRTC, "CRTC-00005", "Incorporated", local(0.1),
                        order_number="CA-3005", incorporation_number="BC1234567")
    site.down_with = (502, "BadGateway")
    await post("/api/v1/webhooks/crtc/incorporated",
               webhook_body(document, "incorporation_number"), AUTH)
    site.down_with = None
    clock.advance(seconds=6)
    late = webhook_body({**document, "modified": local(0.2)})
    status, reply, _ = await post("/api/v1/webhooks/crtc/funds-available", late, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "recorded_not_handled"})
    older = WebhookEvent.get(WebhookEvent.event_type == "crtc/funds-available")
    assert older.status == "ignored"
    assert older.last_error.startswith("older than the state change handled as event #1 "
                                       "(crtc/incorporated): recorded, the job "
                                       "'file_bc_incorporation' not sent")
    assert notices() == ["crtc/funds-available of CRTC-00005 not handled"]
    assert [action for action, _ in jobs(worker)] == ["generate_crtc_docs"]


@pytest.mark.gen_test(timeout=30)
async def test_one_change_stored_twice_by_two_processes_is_handled_once(rctx, site, worker):
    """Two instances on one PostgreSQL: a run in one stored Incorporated's change from the
    workflow log while the other stored its webhook, each before the other's commit, so
    that neither store found the other's copy (a real two-instance run: up to 49 such
    pairs). Whichever is handled second is the first's copy: recorded, nothing sent
    again, nobody told."""
    document = incorporated(site)
    await reconcile.reconcile_workflow(rctx)
    from_the_log = WebhookEvent.get(WebhookEvent.event_type == "crtc/incorporated")
    body = webhook_body(document, "incorporation_number")
    placed = rctx.plugins["workflow"].placed("crtc/incorporated", json.loads(body))
    # Stored as the other instance's store left it, its keys and place its own: `record`
    # looks for no other finder's copy.
    stored = await inbox.record(rctx, "workflow", "crtc/incorporated", placed.same, body,
                                order_number="CA-3005", stream=placed.stream,
                                version=placed.version)
    assert stored is not None and stored.created

    assert await inbox.process(rctx, stored.event) == "ignored"
    copy = WebhookEvent.get_by_id(stored.event.id)
    assert copy.last_error == (f"the same fact as event #{from_the_log.id}, handled first: "
                               "nothing sent again")
    assert [action for action, _ in jobs(worker)] == ["file_bc_incorporation",
                                                     "generate_crtc_docs"]
    assert notices() == []


@pytest.mark.gen_test(timeout=30)
async def test_a_late_webhook_of_a_state_left_since_follows_its_paths_rule(
        rctx, site, worker, post, clock):
    """The real site after an 8 s stop: Frappe's queue delivered Awaiting Funds' webhook
    once the document was in Incorporated. The run, had it found it first, would have
    recorded it; the webhook sent register_awaiting_funds for an incorporated order. Late
    (5 s past its save), its document is read first: the left state follows its path's
    rule whichever finder comes first, and the later changes go in order."""
    waiting = site.add(CRTC, "CRTC-00005", "Awaiting Funds", local(0.3), order_number="CA-3005")
    site.add(CRTC, "CRTC-00005", "Client Selection", local(0.2), order_number="CA-3005")
    site.add(CRTC, "CRTC-00005", "Incorporated", local(0.1), order_number="CA-3005",
             incorporation_number="BC1234567")
    status, reply, _ = await post("/api/v1/webhooks/crtc/awaiting-funds",
                                  webhook_body(waiting), AUTH)
    assert (status, reply) == (200, {"received": True, "action": "recorded_not_handled"})
    assert [action for action, _ in jobs(worker)] == ["file_bc_incorporation",
                                                     "generate_crtc_docs"]
    assert notices() == ["crtc/awaiting-funds of CRTC-00005 not handled"]
    assert WebhookEvent.select().count() == 3


@pytest.mark.gen_test(timeout=30)
async def test_a_late_webhook_while_the_database_is_down_hands_nothing_over_beside_it(
        rctx, site, worker, post, db, clock):
    """With the database down a late webhook's document is not read: its changes would be
    spooled beside the webhook, and the drain, which matches no change against another
    finder's, would store the webhook's change twice and send its job twice."""
    document = incorporated(site, minutes_ago=20)
    with database_down(db):
        status, reply, _ = await post("/api/v1/webhooks/crtc/incorporated",
                                      webhook_body(document, "incorporation_number"), AUTH)
    assert (status, reply) == (200, {"received": True, "action": "queued"})
    assert await inbox.drain_spool(rctx) == 1
    clock.advance(minutes=5)
    await reconcile.reconcile_workflow(rctx)
    assert [action for action, _ in jobs(worker)] == ["generate_crtc_docs"]
    assert [(e.event_type, e.status) for e in WebhookEvent.select().order_by(WebhookEvent.id)] \
        == [("crtc/incorporated", "processed"), ("crtc/funds-available", "ignored")]


@pytest.mark.gen_test(timeout=30)
async def test_a_state_left_before_it_was_found_is_recorded_and_told_where_its_action_no_longer_applies(
        rctx, site, worker, smtp):
    """FO-9001 was submitted and moved on to Name Check by hand (Start Name Check applied
    in Frappe) while the service was down: the action cannot apply any more."""
    submitted(site, minutes_ago=30)
    site.add(FORMATION, "FORM-00001", "Name Check", local(25), order_number="FO-9001",
             state_code="DE", entity_name="Acme LLC")
    counts = await reconcile.reconcile_workflow(rctx)
    assert (counts.handled, counts.recorded) == (0, 1)
    [event] = reconciled()
    assert (event.event_type, event.status) == ("formation/submitted", "ignored")
    assert event.last_error == ("the document had left for 'Name Check' when it was found: "
                                "recorded, the action 'Start Name Check' and the job "
                                "'name_search' not sent")
    assert worker.posts == [] and site.actions == []
    await outbox.send_due(rctx)
    [(_, mail)] = smtp.messages
    assert mail["Subject"] == "formation/submitted of FORM-00001 not handled"
    # Each on a line of its own (the two ran together: "(Frappe's time)Now in:").
    lines = mail.get_body(("plain",)).get_content().splitlines()
    assert "Now in:    Name Check" in lines
    assert [line for line in lines if line.startswith("Changed:")][0].endswith(
        "(Frappe's time)")


@pytest.mark.gen_test(timeout=30)
async def test_the_time_zone_is_frappes_own(rctx, site, worker):
    """A fresh v15 site names no time zone (its System Settings' is empty): Frappe writes
    its times in Asia/Kolkata. With the old default (UTC) every run said "looked at 0"
    and changes would have been found 5.5 h late."""
    site.time_zone = None
    submitted(site)
    counts = await reconcile.reconcile_workflow(rctx)
    assert counts.handled == 1
    assert rctx.workflow.time_zone == "Asia/Kolkata"
    asked = [r.path for r in site.requests]
    assert asked[0] == "/api/method/frappe.client.get_time_zone"


@pytest.mark.gen_test(timeout=60)
async def test_a_time_zone_setting_that_disagrees_with_frappe_is_said_loudly(
        rctx, site, worker, http_server, base_url, client, caplog):
    configure(rctx, workflow_time_zone="UTC")
    submitted(site)
    ready = json.loads((await client.fetch(base_url + "/readyz")).body)
    assert ready["destination_warnings"] == {"workflow": {"time_zone": (
        "WORKFLOW_TIME_ZONE is UTC, but Frappe's System Settings say Asia/Kolkata: "
        "Frappe's is used; set it right or unset it")}}
    assert "Frappe: WORKFLOW_TIME_ZONE is UTC" in caplog.text
    metrics = samples((await client.fetch(base_url + "/metrics")).body)
    assert value(metrics, "receiver_destination_warning", destination="workflow",
                 warning="time_zone") == 1
    # Frappe's is used: the change is found.
    assert (await reconcile.reconcile_workflow(rctx)).handled == 1


@pytest.mark.gen_test(timeout=60)
async def test_a_run_whose_window_does_not_meet_frappes_times_says_so(
        rctx, site, worker, http_server, base_url, client):
    """Frappe says UTC, yet writes its times in Asia/Kolkata (a site whose zone was
    changed, a clock off): every change looks 5.5 h ahead, younger than the settle time,
    and would be left to a webhook that never comes."""
    site.time_zone = "UTC"
    submitted(site)
    counts = await reconcile.reconcile_workflow(rctx)
    assert counts.handled == 0 and counts.quiet == [FORMATION]
    ready = json.loads((await client.fetch(base_url + "/readyz")).body)
    assert "ahead of this service's clock in UTC" in ready["reconcile_problems"][FORMATION]
    metrics = samples((await client.fetch(base_url + "/metrics")).body)
    assert value(metrics, "receiver_reconcile_problem", doctype=FORMATION) == 1


@pytest.mark.gen_test(timeout=30)
async def test_changes_frappe_made_before_a_window_that_found_nothing_are_said(
        rctx, site, worker, clock):
    """Times read in a zone east of the site's, the other way round: Frappe's newest
    change lies before the run's window, which lists nothing, while documents change."""
    site.time_zone = "Pacific/Kiritimati"
    submitted(site, minutes_ago=60)
    assert (await reconcile.reconcile_workflow(rctx)).quiet == []  # the first: a day back
    submitted(site, name="FORM-00002", number="FO-9002", minutes_ago=10)
    clock.advance(minutes=5)
    counts = await reconcile.reconcile_workflow(rctx)
    assert counts.listed == 0 and counts.quiet == [FORMATION]
    run = ReconcileRun.get(ReconcileRun.doctype == FORMATION)
    assert "FORM-00002 was modified at" in run.last_error
    assert "changes go unseen" in run.last_error


@pytest.mark.gen_test(timeout=30)
async def test_frappe_back_sends_its_waiting_actions_at_once_in_each_orders_sequence(
        rctx, site, post, clock, worker):
    """Frappe stopped (its proxy answering 502) with two orders' actions on their way:
    down within OUTBOUND_DOWN_AFTER_SECONDS however few sends there were (the real run:
    66 s); back, every action goes in the run that finds it back (it went 27 s and 141 s
    after, each at its own retry time), each order's in its sequence."""
    site.down_with = (502, "BadGateway")
    body = {"order_name": "FORM-1", "order_number": "FO-1", "state_code": "DE",
            "entity_name": "Acme LLC"}
    await post("/api/v1/webhooks/formation/submitted", body, AUTH)
    await post("/api/v1/webhooks/formation/submitted",
               {**body, "order_name": "FORM-2", "order_number": "FO-2"}, AUTH)
    await post("/api/v1/webhooks/formation/name-available",
               {"order_name": "FORM-1", "order_number": "FO-1"}, AUTH)
    workflow = rctx.destinations.by_name["workflow"]
    assert workflow.failures == 2 and workflow.up  # fewer than OUTBOUND_DOWN_AFTER
    # Past the bound, and past the first backoffs (15-30 s): each action tried again.
    clock.advance(seconds=31)
    await outbox.send_due(rctx)
    assert workflow.state == "down"
    assert rctx.settings.outbound_down_after_seconds < 31
    # Frappe answers again; every row waits on its backoff, 30 s to a minute ahead: the
    # first probe is the first of them in line.
    site.down_with = None
    clock.advance(seconds=6)  # the first probe
    await outbox.send_due(rctx)
    assert workflow.state == "up"
    sent = [(json.loads(a["doc"])["name"], a["action"]) for a in site.actions]
    assert sent == [("FORM-1", "Start Name Check"), ("FORM-2", "Start Name Check"),
                    ("FORM-1", "Start Filing")] or sent == [
        ("FORM-2", "Start Name Check"), ("FORM-1", "Start Name Check"),
        ("FORM-1", "Start Filing")]
    rows = Outbox.select().where(Outbox.kind == "workflow_action")
    assert {row.status for row in rows} == {"sent"}


def test_what_each_path_does_with_a_state_already_left_is_its_table_in_behaviour_md(rctx):
    """BEHAVIOUR.md 4.1.1 rule 4, from the plugins themselves."""
    rules = {path: rctx.plugins["workflow"].get(path).left_rule
             for path, _ in rctx.settings.workflow_reconcile_states}
    assert rules == {
        "formation/submitted": "told", "formation/name-available": "told",
        "formation/filed-needs-ein": "told", "formation/filed-skip-ein": "told",
        "formation/ein-obtained": "told", "formation/approved": "told",
        "formation/ready": "handled", "crtc/awaiting-funds": "told",
        "crtc/funds-available": "handled", "crtc/incorporated": "handled"}


@pytest.mark.gen_test(timeout=30)
async def test_a_list_frappe_answers_finds_it_back_and_leaves_a_misconfiguration_standing(
        rctx, site, worker):
    """On the real site a run's list (of the CRTC doctype) cleared the misspelled
    WORKFLOW_DOCTYPE the start-up check had found."""
    workflow = rctx.destinations.by_name["workflow"]
    workflow.misconfigured = "Formation Ordr: HTTP 404 reading Formation Ordr"
    for effect in range(rctx.settings.outbound_down_after):
        workflow.observe(Result.failed("HTTP 502: BadGateway", status=502), effect)
    assert workflow.state == "misconfigured" and not workflow.up
    await reconcile.reconcile_workflow(rctx)
    assert workflow.up and workflow.back
    assert workflow.misconfigured == "Formation Ordr: HTTP 404 reading Formation Ordr"
