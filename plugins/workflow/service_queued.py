"""POST /api/v1/webhooks/service/queued: process a compliance service.

When the call names no service_slug, the compliance order's own slug is used; if the
order is not found or the lookup fails, the job still goes out with an empty slug."""
import logging

import peewee

from models import ComplianceOrder
from plugins.workflow import WorkflowWebhook, workflow_webhook
from engine.commits import savepoint

log = logging.getLogger("receiver.plugins")


def service_slug_of(order_number):
    try:
        with savepoint():  # a failed lookup must not spoil the event
            order = (ComplianceOrder.select(ComplianceOrder.service_slug)
                     .where(ComplianceOrder.order_number == order_number).first())
    except peewee.PeeweeException:
        log.exception("service_slug lookup failed for order %s", order_number)
        return ""
    return (order.service_slug or "") if order else ""


@workflow_webhook
class ServiceQueued(WorkflowWebhook):
    path = "service/queued"
    job = "process_compliance_service"
    answer = "service_processing_dispatched"

    def job_payload(self, ctx, body):
        slug = body.get("service_slug")
        if not isinstance(slug, str) or not slug:
            slug = service_slug_of(body["order_number"])
        return {**super().job_payload(ctx, body), "service_slug": slug}
