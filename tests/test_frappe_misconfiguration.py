"""Frappe misconfigured, as the real v15 site showed it: a rotated API key (401 on every
call), a misspelled WORKFLOW_DOCTYPE (500 ImportError), and Frappe's own reason for a
refusal. Each is its own signal: the actions wait (credentials) or are given up at once
(doctype), Frappe is not taken for down, and last_error says what Frappe said. Frappe is
a real HTTP peer on loopback answering with v15's error replies; a controlled clock."""
import dataclasses
import functools
import json

import pytest

from app.context import Context
from engine import outbox
from ops import operator as operator_commands
from models import Outbox
from tests.conftest import WEBHOOK_SECRET
from tests.console_helpers import console_settings, logged_in, operator, text  # noqa: F401
from tests.test_ops_endpoints import get, samples, scheduled, spool, value  # noqa: F401 (fixtures)

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
# Frappe v15's error replies (frappe.utils.response.report_error): the exception's type,
# its last line, the messages it showed as JSON strings inside a JSON list, and the
# traceback.
CREDENTIALS_REFUSED = (401, {
    "exception": "frappe.exceptions.AuthenticationError", "exc_type": "AuthenticationError",
    "exc": json.dumps(["Traceback (most recent call last): ... AuthenticationError"])})
DOCTYPE_MISSPELLED = (500, {
    "exception": "ImportError: Module import failed for Formation Ordr, the DocType you're "
                 "trying to open might be deleted.",
    "exc_type": "ImportError",
    "exc": json.dumps(["Traceback (most recent call last):\n  File \"apps/frappe/frappe/"
                       "model/base_document.py\", line 76, in import_controller\n" * 8])})
TRANSITION_REFUSED = (417, {
    "exception": "frappe.model.workflow.WorkflowTransitionError: Not a valid Workflow Action",
    "exc_type": "WorkflowTransitionError",
    "_server_messages": json.dumps([json.dumps({
        "message": "Not a valid Workflow Action: <strong>Start Name Check</strong>",
        "title": "Message", "indicator": "red", "raise_exception": 1})]),
    "exc": json.dumps(["Traceback (most recent call last): ..." * 20])})
WHO = (200, {"message": "receiver@erp.test"})
# The real site's answers (2026-11-28): the doctype's active Workflow listed, and the
# site's time zone (frappe.client.get_time_zone; null when System Settings name none).
ACTIVE_WORKFLOW = (200, {"data": [{"name": "Formation Order Flow"}]})
TIME_ZONE = (200, {"message": {"time_zone": "Asia/Kolkata"}})


@pytest.fixture
def settings(settings):
    """With the console, for the overview's test."""
    return console_settings(settings)
LISTED = (200, {"data": [{"name": "FORM-00001"}]})


def submitted(number):
    return {"order_name": f"ORD-{number}", "order_number": f"FO-{number}",
            "state_code": "WY", "entity_name": "Acme LLC"}


async def submit(post, number):
    status, _, _ = await post("/api/v1/webhooks/formation/submitted", submitted(number), AUTH)
    assert status == 200


def actions():
    return list(Outbox.select().where(Outbox.kind == "workflow_action").order_by(Outbox.id))


def admin_notices():
    return [json.loads(row.payload)["subject"] for row in
            Outbox.select().where(Outbox.kind == "email").order_by(Outbox.id)]


@pytest.mark.gen_test
async def test_a_rotated_api_key_holds_the_actions_and_tells_the_administrator_once(
        post, ctx, clock, frappe, worker):
    clock.set(2026, 11, 20, 9, 0)
    frappe.fail_with(*CREDENTIALS_REFUSED)
    for number in range(1, 4):
        await submit(post, number)
    await ctx.drain_background()
    workflow = ctx.destinations.by_name["workflow"]
    assert workflow.state == "credentials refused"
    rows = actions()
    # The first was refused; the others wait behind the refusal, untried.
    assert [row.status for row in rows] == ["pending"] * 3
    assert rows[0].last_error == "HTTP 401: AuthenticationError"
    assert len(frappe.requests) == 1
    assert admin_notices() == ["Destination workflow refuses our credentials"]
    metrics = samples(await ctx.metrics.exposition(ctx))
    assert value(metrics, "receiver_destination_credentials_refused",
                 destination="workflow") == 1

    # The key is fixed on Frappe's side: the next probe goes through, the rest follow.
    frappe.fail_with(200, {"message": {"name": "ORD-1"}})
    for _ in range(6):
        clock.advance(seconds=30)
        await outbox.send_due(ctx)
    assert [row.status for row in actions()] == ["sent"] * 3
    assert workflow.state == "up"
    assert admin_notices() == ["Destination workflow refuses our credentials"]


