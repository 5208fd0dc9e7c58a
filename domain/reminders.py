"""Intake reminders (BEHAVIOUR.md 8): compliance orders waiting in fulfillment_status
`awaiting_intake` remind their customer, at most 10 times per order and at most one
consolidated e-mail per customer per day (a calendar day in BUSINESS_TZ), listing all of
that customer's orders that still wait and have reminders left.

An order is reminded at most once a day; the e-mail's outbox key names the customer and
the day, so a second run that day (in this process or another) adds nothing.
"""
import collections
import logging

from models import ComplianceOrder, database
from engine import outbox
from engine.outbox import Effects, stable_key

log = logging.getLogger("receiver.reminders")

AWAITING_INTAKE = "awaiting_intake"
MAX_REMINDERS_PER_ORDER = 10


async def send_intake_reminders(ctx):
    """Queue today's reminder e-mails and send them; returns how many were queued."""
    today = ctx.clock().astimezone(ctx.business_tz).date()
    effects = Effects(ctx)
    for email, orders in _waiting_by_customer().items():
        with database.atomic():
            _remind(ctx, effects, email, orders, today)
    await outbox.deliver(ctx, effects.rows)
    return len(effects.rows)


def _waiting_by_customer():
    waiting = (ComplianceOrder.select()
               .where(ComplianceOrder.fulfillment_status == AWAITING_INTAKE,
                      ComplianceOrder.intake_reminders_sent < MAX_REMINDERS_PER_ORDER,
                      ComplianceOrder.customer_email.is_null(False))
               .order_by(ComplianceOrder.created_at, ComplianceOrder.id))
    by_customer = collections.defaultdict(list)
    for order in waiting:
        address = order.customer_email.strip().lower()
        if address:
            by_customer[address].append(order)
    return by_customer


def _remind(ctx, effects, email, orders, today):
    if any(_reminded_on(ctx, order, today) for order in orders):
        return
    queued = effects.email(
        [email], _subject(orders), "email/intake_reminder",
        key=f"intake-reminder-{stable_key(email, today.isoformat())}",
        title=_subject(orders), customer_name=orders[0].customer_name,
        orders=orders)
    if not queued:
        return  # already queued today by another run
    now = ctx.clock()
    (ComplianceOrder.update(intake_reminders_sent=ComplianceOrder.intake_reminders_sent + 1,
                            intake_reminded_at=now, updated_at=now)
     .where(ComplianceOrder.id.in_([order.id for order in orders])).execute())
    log.info("intake reminder queued for %d order(s) of one customer: %s", len(orders),
             ", ".join(order.order_number for order in orders))


def _reminded_on(ctx, order, day):
    reminded = order.intake_reminded_at
    return reminded is not None and reminded.astimezone(ctx.business_tz).date() == day


def _subject(orders):
    if len(orders) == 1:
        return f"Your order {orders[0].order_number} is waiting for your intake form"
    return f"{len(orders)} of your orders are waiting for your intake forms"
