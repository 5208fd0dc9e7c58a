"""invoice.paid: a subscription renewed, so the compliance service runs again for the new
cycle. Only renewals (billing_reason subscription_cycle) count; the first invoice is the
checkout itself. A renewal of an order still `pending_payment` (its checkout was a trial
handled before checkouts without payment completed the order, or that event was lost)
completes the order too: it is the first money received for it (its status then is what
its facts give: domain.payment_state), paid as of the invoice's own paid time. A renewal
whose subscription no order has yet (its checkout.session.completed has not come) waits
for it; a charge of the renewal told first finds its order once the renewal is recorded."""
import datetime
import logging
from typing import Any

from plugins.registry import card_event
from plugins.card import ONCE_PER_OBJECT
from domain.card_events import ids_of, linked, object_of, subscription_of_invoice
from domain.money import Money
from domain.orders import complete_payment, document_name, record_cycle
from domain.payment_state import as_of, received
from engine.contracts import EngineContext
from engine.transaction import Transaction

log = logging.getLogger("receiver.card")


@card_event("invoice.paid", ONCE_PER_OBJECT)
def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    invoice = object_of(event)
    if invoice.get("billing_reason") != "subscription_cycle":
        return
    subscription = subscription_of_invoice(invoice)
    order = tx.order_with_subscription(subscription)
    if order is None or subscription is None:
        # Its checkout.session.completed has not linked the subscription yet.
        tx.wait_for_order(f"invoice {invoice['id']}: no compliance order has subscription "
                          f"{subscription} yet", ids_of(subscription=subscription))
        return
    if not received(order):
        complete_payment(ctx, tx, order.order_number, "compliance", invoice["id"],
                         source="card", amount=Money.of_stripe(invoice.get("amount_paid"),
                                                               invoice.get("currency")),
                         paid_at=paid_at(ctx, event, invoice))
    cycle = record_cycle(ctx, tx, order, subscription, invoice["id"])
    # A charge of this renewal told first (a dispute, a refund) finds its order now.
    linked(ctx, tx, invoice=invoice["id"])
    tx.job("process_compliance_service", {
        "order_name": document_name(order),
        "order_number": order.order_number,
        "service_slug": order.service_slug or "",
        "recurring_cycle": cycle,
        "invoice_id": invoice["id"],
    }, key=f"job-subscription-cycle-{invoice['id']}")


def paid_at(ctx: EngineContext, event: dict[str, Any],
            invoice: dict[str, Any]) -> datetime.datetime:
    """When the invoice was paid, as Stripe says: its own status_transitions.paid_at, else
    the event's `created`."""
    transitions = invoice.get("status_transitions") or {}
    return as_of(transitions.get("paid_at"), as_of(event.get("created"), ctx.clock()))
