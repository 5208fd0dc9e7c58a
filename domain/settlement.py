"""Settlement of CRTC orders (BEHAVIOUR.md 4.2 balance.available): once a card, ACH or BNPL
payment has had time to settle, the order advances to Client Selection in Frappe.

Called by the balance.available plugin and, as a fallback, by the scheduler. Two runs at
once are safe: funds_available is set under a re-check, so it is set once. Both runs may
then have asked Frappe to apply the action; Frappe refuses the second with 417 (invalid
transition). A 417 is not taken as final: Frappe is asked where the document stands, and
one in a state the action leads to (by the doctype's workflow) had the action applied
already (by the other run, or by a run that crashed before it could record it), so the
order is marked settled. One still before the action (ops have not asked for its funds
yet) is refused: it is counted, goes to the back of the batch, and the administrator is
told once when it has been refused SETTLEMENT_REFUSALS_BEFORE_ALERT times.
"""
import datetime
import functools
import logging

from clients.http import Result
from models import CrtcOrder
from engine import retry
from engine.contracts import EngineContext
from engine.outbox import tell_admin
from engine.transaction import Transaction
from domain.orders import FREE, document_name, paid_amount

log = logging.getLogger("receiver.settlement")

BATCH_SIZE = 20
# Refusals of our credentials, not of the order: every order meets them alike, so no
# order's count goes up for them.
CREDENTIALS_REFUSED = (401, 403)
# Business days (Mon-Fri, holidays not considered) a payment needs before it counts.
# An order that needed no payment (FREE) has nothing to wait for.
BUSINESS_DAYS_TO_SETTLE = {"card": 2, "bnpl": 2, "ach": 4, FREE: 0}


def business_days_after(start: datetime.date, end: datetime.date) -> int:
    """Weekdays d with start < d <= end (dates)."""
    days = 0
    day = start + datetime.timedelta(days=1)
    while day <= end:
        days += day.weekday() < 5
        day += datetime.timedelta(days=1)
    return days


def waiting_orders(tx: Transaction, limit: int | None = None) -> list[CrtcOrder]:
    """The CRTC orders paid and awaiting their funds, with a payment method that settles,
    in the order settlement tries them: orders never refused first, oldest paid first;
    then the refused ones, the one refused longest ago first (twenty orders Frappe
    refuses for good do not hold every newer order out of the batch). At most `limit`."""
    return tx.orders_awaiting_funds(BUSINESS_DAYS_TO_SETTLE, limit)


def count_waiting(tx: Transaction) -> int:
    """How many orders `waiting_orders` gives."""
    return tx.count_orders_awaiting_funds(BUSINESS_DAYS_TO_SETTLE)


def is_due(ctx: EngineContext, order: CrtcOrder, today: datetime.date) -> bool:
    paid_on = order.paid_at.astimezone(ctx.business_tz).date()
    needed = BUSINESS_DAYS_TO_SETTLE[order.payment_method or ""]
    return business_days_after(paid_on, today) >= needed


def still_waiting(tx: Transaction, order_id: int) -> bool:
    return tx.awaits_funds(order_id, BUSINESS_DAYS_TO_SETTLE)


def mark_funds_available(ctx: EngineContext, tx: Transaction, order_id: int) -> bool:
    """Set funds_available once; False when another run got there first. A unit of
    work (ctx.db)."""
    if tx.lock_funds_available(order_id):
        return False
    tx.set_funds_available(order_id, ctx.clock())
    return True


def record_refusal(ctx: EngineContext, tx: Transaction, order_id: int, error: str) -> int:
    """Count one refusal of the funds action for the order (which moves it to the back of
    the batch), and tell the administrator once, when the count reaches
    SETTLEMENT_REFUSALS_BEFORE_ALERT. Returns the count. A unit of work (ctx.db)."""
    order = tx.lock_crtc_order_by_id(order_id)
    now = ctx.clock()
    order.funds_refusals += 1
    order.funds_refused_at = now
    order.updated_at = now
    tx.save(order)
    if retry.settlement(ctx.settings).tells_admin_at(order.funds_refusals):
        subject = f"CRTC order {order.order_number}: Frappe refused settlement " \
                  f"{order.funds_refusals} times"
        tell_admin(ctx, f"settlement-refused-{order.order_number}", subject,
                   "settlement_refused", order=order, action=ctx.settings.crtc_funds_action,
                   doctype=ctx.settings.crtc_doctype, error=error, amount=paid_amount(order))
    return order.funds_refusals


async def advance(ctx: EngineContext, tx: Transaction, order: CrtcOrder) -> bool:
    """Apply the funds action in Frappe; only when it succeeds is the order marked settled,
    so a refused or failed order is tried again on the next run."""
    settings = ctx.settings
    # After a 417, a document in a state the action leads to had the action applied
    # before and only its recording was lost; one Frappe cannot show us, or one still
    # before the action, counts as not applied (retried next run).
    result = await ctx.workflow.apply_action(
        settings.crtc_doctype, document_name(order), settings.crtc_funds_action)
    if result.ok:
        return await ctx.db(functools.partial(mark_funds_available, ctx, tx, order.id))
    if refuses_the_order(result):
        await ctx.db(functools.partial(record_refusal, ctx, tx, order.id, result.error))
    raise RuntimeError(f"{settings.crtc_funds_action!r} not applied: {result.error}")


def refuses_the_order(result: Result) -> bool:
    """Frappe answered, and refused this order's action for good (417 for a state the
    action does not apply from, 404 for a document it does not have): not a network
    error or a 5xx, which every order meets alike, nor a refusal of our credentials or
    one our settings left unread (a 417 whose read-back could not read Workflow: the
    action may have been applied)."""
    return (not result.retryable and result.configured and 400 <= result.status < 500
            and result.status not in CREDENTIALS_REFUSED and not result.misconfigured)


async def settle_crtc_orders(ctx: EngineContext, tx: Transaction) -> dict[str, int]:
    """Advance up to BATCH_SIZE settled CRTC orders, oldest payment first (orders Frappe
    refused last, see `waiting_orders`); each read and write is a unit of work of its own
    (ctx.db), through `tx`. Returns counts:
    examined, settled, not_due, failed (logged; the loop goes on)."""
    today = ctx.clock().astimezone(ctx.business_tz).date()
    counts = {"examined": 0, "settled": 0, "not_due": 0, "failed": 0}
    for order in await ctx.db(functools.partial(waiting_orders, tx, BATCH_SIZE)):
        counts["examined"] += 1
        if not is_due(ctx, order, today):
            counts["not_due"] += 1
            continue
        try:
            if (await ctx.db(functools.partial(still_waiting, tx, order.id))
                    and await advance(ctx, tx, order)):
                counts["settled"] += 1
                log.info("CRTC order %s: funds settled (%s), advanced",
                         order.order_number, order.payment_method)
        except Exception:
            counts["failed"] += 1
            log.exception("CRTC order %s: could not advance; will retry next run",
                          order.order_number)
    return counts
