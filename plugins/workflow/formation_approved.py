"""POST /api/v1/webhooks/formation/approved

An administrator approved the review: mark the order ready.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class FormationApproved(WorkflowWebhook):
    path = "formation/approved"
    after = ("formation/ein-obtained", "formation/filed-skip-ein")
    workflow_action = "Mark Ready"
    answer = "marked_ready"