@pytest.mark.gen_test
async def test_a_misspelled_doctype_is_given_up_at_once_and_frappe_is_not_taken_for_down(
        post, ctx, clock, frappe, worker):
    clock.set(2026, 11, 20, 9, 0)
    frappe.fail_with(*DOCTYPE_MISSPELLED)
    sends = ctx.settings.outbound_down_after + 2
    for number in range(1, sends + 1):
        await submit(post, number)
    rows = actions()
    assert [(row.status, row.attempts) for row in rows] == [("dead", 1)] * sends
    assert rows[0].last_error == (
        "HTTP 500: ImportError: Module import failed for Formation Ordr, the DocType you're "
        "trying to open might be deleted.")
    workflow = ctx.destinations.by_name["workflow"]
    assert workflow.up and workflow.state == "misconfigured"
    assert workflow.problem == rows[0].last_error


@pytest.mark.gen_test
async def test_a_refusal_keeps_frappes_own_message_not_its_traceback(
        post, ctx, clock, frappe, worker):
    frappe.responses = [TRANSITION_REFUSED, (404, {"exc_type": "DoesNotExistError"})]
    await submit(post, 1)
    [row] = actions()
    assert row.status == "dead"
    assert row.last_error == ("HTTP 417: WorkflowTransitionError: Not a valid Workflow "
                              "Action: Start Name Check; read back: the document's state "
                              "could not be read (HTTP 404 reading Formation Order ORD-1: "
                              "DoesNotExistError)")


@pytest.mark.gen_test
async def test_an_action_on_a_document_frappe_does_not_have_is_not_a_misconfiguration(
        post, ctx, frappe, worker):
    # apply_workflow loads the document: one deleted (or never made) is a 404
    # DoesNotExistError naming it. Our settings are fine (a misspelled doctype is a 500
    # ImportError there): that action is given up, the destination stays up.
    frappe.responses = [(404, {
        "exception": "frappe.exceptions.DoesNotExistError: Formation Order ORD-1 not found",
        "exc_type": "DoesNotExistError",
        "_server_messages": json.dumps([json.dumps({
            "message": "Formation Order ORD-1 not found", "title": "Message",
            "indicator": "red", "raise_exception": 1})])})]
    await submit(post, 1)
    [row] = actions()
    assert (row.status, row.last_error) == (
        "dead", "HTTP 404: DoesNotExistError: Formation Order ORD-1 not found")
    workflow = ctx.destinations.by_name["workflow"]
    assert (workflow.state, workflow.problem) == ("up", None)
    metrics = samples(await ctx.metrics.exposition(ctx))
    assert value(metrics, "receiver_destination_misconfigured", destination="workflow") == 0


@pytest.mark.gen_test
async def test_readyz_checks_frappes_credentials_and_caches_the_answer(
        get, ctx, clock, frappe, spool, scheduled):
    clock.set(2026, 11, 20, 9, 0)
    frappe.fail_with(*CREDENTIALS_REFUSED)
    code, response = await get("/readyz")
    body = json.loads(response.body)
    assert code == 503  # no scheduler in this test; Frappe's state is not a reason
    assert body["destinations"]["workflow"] == "credentials refused"
    assert body["destination_problems"] == {"workflow": "HTTP 401 reading who we are: "
                                                        "AuthenticationError"}
    [asked] = frappe.requests
    assert asked.path == "/api/method/frappe.auth.get_logged_user"
    assert asked.headers["Authorization"] == "token wf-key:wf-secret"
    await ctx.drain_background()
    assert admin_notices() == ["Destination workflow refuses our credentials"]

    # Probed every few seconds, /readyz asks Frappe again only once its answer is old.
    frappe.fail_with(*WHO)
    frappe.responses = [WHO, LISTED, LISTED, ACTIVE_WORKFLOW, ACTIVE_WORKFLOW, TIME_ZONE]
    clock.advance(seconds=30)
    await get("/readyz")
    assert len(frappe.requests) == 1
    clock.advance(seconds=31)
    code, response = await get("/readyz")
    assert [r.path for r in frappe.requests[1:]] == [
        "/api/method/frappe.auth.get_logged_user", "/api/resource/Formation%20Order",
        "/api/resource/CRTC%20Order", "/api/resource/Workflow", "/api/resource/Workflow",
        "/api/method/frappe.client.get_time_zone"]
    body = json.loads(response.body)
    assert body["destinations"]["workflow"] == "up" and "destination_problems" not in body
    assert "destination_warnings" not in body


@pytest.mark.parametrize("listing,problem", [
    (DOCTYPE_MISSPELLED, "Formation Order: HTTP 500 reading Formation Order: ImportError: "
                         "Module import failed for Formation Ordr, the DocType you're trying "
                         "to open might be deleted."),
    ((404, {"exc_type": "DoesNotExistError", "exception": "frappe.exceptions."
            "DoesNotExistError: DocType Formation Order not found"}),
     "Formation Order: HTTP 404 reading Formation Order: DoesNotExistError: DocType "
     "Formation Order not found"),
    ((403, {"exc_type": "PermissionError", "exception": "frappe.exceptions.PermissionError"}),
     "Formation Order: HTTP 403 reading Formation Order: PermissionError"),
], ids=["misspelled", "not-found", "not-readable"])
@pytest.mark.gen_test
async def test_the_check_names_a_doctype_frappe_does_not_show_us(
        get, ctx, clock, frappe, spool, listing, problem):
    frappe.responses = [WHO, listing]
    code, response = await get("/readyz")
    body = json.loads(response.body)
    assert body["destinations"]["workflow"] == "misconfigured"
    assert body["destination_problems"] == {"workflow": problem}
    metrics = samples(await ctx.metrics.exposition(ctx))
    assert value(metrics, "receiver_destination_misconfigured", destination="workflow") == 1
    assert admin_notices() == []


