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
import functools
import logging

from models import ComplianceOrder, SentReminder
from domain import filings, links
from engine import outbox
from engine.outbox import Effects, stable_key
from engine.prepared import InsertOnce
from engine.transaction import Transaction

log = logging.getLogger("receiver.reminders")

AWAITING_INTAKE = "awaiting_intake"
MAX_REMINDERS_PER_ORDER = 10
MAIL = "mail"
NEW_REMINDER = InsertOnce(SentReminder)


@dataclasses.dataclass
class ToRemind:
    """What one customer is to be reminded of today."""
    email: str
    intake: list
    filings: list
    mailed_today: bool = False

    @property
    def customer_name(self):
        orders = [*self.intake, *(due.order for due in self.filings)]
        return next((order.customer_name for order in orders if order.customer_name), None)


def today(ctx):
    return ctx.clock().astimezone(ctx.business_tz).date()


def plan(ctx, day):
    """Every customer with a reminder due on `day`, by address. A unit of work (ctx.db)."""
    intake = _waiting_by_customer()
    tx = Transaction(ctx)
    due = filings.due_on(tx, ctx.settings, day)
    planned = []
    for email in sorted(set(intake) | set(due)):
        entry = ToRemind(email, intake.get(email, []), _unsent(tx, due.get(email, [])))
        if entry.intake or entry.filings:
            entry.mailed_today = _mailed_on(ctx, entry, day)
            planned.append(entry)
    return planned


async def send_reminders(ctx):
    """Queue today's reminder e-mails and send them; returns how many were queued."""
    day = today(ctx)
    effects = Effects(ctx)
    for entry in await ctx.db(functools.partial(plan, ctx, day)):
        if not entry.mailed_today:
            await effects.transaction(functools.partial(_remind, ctx, effects, entry, day))
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


def _unsent(tx, dues):
    dues = [due for due in dues
            if not links.already_filed(tx, due.cycle.kind, due.order.order_number, due.cycle.label)]
    if not dues:
        return []
    sent = {key for (key,) in SentReminder.select(SentReminder.key)
            .where(SentReminder.key.in_([due.key for due in dues])).tuples()}
    return [due for due in dues if due.key not in sent]


def mail_key(email, day):
    return f"{MAIL}|{email}|{day.isoformat()}"


def _mailed_on(ctx, entry, day):
    return (any(_reminded_on(ctx, order, day) for order in entry.intake)
            or SentReminder.select().where(SentReminder.key == mail_key(entry.email, day))
            .exists())


def _reminded_on(ctx, order, day):
    reminded = order.intake_reminded_at
    return reminded is not None and reminded.astimezone(ctx.business_tz).date() == day


def _recorded(ctx, key, kind, email, day, due=None):
    """Insert a sent reminder's key; False when a run got there first."""
    now = ctx.clock()
    return NEW_REMINDER.run(
        key=key, kind=kind, customer_email=email, day=day.isoformat(),
        order_number=due.order.order_number if due else None,
        cycle=due.cycle.label if due else None, created_at=now, updated_at=now) is not None


def _remind(ctx, effects, entry, day):
    if not _recorded(ctx, mail_key(entry.email, day), MAIL, entry.email, day):
        return  # another run mailed this customer today
    dues = [due for due in entry.filings
            if _recorded(ctx, due.key, due.cycle.kind, entry.email, day, due)]
    if not (entry.intake or dues):
        return  # every filing reminder was sent by a run that raced this one
    subject = _subject(entry.intake, dues)
    effects.email(
        [entry.email], subject, "email/reminder",
        key=f"reminder-{stable_key(entry.email, day.isoformat())}",
        title=subject, customer_name=entry.customer_name, orders=entry.intake,
        filings=[_filing_view(ctx, due) for due in dues])
    if entry.intake:
        now = ctx.clock()
        (ComplianceOrder.update(
            intake_reminders_sent=ComplianceOrder.intake_reminders_sent + 1,
            intake_reminded_at=now, updated_at=now)
         .where(ComplianceOrder.id.in_([order.id for order in entry.intake])).execute())
    log.info("reminder queued for one customer: %s",
             ", ".join([*(o.order_number for o in entry.intake), *(d.key for d in dues)]))


def long_date(day):
    return f"{day:%A}, {day:%B} {day.day}, {day.year}"


def _filing_view(ctx, due):
    cycle = due.cycle
    return {"title": cycle.title, "cycle": cycle.label, "period": cycle.period,
            "due": long_date(cycle.due), "order_number": due.order.order_number,
            "service_name": due.order.service_name,
            "link": links.signed_link(ctx.settings, cycle.kind, due.order.order_number,
                                      cycle.label)}


def _subject(orders, dues):
    if dues and not orders and len(dues) == 1:
        cycle = dues[0].cycle
        return (f"Your {cycle.title} for {cycle.label} is due "
                f"{cycle.due:%B} {cycle.due.day}, {cycle.due.year}")
    if dues:
        return f"{len(orders) + len(dues)} reminders about your orders"
    if len(orders) == 1:
        return f"Your order {orders[0].order_number} is waiting for your intake form"
    return f"{len(orders)} of your orders are waiting for your intake forms"
