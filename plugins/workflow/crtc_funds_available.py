"""POST /api/v1/webhooks/crtc/funds-available

Funds are available: file the BC incorporation.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcFundsAvailable(WorkflowWebhook):
    path = "crtc/funds-available"
    after = ("crtc/awaiting-funds",)
    job = "file_bc_incorporation"
    answer = "incorporation_dispatched"
