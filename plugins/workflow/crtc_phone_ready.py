"""POST /api/v1/webhooks/crtc/phone-ready

A Canadian phone number is provisioned.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcPhoneReady(WorkflowWebhook):
    path = "crtc/phone-ready"
    answer = "phone_ready_acknowledged"
