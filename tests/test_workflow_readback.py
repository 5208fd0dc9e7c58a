"""An action Frappe refuses with 417 because it was applied already (sent just before a
crash, and again one lease later): read back, it is a success, not "given up"."""
import json

import pytest

from clients.workflow import states_after
from models import Outbox
from tests.conftest import WEBHOOK_SECRET

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET}
BODY = {"order_name": "ORD-7", "order_number": "FO-7"}
REFUSED = (417, {"exc_type": "WorkflowTransitionError",
                 "exception": "Not a valid Workflow Action"})
# Part of a formation workflow as Frappe gives it (Workflow doctype, its transitions).
TRANSITIONS = [
    {"state": "Submitted", "action": "Start Name Check", "next_state": "Name Check"},
    {"state": "Name Check", "action": "Start Filing", "next_state": "Filing"},
    {"state": "Filing", "action": "Start EIN", "next_state": "EIN"},
    {"state": "Filing", "action": "Skip EIN", "next_state": "Docs"},
    {"state": "EIN", "action": "Generate Docs", "next_state": "Docs"},
    {"state": "Docs", "action": "Reject", "next_state": "Name Check"},
]


def frappe_answers(state):
    """The refusal, then what reading back finds: the document, the workflow's name, it."""
    return [REFUSED, (200, {"data": {"name": "ORD-7", "workflow_state": state}}),
            (200, {"data": [{"name": "Formation Workflow"}]}),
            (200, {"data": {"name": "Formation Workflow", "transitions": TRANSITIONS}})]


@pytest.mark.parametrize("state", ["Filing", "EIN", "Docs"])
@pytest.mark.gen_test
async def test_a_refused_action_the_document_is_already_past_is_sent(post, frappe, worker,
                                                                    smtp, state):
    frappe.responses = frappe_answers(state)
    status, _, _ = await post("/api/v1/webhooks/formation/name-available", BODY, AUTH)
    assert status == 200
    action = Outbox.get(Outbox.kind == "workflow_action")
    assert (action.status, action.last_error) == ("sent", None)
    assert smtp.messages == []
    reads = [(r.method, r.path) for r in frappe.requests[1:]]
    assert reads == [("GET", "/api/resource/Formation%20Order/ORD-7"),
                     ("GET", "/api/resource/Workflow"),
                     ("GET", "/api/resource/Workflow/Formation%20Workflow")]
    listed = frappe.requests[2]
    assert listed.headers["Authorization"] == "token wf-key:wf-secret"


@pytest.mark.parametrize("answers", [
    frappe_answers("Name Check"),
    frappe_answers("Submitted"),
    [REFUSED, (404, {})],
    [REFUSED, (200, {"data": {"name": "ORD-7", "workflow_state": "Filing"}}), (403, {})],
], ids=["still-before-it", "earlier", "document-unreadable", "workflow-unreadable"])
@pytest.mark.gen_test
async def test_a_refused_action_not_shown_to_be_past_stays_refused(post, frappe, worker,
                                                                  answers):
    frappe.responses = list(answers)
    frappe.fail_with(404, {})
    await post("/api/v1/webhooks/formation/name-available", BODY, AUTH)
    action = Outbox.get(Outbox.kind == "workflow_action")
    assert action.status == "dead" and action.last_error.startswith("HTTP 417")
    assert json.loads(action.payload)["action"] == "Start Filing"


def test_the_states_after_an_action_stop_where_it_would_apply_again():
    assert states_after("Start Filing", TRANSITIONS) == {"Filing", "EIN", "Docs"}
    assert states_after("Start Name Check", TRANSITIONS) == {"Name Check", "Filing", "EIN",
                                                            "Docs"}
    assert states_after("Unknown", TRANSITIONS) == set()


@pytest.mark.gen_test
async def test_a_workflow_frappe_does_not_let_us_read_is_said_in_the_log(post, frappe, worker,
                                                                        caplog):
    # The real v15 answer when the API user lacks read permission on Workflow.
    frappe.responses = [REFUSED, (200, {"data": {"name": "ORD-7", "workflow_state": "Filing"}}),
                        (403, {"exception": "frappe.exceptions.PermissionError",
                               "exc_type": "PermissionError"})]
    await post("/api/v1/webhooks/formation/name-available", BODY, AUTH)
    assert ("the Formation Order workflow could not be read from Frappe: the API user may "
            "not read Workflow (it needs read permission on Workflow): HTTP 403 reading "
            "Workflow: PermissionError") in caplog.text
    action = Outbox.get(Outbox.kind == "workflow_action")
    assert "read back: the document is in 'Filing'; the API user may not read Workflow" in (
        action.last_error)


@pytest.mark.gen_test
async def test_no_active_workflow_for_the_doctype_is_the_reason_given(post, frappe, worker):
    # Frappe's list of active Workflows for a doctype that has none: an empty list (was
    # taken for a Workflow and read as one: "AttributeError raised while sending").
    frappe.responses = [REFUSED, (200, {"data": {"name": "ORD-7", "workflow_state": "Filing"}}),
                        (200, {"data": []})]
    await post("/api/v1/webhooks/formation/name-available", BODY, AUTH)
    action = Outbox.get(Outbox.kind == "workflow_action")
    assert action.status == "dead"
    assert action.last_error == (
        "HTTP 417: WorkflowTransitionError: Not a valid Workflow Action; read back: the "
        "document is in 'Filing'; Frappe has no active Workflow for Formation Order")
