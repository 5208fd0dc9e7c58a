"""POST /api/v1/webhooks/formation/ready

The formation order is ready: deliver it.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class FormationReady(WorkflowWebhook):
    path = "formation/ready"
    after = ("formation/approved",)
    job = "deliver"
    answer = "delivery_dispatched"
