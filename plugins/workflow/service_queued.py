"""POST /api/v1/webhooks/service/queued: process a compliance service.

When the call names no service_slug, the compliance order's own slug is used; if the
order is not found or the lookup fails, the job still goes out with an empty slug."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.workflow import WorkflowWebhook, workflow_webhook


def service_slug_of(tx: Transaction, order_number: str) -> str:
    """The compliance order's service slug; "" when it has none, there is no such order,
    or the lookup failed (a failed lookup must not spoil the event)."""
    slug = None
    with tx.apart(f"service_slug lookup failed for order {order_number}"):
        slug = tx.service_slug_of(order_number)
    return slug or ""


@workflow_webhook
class ServiceQueued(WorkflowWebhook):
    path = "service/queued"
    job = "process_compliance_service"
    answer = "service_processing_dispatched"

    def job_payload(self, ctx: EngineContext, tx: Transaction,
                    body: dict[str, Any]) -> dict[str, Any]:
        slug = body.get("service_slug")
        if not isinstance(slug, str) or not slug:
            slug = service_slug_of(tx, body["order_number"])
        return {**super().job_payload(ctx, tx, body), "service_slug": slug}
