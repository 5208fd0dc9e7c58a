"""POST /api/v1/webhooks/formation/ein-obtained

The EIN is obtained: generate the documents.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class FormationEinObtained(WorkflowWebhook):
    path = "formation/ein-obtained"
    after = ("formation/filed-needs-ein",)
    workflow_action = "Generate Docs"
    job = "generate_docs"
    answer = "doc_gen_dispatched"
