"""POST /api/v1/webhooks/formation/filed-skip-ein

The entity is filed and needs no EIN: go straight to the documents.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class FormationFiledSkipEin(WorkflowWebhook):
    path = "formation/filed-skip-ein"
    after = ("formation/name-available",)
    workflow_action = "Skip EIN"
    job = "generate_docs"
    answer = "doc_gen_dispatched"
