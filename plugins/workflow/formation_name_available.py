"""POST /api/v1/webhooks/formation/name-available

The requested name is available: start filing the entity.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class FormationNameAvailable(WorkflowWebhook):
    path = "formation/name-available"
    after = ("formation/submitted",)
    workflow_action = "Start Filing"
    job = "file_entity"
    answer = "filing_dispatched"
