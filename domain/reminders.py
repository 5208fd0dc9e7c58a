"""Reminder e-mails to customers: intake reminders and the IFTA/UCR filing reminders,
together in at most one consolidated e-mail per customer per day (a calendar day in
BUSINESS_TZ).

Intake: compliance orders waiting in fulfillment_status `awaiting_intake` are listed, at
most 10 times per order and at most once a day (counted on the order).
Filings: `domain.filings` says which reminders are due; one already sent, or whose
cycle's "I already filed" link was clicked, is left out.

Each reminder is sent once: the e-mail's row in `reminders_sent` (`mail|<customer>|<day>`)
and one row per filing reminder it carries are inserted in the transaction that queues
it, under unique keys. A second run that day, in this process or another, finds them and
adds nothing (on PostgreSQL a racing insert of the same key waits for the first
transaction, then finds its row). A customer mailed today gets anything new tomorrow.
"""
import collections
import dataclasses
import datetime
import functools
import logging
from typing import Any

from models import ComplianceOrder
from domain import filings, links
from domain.filings import Due
from engine import outbox
from engine.contracts import EngineContext
from engine.outbox import stable_key
from engine.transaction import Transaction

log = logging.getLogger("receiver.reminders")

AWAITING_INTAKE = "awaiting_intake"
MAX_REMINDERS_PER_ORDER = 10
MAIL = "mail"


@dataclasses.dataclass
class ToRemind:
    """What one customer is to be reminded of today."""
    email: str
    intake: list[ComplianceOrder]
    filings: list[Due]
    mailed_today: bool = False

    @property
    def customer_name(self) -> str | None:
        orders = [*self.intake, *(due.order for due in self.filings)]
        return next((order.customer_name for order in orders if order.customer_name), None)


def today(ctx: EngineContext) -> datetime.date:
    return ctx.clock().astimezone(ctx.business_tz).date()


def plan(ctx: EngineContext, tx: Transaction, day: datetime.date) -> list[ToRemind]:
    """Every customer with a reminder due on `day`, by address. A unit of work (ctx.db)."""
    intake = _waiting_by_customer(tx)
    due = filings.due_on(tx, ctx.settings, day)
    planned = []
    for email in sorted(set(intake) | set(due)):
        entry = ToRemind(email, intake.get(email, []), _unsent(tx, due.get(email, [])))
        if entry.intake or entry.filings:
            entry.mailed_today = _mailed_on(ctx, tx, entry, day)
            planned.append(entry)
    return planned


async def send_reminders(ctx: EngineContext) -> int:
    """Queue today's reminder e-mails and send them; returns how many were queued."""
    day = today(ctx)
    tx = Transaction(ctx)
    for entry in await ctx.db(functools.partial(plan, ctx, tx, day)):
        if not entry.mailed_today:
            await tx.transaction(functools.partial(_remind, ctx, tx, entry, day))
    await outbox.deliver(ctx, tx.rows)
    return len(tx.rows)


def _waiting_by_customer(tx: Transaction) -> dict[str, list[ComplianceOrder]]:
    by_customer: dict[str, list[ComplianceOrder]] = collections.defaultdict(list)
    for order in tx.orders_awaiting_intake(AWAITING_INTAKE, MAX_REMINDERS_PER_ORDER):
        address = (order.customer_email or "").strip().lower()
        if address:
            by_customer[address].append(order)
    return by_customer


def _unsent(tx: Transaction, dues: list[Due]) -> list[Due]:
    dues = [due for due in dues
            if not links.already_filed(tx, due.cycle.kind, due.order.order_number,
                                       due.cycle.label)]
    if not dues:
        return []
    sent = tx.reminders_sent(due.key for due in dues)
    return [due for due in dues if due.key not in sent]


def mail_key(email: str, day: datetime.date) -> str:
    return f"{MAIL}|{email}|{day.isoformat()}"


def _mailed_on(ctx: EngineContext, tx: Transaction, entry: ToRemind,
               day: datetime.date) -> bool:
    return (any(_reminded_on(ctx, order, day) for order in entry.intake)
            or tx.reminder_sent(mail_key(entry.email, day)))


def _reminded_on(ctx: EngineContext, order: ComplianceOrder, day: datetime.date) -> bool:
    reminded = order.intake_reminded_at
    return reminded is not None and reminded.astimezone(ctx.business_tz).date() == day


def _recorded(ctx: EngineContext, tx: Transaction, key: str, kind: str, email: str,
              day: datetime.date, due: Due | None = None) -> bool:
    """Record a sent reminder's key; False when a run got there first."""
    return tx.record_reminder(key, kind, email, day, ctx.clock(),
                              order_number=due.order.order_number if due else None,
                              cycle=due.cycle.label if due else None)


def _remind(ctx: EngineContext, tx: Transaction, entry: ToRemind, day: datetime.date) -> None:
    if not _recorded(ctx, tx, mail_key(entry.email, day), MAIL, entry.email, day):
        return  # another run mailed this customer today
    dues = [due for due in entry.filings
            if _recorded(ctx, tx, due.key, due.cycle.kind, entry.email, day, due)]
    if not (entry.intake or dues):
        return  # every filing reminder was sent by a run that raced this one
    subject = _subject(entry.intake, dues)
    tx.email(
        [entry.email], subject, "email/reminder",
        key=f"reminder-{stable_key(entry.email, day.isoformat())}",
        title=subject, customer_name=entry.customer_name, orders=entry.intake,
        filings=[_filing_view(ctx, due) for due in dues])
    if entry.intake:
        tx.count_intake_reminder(entry.intake, ctx.clock())
    log.info("reminder queued for one customer: %s",
             ", ".join([*(o.order_number for o in entry.intake), *(d.key for d in dues)]))


def long_date(day: datetime.date) -> str:
    return f"{day:%A}, {day:%B} {day.day}, {day.year}"


def _filing_view(ctx: EngineContext, due: Due) -> dict[str, Any]:
    cycle = due.cycle
    return {"title": cycle.title, "cycle": cycle.label, "period": cycle.period,
            "due": long_date(cycle.due), "order_number": due.order.order_number,
            "service_name": due.order.service_name,
            "link": links.signed_link(ctx.settings, cycle.kind, due.order.order_number,
                                      cycle.label)}


def _subject(orders: list[ComplianceOrder], dues: list[Due]) -> str:
    if dues and not orders and len(dues) == 1:
        cycle = dues[0].cycle
        return (f"Your {cycle.title} for {cycle.label} is due "
                f"{cycle.due:%B} {cycle.due.day}, {cycle.due.year}")
    if dues:
        return f"{len(orders) + len(dues)} reminders about your orders"
    if len(orders) == 1:
        return f"Your order {orders[0].order_number} is waiting for your intake form"
    return f"{len(orders)} of your orders are waiting for your intake forms"
