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

A link is signed (`receiver.py link`, the console) and taken (the link's page) only for
what a reminder could be about: a cycle written as its kind writes it, and a compliance
order of that kind; anything else would record a filing no reminder looks at.
"""
import calendar
import dataclasses
import datetime
import re
from typing import Collection, Iterator

from models import ComplianceOrder
from engine.transaction import Transaction
from settings import Settings
from domain import links

IFTA, UCR = links.KINDS
MONTH_NAMES = {1: "January to March", 2: "April to June", 3: "July to September",
               4: "October to December"}
CYCLE_FORMS = {IFTA: (re.compile(r"(\d{4})-Q([1-4])"), "a quarter such as 2026-Q3"),
               UCR: (re.compile(r"(\d{4})"), "a registration year such as 2027")}


class LinkRefused(Exception):
    """A well-formed link that no reminder is about: the order is unknown, or is not an
    order of that kind. The message says which."""


class UnknownOrder(LinkRefused):
    """No compliance order has that number."""


@dataclasses.dataclass(frozen=True)
class Cycle:
    kind: str
    label: str        # the cycle of the link: 2026-Q4, 2027
    due: datetime.date
    period: str       # the period in words

    @property
    def title(self) -> str:
        return f"{self.kind.upper()} {'return' if self.kind == IFTA else 'registration'}"


@dataclasses.dataclass(frozen=True)
class Due:
    """One filing reminder due for an order: `days_before` names which of the cycle's
    reminders it is (0: the due date)."""
    order: ComplianceOrder
    cycle: Cycle
    days_before: int

    @property
    def key(self) -> str:
        return f"{self.cycle.kind}|{self.order.order_number}|{self.cycle.label}|{self.days_before}"


def ifta_cycle(year: int, quarter: int) -> Cycle:
    """The IFTA return of that quarter."""
    month = 3 * quarter + 1
    due_year = year + month // 13
    month = (month - 1) % 12 + 1
    due = datetime.date(due_year, month, calendar.monthrange(due_year, month)[1])
    return Cycle(IFTA, f"{year}-Q{quarter}", due, f"Q{quarter} {year} ({MONTH_NAMES[quarter]})")


def ucr_cycle(year: int) -> Cycle:
    """The UCR registration of that year."""
    return Cycle(UCR, str(year), datetime.date(year - 1, 12, 31), f"registration year {year}")


def parse_cycle(kind: str, label: str) -> Cycle:
    """The cycle `label` names for `kind`; InvalidLinkPart when it is not written as that
    kind's cycles are (`2026Q3`, `2026-Q5`, or a quarter for UCR)."""
    form, example = CYCLE_FORMS[kind]
    match = form.fullmatch(label)
    if match is None:
        raise links.InvalidLinkPart(f"the {kind} period must be {example}, not {label!r}")
    return ifta_cycle(*map(int, match.groups())) if kind == IFTA else ucr_cycle(int(label))


def kind_of(settings: Settings, order: ComplianceOrder) -> str | None:
    """ifta, ucr or None: which filing reminders `order`'s service gets."""
    slug = (order.service_slug or "").lower()
    for kind, slugs in ((IFTA, settings.ifta_service_slugs), (UCR, settings.ucr_service_slugs)):
        if slug in _lowered(slugs):
            return kind
    return None


def check_link_parts(kind: str, order_number: str, label: str) -> None:
    """InvalidLinkPart unless the link could be signed and its cycle is one of `kind`'s."""
    links.check_parts(kind, order_number, label)
    parse_cycle(kind, label)


def check_link(tx: Transaction, settings: Settings, kind: str, order_number: str,
               label: str) -> ComplianceOrder:
    """The compliance order a link for (`kind`, `order_number`, `label`) is about, if a
    reminder could be: InvalidLinkPart for a malformed part, LinkRefused for an unknown
    order or one of another kind (IFTA_SERVICE_SLUGS, UCR_SERVICE_SLUGS)."""
    check_link_parts(kind, order_number, label)
    # IFTA and UCR are compliance services: their orders are compliance orders.
    order = tx.order("compliance", order_number)
    if order is None:
        raise UnknownOrder(f"no compliance order {order_number}")
    if kind_of(settings, order) != kind:
        raise LinkRefused(
            f"order {order_number} gets no {kind.upper()} reminders: its service, "
            f"{order.service_slug or 'none'}, is not in {kind.upper()}_SERVICE_SLUGS")
    return order


def cycles_near(day: datetime.date) -> Iterator[Cycle]:
    """Every cycle whose due date could be within a year of `day`, either way."""
    for year in (day.year - 1, day.year, day.year + 1):
        for quarter in (1, 2, 3, 4):
            yield ifta_cycle(year, quarter)
        yield ucr_cycle(year + 1)


def reminder_due(cycle: Cycle, day: datetime.date,
                 reminder_days: Collection[int]) -> int | None:
    """Which reminder of `cycle` is due on `day`: the latest of its reminder days that has
    come (a number of days before the due date), or None outside the reminder window."""
    days_left = (cycle.due - day).days
    if days_left < 0:
        return None
    come = [before for before in (*reminder_days, 0) if before >= days_left]
    return min(come) if come else None


def due_on(tx: Transaction, settings: Settings, day: datetime.date) -> dict[str, list[Due]]:
    """The filing reminders due on `day` for every order that gets them (the click and
    the sent ones are the caller's to check), by customer address."""
    cycles = [(cycle, before) for cycle in cycles_near(day)
              if (before := reminder_due(cycle, day, settings.filing_reminder_days)) is not None]
    if not cycles:
        return {}
    slugs = _lowered(settings.ifta_service_slugs) | _lowered(settings.ucr_service_slugs)
    by_customer: dict[str, list[Due]] = {}
    for order in tx.orders_reminded_of_filings(slugs):
        address = (order.customer_email or "").strip().lower()
        kind = kind_of(settings, order)
        for cycle, before in cycles:
            if address and cycle.kind == kind:
                by_customer.setdefault(address, []).append(Due(order, cycle, before))
    return by_customer


def _lowered(slugs: Collection[str]) -> set[str]:
    return {slug.lower() for slug in slugs}

