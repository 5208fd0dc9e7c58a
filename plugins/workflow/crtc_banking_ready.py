"""POST /api/v1/webhooks/crtc/banking-ready

The banking referral e-mail is sent.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcBankingReady(WorkflowWebhook):
    path = "crtc/banking-ready"
    answer = "banking_ready_acknowledged"
