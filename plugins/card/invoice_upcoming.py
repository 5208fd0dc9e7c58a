"""invoice.upcoming: Stripe will soon charge a subscription's next invoice (days before,
as the account's subscription settings say). A subscription whose order lost a dispute
would charge the customer who disputed it again: the administrator is told before the
renewal, once per renewal, with the amount, so it can be cancelled in time."""
import datetime
import logging
from typing import Any

from models import UTC
from plugins.registry import card_event
from plugins.card import EACH_EVENT
from domain.card_events import email_admin, object_of, subscription_of_invoice
from domain.money import stripe_money
from domain.payment_state import DISPUTE_LOST
from engine.contracts import EngineContext
from engine.transaction import Transaction

log = logging.getLogger("receiver.card")


@card_event("invoice.upcoming", EACH_EVENT)
def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    invoice = object_of(event)
    subscription = subscription_of_invoice(invoice)
    order = tx.order_with_subscription(subscription)
    if order is None or order.payment_status != DISPUTE_LOST:
        return
    if order.subscription_status == "cancelled":
        return
    charged_at = invoice.get("next_payment_attempt") or invoice.get("period_end")
    renews = (datetime.datetime.fromtimestamp(charged_at, UTC).isoformat(timespec="seconds")
              if isinstance(charged_at, int) else "soon")
    log.warning("subscription %s of order %s renews %s after its payment was lost in a "
                "dispute", subscription, order.order_number, renews)
    email_admin(ctx, tx, f"Subscription of order {order.order_number} renews after a "
                f"lost dispute", "renewal_after_lost_dispute", order.order_number,
                key=f"email-renewal-after-lost-dispute-{subscription}-{charged_at}",
                subscription=subscription, renews=renews,
                amount=stripe_money(invoice.get("amount_due"), invoice.get("currency")),
                dispute=order.dispute_id, customer_name=order.customer_name,
                customer_email=order.customer_email)
