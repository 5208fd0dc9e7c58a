"""POST /api/v1/webhooks/formation/submitted

A formation order was submitted: start the name check and search the name.
"""
from plugins.workflow import ORDER_FIELDS, WorkflowWebhook, workflow_webhook


@workflow_webhook
class FormationSubmitted(WorkflowWebhook):
    path = "formation/submitted"
    fields = (*ORDER_FIELDS, "state_code", "entity_name")
    workflow_action = "Start Name Check"
    job = "name_search"
    answer = "name_search_dispatched"
