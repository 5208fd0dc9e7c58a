"""The workflow system (Frappe): apply a named workflow action to a document, and read a
document back."""
import json
import urllib.parse

from clients.http import Result, describe, post_json

APPLY_WORKFLOW = "frappe.model.workflow.apply_workflow"


class WorkflowClient:
    def __init__(self, http, settings):
        self.http = http
        self.settings = settings

    def _headers(self):
        s = self.settings
        return {
            "Authorization": f"token {s.workflow_api_key}:{s.workflow_api_secret}",
            "X-Frappe-Site-Name": s.workflow_site_name,
            "X-Workflow-Site-Name": s.workflow_site_name,
        }

    async def apply_action(self, doctype, name, action):
        """POST the apply-workflow call. Frappe answers 417 for an invalid transition,
        which no retry will change."""
        s = self.settings
        if not s.workflow_url:
            return Result.failed("WORKFLOW_URL is not set", configured=False)
        result = await post_json(
            self.http,
            f"{s.workflow_url}/api/method/{APPLY_WORKFLOW}",
            {"cmd": APPLY_WORKFLOW,
             "doc": json.dumps({"doctype": doctype, "name": name}),
             "action": action},
            headers=self._headers(),
            timeout=s.outbound_timeout_seconds)
        if result.status == 417:
            return Result.failed(result.error, retryable=False, status=417)
        return result

    async def document(self, doctype, name):
        """GET the document (Frappe's REST resource). An ok Result's body is the
        document's fields (Frappe's `data`), workflow_state among them."""
        s = self.settings
        if not s.workflow_url:
            return Result.failed("WORKFLOW_URL is not set", configured=False)
        path = "/".join(urllib.parse.quote(part, safe="") for part in (doctype, name))
        try:
            reply = await self.http.call(
                "GET", f"{s.workflow_url}/api/resource/{path}",
                headers={"Accept": "application/json", **self._headers()},
                timeout=s.outbound_timeout_seconds)
        except Exception as exc:  # network errors of every kind
            return Result.failed(describe(exc))
        if reply.status != 200:
            return Result.failed(f"HTTP {reply.status} reading {doctype} {name}",
                                 retryable=reply.status >= 500, status=reply.status)
        try:
            data = json.loads(reply.body)["data"]
        except (ValueError, TypeError, KeyError):
            return Result.failed(f"unreadable reply reading {doctype} {name}", status=200)
        if not isinstance(data, dict):
            return Result.failed(f"no document in the reply for {doctype} {name}", status=200)
        return Result(ok=True, status=200, body=data)
