"""POST /api/v1/webhooks/crtc/approved

The administrator approved the binder and the order moves to Shipping.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcApproved(WorkflowWebhook):
    path = "crtc/approved"
    job = "ship_binder"
    answer = "shipping_dispatched"
