"""POST /api/v1/webhooks/service/approved

A compliance service was approved: deliver it.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class ServiceApproved(WorkflowWebhook):
    path = "service/approved"
    job = "deliver"
    answer = "delivery_dispatched"
