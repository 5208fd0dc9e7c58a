"""The workflow system (Frappe): apply a named workflow action to a document."""
import json

from clients.http import Result, post_json

APPLY_WORKFLOW = "frappe.model.workflow.apply_workflow"


class WorkflowClient:
    def __init__(self, http, settings):
        self.http = http
        self.settings = settings

    async def apply_action(self, doctype, name, action):
        """POST the apply-workflow call. Frappe answers 417 for an invalid transition,
        which no retry will change."""
        s = self.settings
        if not s.workflow_url:
            return Result.failed("WORKFLOW_URL is not set")
        result = await post_json(
            self.http,
            f"{s.workflow_url}/api/method/{APPLY_WORKFLOW}",
            {"cmd": APPLY_WORKFLOW,
             "doc": json.dumps({"doctype": doctype, "name": name}),
             "action": action},
            headers={
                "Authorization": f"token {s.workflow_api_key}:{s.workflow_api_secret}",
                "X-Frappe-Site-Name": s.workflow_site_name,
                "X-Workflow-Site-Name": s.workflow_site_name,
            },
            timeout=s.outbound_timeout_seconds)
        if result.status == 417:
            return Result.failed(result.error, retryable=False, status=417)
        return result
