"""POST /api/v1/webhooks/crtc/delivered

The binder is delivered; this starts the 14-day commission holdback.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcDelivered(WorkflowWebhook):
    path = "crtc/delivered"
    job = "mark_delivered"
    job_constants = {"order_type": "canada_crtc"}
    answer = "delivery_recorded"
