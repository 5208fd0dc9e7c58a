"""POST /api/v1/webhooks/crtc/bits-filed

The telecom filing form is submitted.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcBitsFiled(WorkflowWebhook):
    path = "crtc/bits-filed"
    answer = "bits_filed_acknowledged"
