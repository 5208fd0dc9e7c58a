"""POST /api/v1/webhooks/formation/filed-needs-ein

The entity is filed and needs an EIN: obtain it.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class FormationFiledNeedsEin(WorkflowWebhook):
    path = "formation/filed-needs-ein"
    after = ("formation/name-available",)
    workflow_action = "Start EIN"
    job = "obtain_ein"
    answer = "ein_dispatched"
