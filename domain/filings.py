"""The IFTA and UCR filing calendar, and which filing reminders are due on a day.

IFTA is quarterly: cycle `YYYY-Qn`, its return due the last day of the month after the
quarter (Q1 Apr 30, Q2 Jul 31, Q3 Oct 31, Q4 Jan 31 of the next year). UCR is yearly:
cycle `YYYY` is the registration year, due Dec 31 of the year before (registration opens
Oct 1).

A cycle's reminders go out on the days before its due date that FILING_REMINDER_DAYS
lists (14, 7, 3 and 1) and on the due date, days counted in BUSINESS_TZ. Each of those
is one reminder, sent once. A reminder not sent on its day (the service was down, or the
customer had already had their one reminder e-mail that day) is sent on a later day while
it is still the latest one due; never after the due date.

Who: compliance orders of an IFTA_SERVICE_SLUGS or UCR_SERVICE_SLUGS service, paid, with
a customer e-mail, whose subscription is not cancelled, until the customer clicks that
cycle's "I already filed" link.
"""
import calendar
import dataclasses
import datetime

from peewee import fn

from models import ComplianceOrder
from domain import links

IFTA, UCR = links.KINDS
MONTH_NAMES = {1: "January to March", 2: "April to June", 3: "July to September",
               4: "October to December"}


@dataclasses.dataclass(frozen=True)
class Cycle:
    kind: str
    label: str        # the cycle of the link: 2026-Q4, 2027
    due: datetime.date
    period: str       # the period in words

    @property
    def title(self):
        return f"{self.kind.upper()} {'return' if self.kind == IFTA else 'registration'}"


@dataclasses.dataclass(frozen=True)
class Due:
    """One filing reminder due for an order: `days_before` names which of the cycle's
    reminders it is (0: the due date)."""
    order: ComplianceOrder
    cycle: Cycle
    days_before: int

    @property
    def key(self):
        return f"{self.cycle.kind}|{self.order.order_number}|{self.cycle.label}|{self.days_before}"


def ifta_cycle(year, quarter):
    month = 3 * quarter + 1
    due_year = year + month // 13
    month = (month - 1) % 12 + 1
    due = datetime.date(due_year, month, calendar.monthrange(due_year, month)[1])
    return Cycle(IFTA, f"{year}-Q{quarter}", due, f"Q{quarter} {year} ({MONTH_NAMES[quarter]})")


def ucr_cycle(year):
    return Cycle(UCR, str(year), datetime.date(year - 1, 12, 31), f"registration year {year}")


def cycles_near(day):
    """Every cycle whose due date could be within a year of `day`, either way."""
    for year in (day.year - 1, day.year, day.year + 1):
        for quarter in (1, 2, 3, 4):
            yield ifta_cycle(year, quarter)
        yield ucr_cycle(year + 1)


def reminder_due(cycle, day, reminder_days):
    """Which reminder of `cycle` is due on `day`: the latest of its reminder days that has
    come (a number of days before the due date), or None outside the reminder window."""
    days_left = (cycle.due - day).days
    if days_left < 0:
        return None
    come = [before for before in (*reminder_days, 0) if before >= days_left]
    return min(come) if come else None


def due_on(settings, day):
    """The filing reminders due on `day` for every order that gets them (the click and
    the sent ones are the caller's to check), by customer address."""
    cycles = [(cycle, reminder_due(cycle, day, settings.filing_reminder_days))
              for cycle in cycles_near(day)]
    cycles = [(cycle, before) for cycle, before in cycles if before is not None]
    if not cycles:
        return {}
    slugs = {IFTA: _lowered(settings.ifta_service_slugs), UCR: _lowered(settings.ucr_service_slugs)}
    by_customer = {}
    for order in _reminded_orders(slugs):
        address = order.customer_email.strip().lower()
        kind = next((kind for kind, named in slugs.items()
                     if (order.service_slug or "").lower() in named), None)
        for cycle, before in cycles:
            if address and cycle.kind == kind:
                by_customer.setdefault(address, []).append(Due(order, cycle, before))
    return by_customer


def _lowered(slugs):
    return {slug.lower() for slug in slugs}


def _reminded_orders(slugs):
    return (ComplianceOrder.select()
            .where(fn.LOWER(ComplianceOrder.service_slug).in_(sorted(slugs[IFTA] | slugs[UCR])),
                   ComplianceOrder.payment_status == "paid",
                   ComplianceOrder.customer_email.is_null(False),
                   ComplianceOrder.cancelled_at.is_null(),
                   ComplianceOrder.subscription_status.is_null()
                   | (ComplianceOrder.subscription_status != "cancelled"))
            .order_by(ComplianceOrder.created_at, ComplianceOrder.id))
