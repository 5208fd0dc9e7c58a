"""POST /api/v1/webhooks/crtc/delivered

The binder is delivered: `mark_delivered` goes to the worker, and the order's commission
holdback starts (domain.holdback), once. A delivery of an order we do not have yet keeps
the job and is handled again later, until the order is there to record it on.
"""
from domain import holdback
from domain.orders import find_order
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcDelivered(WorkflowWebhook):
    path = "crtc/delivered"
    job = "mark_delivered"
    job_constants = {"order_type": holdback.ORDER_TYPE}
    answer = "delivery_recorded"

    def __call__(self, ctx, body, effects):
        super().__call__(ctx, body, effects)
        order = find_order(holdback.ORDER_TYPE, body["order_number"], for_update=True)
        if order is None:
            effects.retry_later(f"no CRTC order {body['order_number']} to start its holdback")
            return
        # The delivery happened when it was reported, not when a retry handled it.
        delivered_at = effects.event.received_at if effects.event else ctx.clock()
        holdback.start(ctx, order, delivered_at)
