"""invoice.paid: a subscription renewed, so the compliance service runs again for the new
cycle. Only renewals (billing_reason subscription_cycle) count; the first invoice is the
checkout itself. A renewal of an order still `pending_payment` (its checkout was a trial
handled before checkouts without payment completed the order, or that event was lost)
completes the order too: it is the first money received for it (its status then is what
its facts give: domain.payment_state)."""
import logging
from typing import Any

from plugins.registry import card_event
from plugins.card import CARD_FACT
from domain.card_events import object_of, subscription_of_invoice
from domain.money import Money
from domain.orders import OrderNotFound, complete_payment, document_name, record_cycle
from domain.payment_state import received
from engine.contracts import EngineContext
from engine.transaction import Transaction

log = logging.getLogger("receiver.card")


@card_event("invoice.paid", CARD_FACT)
def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    invoice = object_of(event)
    if invoice.get("billing_reason") != "subscription_cycle":
        return
    subscription = subscription_of_invoice(invoice)
    order = tx.order_with_subscription(subscription)
    if order is None or subscription is None:
        # Its checkout.session.completed may not have linked the subscription yet.
        raise OrderNotFound(f"no compliance order with subscription {subscription!r}")
    if not received(order):
        complete_payment(ctx, tx, order.order_number, "compliance", invoice["id"],
                         source="card", amount=Money.of_stripe(invoice.get("amount_paid"),
                                                               invoice.get("currency")))
    cycle = record_cycle(ctx, tx, order, subscription, invoice["id"])
    tx.job("process_compliance_service", {
        "order_name": document_name(order),
        "order_number": order.order_number,
        "service_slug": order.service_slug or "",
        "recurring_cycle": cycle,
        "invoice_id": invoice["id"],
    }, key=f"job-subscription-cycle-{invoice['id']}")
