"""POST /api/v1/webhooks/crtc/awaiting-funds

Only records intent: the order advances when a separate monitor detects the deposit.
"""
from plugins.workflow import TOLD, WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcAwaitingFunds(WorkflowWebhook):
    path = "crtc/awaiting-funds"
    job = "register_awaiting_funds"
    job_constants = {"order_type": "canada_crtc"}
    answer = "registered_awaiting_funds"
    # Past Awaiting Funds the funds were confirmed: registering the wait is moot.
    when_left = TOLD
