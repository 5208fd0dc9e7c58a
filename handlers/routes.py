"""Every route of the service, in one list."""
from handlers.workflow import WorkflowWebhookHandler


def routes(ctx):
    return [
        (r"/api/v1/webhooks/([a-z]+/[a-z-]+)", WorkflowWebhookHandler, {"ctx": ctx}),
    ]
