"""The workflow system (Frappe): apply a named workflow action to a document, and read a
document back.

Frappe refuses an action the document's state does not allow with 417. That is also its
answer to an action sent a second time: after a crash, an action sent just before it is
sent again one lease later, and the first one had moved the document on. So a 417 is
not taken as final until the document is read back: one that is already past the action
had it applied, and the send is a success."""
import dataclasses
import json
import logging
import urllib.parse

from clients.http import Request, Result, describe, post_json

log = logging.getLogger("receiver.workflow")

APPLY_WORKFLOW = "frappe.model.workflow.apply_workflow"


class WorkflowClient:
    def __init__(self, http, settings):
        self.http = http
        self.settings = settings

    @property
    def configured(self):
        return bool(self.settings.workflow_url)

    def _headers(self):
        s = self.settings
        return {
            "Authorization": f"token {s.workflow_api_key}:{s.workflow_api_secret}",
            "X-Frappe-Site-Name": s.workflow_site_name,
            "X-Workflow-Site-Name": s.workflow_site_name,
        }

    async def apply_action(self, doctype, name, action):
        """POST the apply-workflow call. Frappe answers 417 for an invalid transition,
        which no retry will change; if the document is already past the action (see
        `already_past`), the action had been applied and the result is ok."""
        s = self.settings
        if not s.workflow_url:
            return Result.failed("WORKFLOW_URL is not set", configured=False)
        request = self.apply_request(doctype, name, action)
        result = await post_json(self.http, request.url, request.body, request.headers,
                                 timeout=s.outbound_timeout_seconds, peer="workflow system")
        if result.status == 417:
            if await self.already_past(doctype, name, action):
                return Result(ok=True, status=417, body={"already_applied": True},
                              reply=result.reply)
            return dataclasses.replace(result, retryable=False)
        return result

    def apply_request(self, doctype, name, action):
        return Request(f"{self.settings.workflow_url}/api/method/{APPLY_WORKFLOW}",
                       {"cmd": APPLY_WORKFLOW,
                        "doc": json.dumps({"doctype": doctype, "name": name}),
                        "action": action},
                       self._headers())

    async def already_past(self, doctype, name, action):
        """After a 417: is the document past `action`? Frappe's workflow for the doctype
        says: the document's state is one the action leads to, directly or by later
        transitions. A document still before the action (one that has not reached the
        state it applies from) is not past it, and neither is a document or workflow
        Frappe cannot show us (the refusal stands)."""
        document = await self.document(doctype, name)
        state = document.body.get("workflow_state") if document.ok else None
        if not state:
            log.warning("%s %s: Frappe refused %r and the document's state could not be "
                        "read: %s", doctype, name, action, document.error or "no state")
            return False
        transitions = await self.transitions(doctype)
        past = state in states_after(action, transitions)
        if past:
            log.warning("%s %s: %r was already applied in Frappe (now %s)",
                        doctype, name, action, state)
        return past

    async def transitions(self, doctype):
        """The transitions ({state, action, next_state}) of the doctype's active workflow;
        none when Frappe cannot show them."""
        found = await self._get("Workflow", params={
            "filters": json.dumps([["document_type", "=", doctype], ["is_active", "=", 1]]),
            "fields": json.dumps(["name"])})
        if found.ok and isinstance(found.body, list) and found.body:
            workflow = await self._get("Workflow", found.body[0].get("name", ""))
        else:
            workflow = found
        transitions = workflow.body.get("transitions") if workflow.ok else None
        if not isinstance(transitions, list):
            # Without it a repeated action stays refused (dead), with no other word why.
            log.warning("the %s workflow could not be read from Frappe (%s): the API user "
                        "needs read permission on Workflow", doctype,
                        workflow.error or "no active workflow")
        return [t for t in transitions or () if isinstance(t, dict)]

    async def document(self, doctype, name):
        """GET the document (Frappe's REST resource). An ok Result's body is the
        document's fields (Frappe's `data`), workflow_state among them."""
        result = await self._get(doctype, name)
        if result.ok and not isinstance(result.body, dict):
            return Result.failed(f"no document in the reply for {doctype} {name}", status=200)
        return result

    async def list_documents(self, doctype: str, fields: list, filters: list, order_by: str,
                             start: int, page_length: int) -> Result:
        """One page of Frappe's list API (`GET /api/resource/<doctype>`): the documents
        matching `filters`, each a dict of `fields`, in `order_by` order, from the
        `start`-th. An ok Result's body is that list."""
        result = await self._get(doctype, params={
            "fields": json.dumps(fields), "filters": json.dumps(filters),
            "order_by": order_by, "limit_start": start, "limit_page_length": page_length})
        if result.ok and not isinstance(result.body, list):
            return Result.failed(f"no list in the reply listing {doctype}", status=200)
        return result

    async def _get(self, doctype, name=None, params=None):
        """GET Frappe's REST resource: one document, or (no `name`) a list; an ok
        Result's body is the reply's `data`."""
        s = self.settings
        if not s.workflow_url:
            return Result.failed("WORKFLOW_URL is not set", configured=False)
        what = doctype if name is None else f"{doctype} {name}"
        parts = (doctype,) if name is None else (doctype, name)
        url = f"{s.workflow_url}/api/resource/" + "/".join(
            urllib.parse.quote(part, safe="") for part in parts)
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            reply = await self.http.call(
                "GET", url, headers={"Accept": "application/json", **self._headers()},
                timeout=s.outbound_timeout_seconds)
        except Exception as exc:  # network errors of every kind
            return Result.failed(describe(exc))
        if reply.status != 200:
            return Result.failed(f"HTTP {reply.status} reading {what}",
                                 retryable=reply.status >= 500, status=reply.status)
        try:
            data = json.loads(reply.body)["data"]
        except (ValueError, TypeError, KeyError):
            return Result.failed(f"unreadable reply reading {what}", status=200)
        return Result(ok=True, status=200, body=data)


def states_after(action, transitions):
    """The states a document can be in once `action` was applied: where the action leads,
    and onwards along the transitions, short of a state the action applies from again."""
    before = {t.get("state") for t in transitions if t.get("action") == action}
    todo = [t.get("next_state") for t in transitions if t.get("action") == action]
    after = set()
    while todo:
        state = todo.pop()
        if state in after or state in before or not state:
            continue
        after.add(state)
        todo += [t.get("next_state") for t in transitions if t.get("state") == state]
    return after