@pytest.mark.gen_test
async def test_the_console_overview_says_what_frappe_said_of_our_configuration(
        ctx, frappe, logged_in):
    frappe.responses = [WHO, DOCTYPE_MISSPELLED]
    await ctx.destinations.check()
    page = text(await logged_in.get("/console"))
    assert ("workflow misconfigured: Formation Order: HTTP 500 reading Formation Order: "
            "ImportError: Module import failed for Formation Ordr") in page


@pytest.mark.gen_test
async def test_a_misspelled_doctype_fixed_and_the_action_retried_goes_to_the_fixed_one(
        post, ctx, clock, frappe, worker, smtp, settings):
    """The real run: FORM-00016 stayed in Submitted after the fix, since the row kept the
    misspelled doctype and `outbox retry` sent it again as it was."""
    clock.set(2026, 11, 20, 9, 0)
    misspelled = dataclasses.replace(settings, workflow_doctype="Formation Ordr")
    ctx.settings = ctx.workflow.settings = misspelled
    frappe.fail_with(*DOCTYPE_MISSPELLED)
    await submit(post, 16)
    [row] = actions()
    assert row.status == "dead"
    await outbox.send_due(ctx)
    [mail] = [m for _, m in smtp.messages if "given up" in m["Subject"]]
    text = mail.get_body(("plain",)).get_content().replace("\r\n", "\n")
    assert f"receiver.py outbox retry {row.id}" in text
    assert "on the\ndoctype WORKFLOW_DOCTYPE names, as they are when it is sent" in text

    # The setting fixed and the service started again with it: a retry is enough.
    fixed = Context.create(settings, clock=clock)
    frappe.fail_with(200, {"message": {"name": "ORD-16", "workflow_state": "Name Check"}})
    await fixed.db(functools.partial(operator_commands.retry_outbox, fixed, row.id))
    await outbox.send_due(fixed)
    await fixed.http.close()
    [row] = actions()
    assert row.status == "sent"
    sent = [json.loads(r.json["doc"]) for r in frappe.posts]
    assert sent == [{"doctype": "Formation Ordr", "name": "ORD-16"},
                    {"doctype": "Formation Order", "name": "ORD-16"}]


@pytest.mark.gen_test(timeout=60)
async def test_the_workflow_read_permission_is_checked_like_credentials(
        ctx, clock, frappe, worker, post, http_server, base_url, client, smtp):
    """Without read permission on Workflow a refused action cannot be read back: the
    real run showed one log line and nothing else."""
    forbidden = (403, {"exception": "frappe.exceptions.PermissionError",
                       "exc_type": "PermissionError", "_server_messages": json.dumps([
                           json.dumps({"message": "User <strong>receiver@erp.test</strong> "
                                       "does not have doctype access via role permission "
                                       "for document <strong>Workflow</strong>"})])})
    frappe.responses = [(200, {"message": "receiver@erp.test"}),
                        (200, {"data": [{"name": "FORM-00001"}]}),
                        (200, {"data": [{"name": "CRTC-00001"}]}), forbidden, forbidden,
                        (200, {"message": {"time_zone": "Asia/Kolkata"}})]
    ready = json.loads((await client.fetch(base_url + "/readyz")).body)
    said = ready["destination_warnings"]["workflow"]["workflow_read"]
    assert said.startswith("the API user may not read Workflow (it needs read permission "
                           "on Workflow): HTTP 403 reading Workflow: PermissionError: User "
                           "receiver@erp.test does not have doctype access")
    metrics = samples((await client.fetch(base_url + "/metrics")).body)
    assert value(metrics, "receiver_destination_warning", destination="workflow",
                        warning="workflow_read") == 1
    # An action refused (sent twice after a crash, say) cannot be read back: its mail
    # names the permission.
    frappe.responses = [(417, {"exc_type": "WorkflowTransitionError"}),
                        (200, {"data": {"name": "FORM-1", "workflow_state": "Filing"}}),
                        forbidden]
    await post("/api/v1/webhooks/formation/name-available",
               {"order_name": "FORM-1", "order_number": "FO-1"}, AUTH)
    await outbox.send_due(ctx)
    [(_, mail)] = [m for m in smtp.messages if "given up" in m[1]["Subject"]]
    content = mail.get_body(("plain",)).get_content()
    assert content.count("the API user may not read Workflow") == 2  # its error, the check


@pytest.mark.gen_test(timeout=60)
async def test_the_console_shows_what_frappes_check_found(ctx, frappe, logged_in):
    ctx.workflow.findings = {"workflow_read": "the API user may not read Workflow (...)"}
    page = text(await logged_in.get("/console/"))
    assert "workflow, its configuration check: the API user may not read Workflow" in page
