"""Settlement of CRTC orders (BEHAVIOUR.md 4.2 balance.available): once a card, ACH or BNPL
payment has had time to settle, the order advances to Client Selection in Frappe.

Called by the balance.available plugin and, as a fallback, by the scheduler. Two runs at
once are safe: funds_available is set under a re-check, so it is set once. Both runs may
then have asked Frappe to apply the action; Frappe refuses the second with 417 (invalid
transition). A 417 is not taken as final: Frappe is asked where the document stands, and
one that has left Awaiting Funds had the action applied already (by the other run, or by
a run that crashed before it could record it), so the order is marked settled.
"""
import datetime
import logging

from models import CrtcOrder, database
from engine.db import locked
from domain.orders import document_name

log = logging.getLogger("receiver.settlement")

BATCH_SIZE = 20
# The workflow state a CRTC order waits in until the funds action moves it on.
AWAITING_FUNDS = "Awaiting Funds"
# Business days (Mon-Fri, holidays not considered) a payment needs before it counts.
BUSINESS_DAYS_TO_SETTLE = {"card": 2, "bnpl": 2, "ach": 4}


def business_days_after(start, end):
    """Weekdays d with start < d <= end (dates)."""
    days = 0
    day = start + datetime.timedelta(days=1)
    while day <= end:
        days += day.weekday() < 5
        day += datetime.timedelta(days=1)
    return days


def waiting_orders():
    return (CrtcOrder.select()
            .where(CrtcOrder.payment_status == "paid",
                   CrtcOrder.funds_available == False,  # noqa: E712 (SQL, not Python)
                   CrtcOrder.payment_method.in_(list(BUSINESS_DAYS_TO_SETTLE)),
                   CrtcOrder.paid_at.is_null(False))
            .order_by(CrtcOrder.paid_at, CrtcOrder.id))


def is_due(ctx, order, today):
    paid_on = order.paid_at.astimezone(ctx.business_tz).date()
    return business_days_after(paid_on, today) >= BUSINESS_DAYS_TO_SETTLE[order.payment_method]


def still_waiting(order_id):
    return waiting_orders().where(CrtcOrder.id == order_id).exists()


def mark_funds_available(ctx, order_id):
    """Set funds_available once; False when another run got there first."""
    now = ctx.clock()
    with database.atomic():
        current = locked(CrtcOrder.select(CrtcOrder.funds_available)
                         .where(CrtcOrder.id == order_id)).get()
        if current.funds_available:
            return False
        (CrtcOrder.update(funds_available=True, funds_available_at=now, updated_at=now)
         .where(CrtcOrder.id == order_id).execute())
    return True


async def advance(ctx, order):
    """Apply the funds action in Frappe; only when it succeeds is the order marked settled,
    so a refused or failed order is tried again on the next run."""
    settings = ctx.settings
    # After a 417, a document that has left Awaiting Funds had the action applied before
    # and only its recording was lost (otherwise the order would hold a batch slot for
    # good); one Frappe cannot show us counts as not applied (retried next run).
    result = await ctx.workflow.apply_action(
        settings.crtc_doctype, document_name(order), settings.crtc_funds_action,
        waiting_in=AWAITING_FUNDS)
    if not result.ok:
        raise RuntimeError(f"{settings.crtc_funds_action!r} not applied: {result.error}")
    return mark_funds_available(ctx, order.id)


async def settle_crtc_orders(ctx):
    """Advance up to BATCH_SIZE settled CRTC orders, oldest payment first. Returns counts:
    examined, settled, not_due, failed (logged; the loop goes on)."""
    today = ctx.clock().astimezone(ctx.business_tz).date()
    counts = {"examined": 0, "settled": 0, "not_due": 0, "failed": 0}
    for order in list(waiting_orders().limit(BATCH_SIZE)):
        counts["examined"] += 1
        if not is_due(ctx, order, today):
            counts["not_due"] += 1
            continue
        try:
            if still_waiting(order.id) and await advance(ctx, order):
                counts["settled"] += 1
                log.info("CRTC order %s: funds settled (%s), advanced",
                         order.order_number, order.payment_method)
        except Exception:
            counts["failed"] += 1
            log.exception("CRTC order %s: could not advance; will retry next run",
                          order.order_number)
    return counts
