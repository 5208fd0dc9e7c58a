"""POST /api/v1/webhooks/crtc/ready-for-review

The binder is compiled and the order is in Review: tell an administrator.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcReadyForReview(WorkflowWebhook):
    path = "crtc/ready-for-review"
    job = "notify_admin_review"
    job_constants = {"order_type": "canada_crtc"}
    answer = "admin_notified"
