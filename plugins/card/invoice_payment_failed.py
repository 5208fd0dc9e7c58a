"""invoice.payment_failed: a subscription payment failed. The administrator is told each
time; on the first attempt the customer, when we have their address, also gets a nudge to
update the card. The administrator's e-mail says which of the two happened, and why not.
Each attempt is a fact of its own; one whose subscription no order has yet (its checkout
has not come) waits for it."""
from typing import Any

from plugins.registry import card_event
from plugins.card import once_per_object_and
from domain.card_events import email_admin, ids_of, object_of, subscription_of_invoice
from domain.money import stripe_money
from engine.contracts import EngineContext
from engine.transaction import Transaction

FIRST_ATTEMPT = 1
NUDGE_SUBJECT = "Your payment did not go through"


@card_event("invoice.payment_failed", once_per_object_and("attempt_count"))
def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    invoice = object_of(event)
    subscription = subscription_of_invoice(invoice)
    order = tx.order_with_subscription(subscription)
    if order is None:
        # Its checkout.session.completed has not linked the subscription yet.
        tx.wait_for_order(f"invoice {invoice['id']}: no compliance order has subscription "
                          f"{subscription} yet", ids_of(subscription=subscription))
        return
    order_number = order.order_number
    details = {
        "invoice": invoice["id"],
        "attempt": invoice.get("attempt_count"),
        "amount": stripe_money(invoice.get("amount_due"), invoice.get("currency")),
        "customer_name": order.customer_name or invoice.get("customer_name") or "",
        "customer_email": order.customer_email or invoice.get("customer_email"),
        "service_name": order.service_name or "your subscription",
        "pay_url": invoice.get("hosted_invoice_url"),
    }
    nudged = invoice.get("attempt_count") == FIRST_ATTEMPT and bool(details["customer_email"])
    email_admin(ctx, tx, f"Subscription payment failed for order {order_number}",
                "invoice_payment_failed_admin", order_number, customer_nudged=nudged,
                **details)
    if nudged:
        tx.email([details["customer_email"]], NUDGE_SUBJECT,
                 "email/invoice_payment_failed_customer", purpose="customer_nudge",
                 order_number=order_number,
                 title=NUDGE_SUBJECT, **details)
