"""POST /api/v1/webhooks/crtc/delivered

The binder is delivered: `mark_delivered` goes to the worker, and the order's commission
holdback starts (domain.holdback), once. A delivery of an order we do not have yet keeps
the job and is handled again later, until the order is there to record it on.
"""
from typing import Any

from domain import holdback
from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.workflow import WorkflowWebhook, workflow_webhook


@workflow_webhook
class CrtcDelivered(WorkflowWebhook):
    path = "crtc/delivered"
    job = "mark_delivered"
    job_constants = {"order_type": holdback.ORDER_TYPE}
    answer = "delivery_recorded"

    def __call__(self, ctx: EngineContext, body: dict[str, Any], tx: Transaction) -> None:
        super().__call__(ctx, body, tx)
        order = tx.lock_order(holdback.ORDER_TYPE, body["order_number"])
        if order is None:
            tx.retry_later(f"no CRTC order {body['order_number']} to start its holdback")
            return
        # The delivery happened when it was reported, not when a retry handled it.
        delivered_at = tx.event.received_at if tx.event else ctx.clock()
        holdback.start(ctx, tx, order, delivered_at)
