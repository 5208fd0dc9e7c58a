"""POST /api/v1/webhooks/crtc/ccts-ready

The complaints-body registration is complete.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcCctsReady(WorkflowWebhook):
    path = "crtc/ccts-ready"
    answer = "ccts_ready_acknowledged"
