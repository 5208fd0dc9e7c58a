"""POST /api/v1/webhooks/crtc/incorporated

The company is incorporated: generate the CRTC documents.
"""
from plugins.workflow import ORDER_FIELDS, WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcIncorporated(WorkflowWebhook):
    path = "crtc/incorporated"
    after = ("crtc/funds-available",)
    fields = (*ORDER_FIELDS, "incorporation_number")
    job = "generate_crtc_docs"
    answer = "crtc_docs_dispatched"
