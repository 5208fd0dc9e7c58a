"""POST /api/v1/webhooks/fulfillment/<status>: the worker reports that a compliance order
moved to a fulfilment status (domain.fulfillment lists them and the allowed moves).

One plugin per status, registered here from one small table: they differ only in what a
move causes. `ready_to_file` tells the administrator that the filing waits for approval;
`awaiting_intake` starts the intake reminders (the reminder job lists orders in that
status). A move the order cannot make is rejected (409), and so kept in the inbox.
"""
from typing import Any

from models import ComplianceOrder
from domain import fulfillment
from domain.orders import email_admin
from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.registry import Placement, undeclared, workflow_webhook
from plugins.workflow import WorkflowWebhook


# The worker's reports of one order are one stream, in the order they came: the worker
# sends no version of its own, and its copies are told apart by the receiver's key.
REPORTS_OF_AN_ORDER = Placement(
    same=undeclared, stream=lambda body: f"fulfillment:{body['order_number']}",
    version=undeclared)


class FulfillmentReport(WorkflowWebhook):
    status = ""
    fields = ("order_number",)
    answer = "fulfillment_status_recorded"

    @property
    def placement(self) -> Placement:
        return REPORTS_OF_AN_ORDER

    def __call__(self, ctx: EngineContext, body: dict[str, Any], tx: Transaction) -> None:
        try:
            order = fulfillment.move(ctx, tx, body["order_number"], self.status)
        except fulfillment.InvalidTransition as refused:
            tx.reject(str(refused))
            return
        if order is not None:
            self.moved(ctx, order, tx)

    def moved(self, ctx: EngineContext, order: ComplianceOrder, tx: Transaction) -> None:
        """What the move causes, besides the new status."""


class ReadyToFile(FulfillmentReport):
    answer = "approval_requested"

    def moved(self, ctx: EngineContext, order: ComplianceOrder, tx: Transaction) -> None:
        email_admin(ctx, tx, f"Filing for order {order.order_number} waits for your "
                    "approval", "fulfillment_ready_to_file", order.order_number,
                    service_name=order.service_name, customer_name=order.customer_name,
                    customer_email=order.customer_email)


class AwaitingIntake(FulfillmentReport):
    answer = "intake_reminders_started"


# The statuses whose report causes or answers more than a plain FulfillmentReport.
REPORT_CLASS_OF_STATUS = {fulfillment.READY_TO_FILE: ReadyToFile,
                          fulfillment.AWAITING_INTAKE: AwaitingIntake}

for _status in fulfillment.STATES:
    _report_class = REPORT_CLASS_OF_STATUS.get(_status, FulfillmentReport)
    workflow_webhook(type(f"Fulfillment_{_status}", (_report_class,),
                          {"status": _status, "path": f"fulfillment/{_status}"}))
