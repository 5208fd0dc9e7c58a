"""POST /api/v1/webhooks/crtc/domain-ready

Domain and e-mail provisioning is done.
"""
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcDomainReady(WorkflowWebhook):
    path = "crtc/domain-ready"
    answer = "domain_ready_acknowledged"
