"""What the operator console shows and does, apart from HTTP: the overview's numbers,
the event and outbox lists (keyset pages, fast at any table size), an order's timeline,
the settlement queue and holdbacks, and the record of what operators did.

The actions follow the command line's rules (ops.operator): a processed event is
replayed only when the operator confirms it, a sent effect is never sent again.

Longer than most: every page's queries are here, one section a page, so what the console
costs a large database can be read in one place."""
import dataclasses
import datetime
import functools
import itertools
import json
import logging
import re
import urllib.parse
from typing import Any, Iterator, Protocol

import peewee

from clients.http import JSON_HEADERS
from domain import orders, reconcile, settlement
from domain.money import money
from engine import inbox, outbox
from engine.claims import claim, lease
from engine.contracts import EngineContext
from engine.destinations import ORDERED_KINDS
from engine.store.intake import waiting_for_an_id
from engine.store.orders import CREATED, history_value
from engine.transaction import Transaction
from models import (
    Attempt, ConsoleAction, CrtcOrder, LedgerEntry, OrderBase, OrderChange, Outbox,
    SelfFiling, SurveyResponse, TreasuryJob, WebhookEvent,
)
from settings import Settings
from ops import operator
from ops.metrics import Metrics, spool_usage

log = logging.getLogger("receiver.console")

PAGE_SIZE = 50
DAY = datetime.timedelta(days=1)
HOUR = datetime.timedelta(hours=1)
CHART_DAYS = 7
# Effects still to go out: every status but the final ones.
FINAL_OUTBOX_STATUSES = ("sent", "logged", "dead")
# What the outbox page counts: the rows still to go out, and those given up.
COUNTED_OUTBOX_STATUSES = ("pending", "waiting", "dead")
# Payload keys whose values are never shown: credentials a sender may put in a body.
SECRET_KEY = re.compile(r"secret|signature|token|password|api[_-]?key|authorization",
                        re.IGNORECASE)
HIDDEN = "[hidden]"
# A JSON key and its plain value (a string, number, true, false or null), in a payload's
# text.
SECRET_IN_TEXT = re.compile(r'(?P<key>"(?:[^"\\]|\\.)*")\s*:\s*'
                            r'(?:"(?:[^"\\]|\\.)*"|[-+0-9.eE]+|true|false|null)')


class ConsoleContext(EngineContext, Protocol):
    """What the console asks of the context it is given (app.context.Context): the
    engine's, with this process's metrics (its jobs' runs)."""

    @property
    def metrics(self) -> Metrics: ...


# The record of operator actions.

def record_action(ctx: ConsoleContext, operator_name: str, address: str, action: str,
                  target: object = "", outcome: str = "",
                  at: datetime.datetime | None = None) -> None:
    """Keep what an operator did (also when it was refused) and log it; `at`: when it
    was asked for, if before now (a retry is recorded with its outcome, once sent)."""
    ConsoleAction.create(operator=operator_name, address=address, action=action,
                         target=str(target), outcome=outcome, created_at=at or ctx.clock(),
                         updated_at=ctx.clock())
    log.info("console: %s from %s: %s %s: %s", operator_name, address, action, target,
             outcome)


def recent_actions(limit: int = PAGE_SIZE) -> list[ConsoleAction]:
    return list(ConsoleAction.select()
                .order_by(ConsoleAction.created_at.desc(), ConsoleAction.id.desc())
                .limit(limit))


# The overview.

@dataclasses.dataclass
class Backlog:
    destination: str
    status: str
    count: int
    oldest: datetime.datetime


@dataclasses.dataclass
class Overview:
    now: datetime.datetime
    # {source: [count of day 6 ago, ..., count of the last 24 h]}
    events_by_day: dict
    backlog: list
    dead_effects: dict
    event_failures: dict
    spool_files: int
    spool_bytes: int
    jobs: dict
    settlement_queue: int
    in_holdback: int
    # What this process has learnt of each destination (engine.destinations).
    destinations: list
    # Events operators gave up (dead, final; not counted among the failures).
    given_up_events: int
    # One line on the last reconciliation with the workflow system, once it runs.
    last_reconciliation: str | None = None
    # What the failures awaiting an operator failed of, most first (`failures_by_cause`).
    causes: list = dataclasses.field(default_factory=list)

    @property
    def last_day(self) -> dict[str, int]:
        return {source: days[-1] for source, days in self.events_by_day.items()}

    @property
    def last_week(self) -> dict[str, int]:
        return {source: sum(days) for source, days in self.events_by_day.items()}


def last_reconciliation(tx: Transaction, settings: Settings) -> str | None:
    """When each doctype's reconciliation with Frappe last finished (UTC), on one line;
    None when no Frappe is configured."""
    last = reconcile.last_successes(tx, settings)
    if not last:
        return None
    return "; ".join(f"{doctype} {operator.format_time(at) if at else 'never'}"
                     for doctype, at in last.items())


def overview(ctx: ConsoleContext, counts: "EventCounts") -> Overview:
    now = ctx.clock()
    files, size = spool_usage(ctx.settings.spool_dir)
    failures = operator.failures_awaiting_an_operator()
    return Overview(
        now=now, events_by_day=counts.by_day(ctx, now), backlog=backlog(),
        dead_effects={destination: count
                      for (destination, status), count in outbox_counts().items()
                      if status == "dead"},
        event_failures={status: failures[status] for status in operator.FAILURES
                        if failures[status]},
        given_up_events=failures["given up"],
        spool_files=files, spool_bytes=size, jobs=ctx.metrics.job_status(),
        settlement_queue=settlement.count_waiting(Transaction(ctx)),
        destinations=list(ctx.destinations),
        in_holdback=holdback_orders().where(CrtcOrder.commission_released_at.is_null(),
                                            CrtcOrder.commission_forfeited_at.is_null())
        .count(), last_reconciliation=last_reconciliation(Transaction(ctx), ctx.settings),
        causes=failures_by_cause())


@dataclasses.dataclass(frozen=True)
class Cause:
    """Failures of one kind of thing (`events` of a source, `effects` to a destination)
    that failed of one cause, and where the list of them is."""
    what: str
    where: str
    cause: str
    count: int
    link: str


# The failures read to group them: the newest, so that a flood of one cause costs one
# bounded read (its count is then "at least").
CAUSES_READ = 2000
CAUSES_SHOWN = 10


def cause_of(error: str | None) -> str:
    """An error's cause, without what differs from one failure to the next: its first
    part (`OrderNotFound`, `HTTP 503`, `ClientConnectorError`), up to 60 characters."""
    if not error:
        return "no error recorded"
    return error.split(": ", 1)[0].strip()[:60] or "no error recorded"


def failures_by_cause() -> list[Cause]:
    """The events and effects awaiting an operator (failed, or dead and not given up;
    effects dead, or pending after a failed try), grouped by source or destination and
    cause, most first: what Sidekiq's and Hookdeck's failure views lead with."""
    grouped: dict[tuple[str, str, str], int] = {}
    events = (WebhookEvent.select(WebhookEvent.source, WebhookEvent.status,
                                  WebhookEvent.last_error)
              .where(operator.awaiting_an_operator())
              .order_by(WebhookEvent.id.desc()).limit(CAUSES_READ))
    for event in events:
        key = ("events", event.source, cause_of(event.last_error))
        grouped[key] = grouped.get(key, 0) + 1
    effects = (Outbox.select(Outbox.kind, Outbox.last_error)
               .where((Outbox.status == "dead")
                      | ((Outbox.status == "pending") & (Outbox.attempts > 0)))
               .order_by(Outbox.id.desc()).limit(CAUSES_READ))
    for effect in effects:
        key = ("effects", operator.destination_of(effect), cause_of(effect.last_error))
        grouped[key] = grouped.get(key, 0) + 1
    causes = [Cause(what, where, cause, count,
                    f"/console/events?source={where}" if what == "events"
                    else f"/console/outbox?destination={where}")
              for (what, where, cause), count in grouped.items()]
    return sorted(causes, key=lambda c: (-c.count, c.what, c.where, c.cause))[:CAUSES_SHOWN]


class EventCounts:
    """Events per source in each of the chart's seven 24-hour windows, oldest first.

    The windows end at the next full hour, so the six older ones stay the same for an
    hour: they are counted once an hour (at 1M events over 30 days that is 200,000 index
    entries, most of the overview's time), the last one on every call. An event stored
    late with an old time (a spool drained after an outage) shows in an older window
    from the next hour on."""

    def __init__(self) -> None:
        self.end: datetime.datetime | None = None
        self.older: dict[str, list[int]] = {}

    def by_day(self, ctx: EngineContext, now: datetime.datetime) -> dict[str, list[int]]:
        end = now.replace(minute=0, second=0, microsecond=0) + HOUR
        sources = sorted(ctx.plugins)
        if end != self.end:
            self.older = {source: [_events_between(source, end - (day + 1) * DAY,
                                                   end - day * DAY)
                                   for day in reversed(range(1, CHART_DAYS))]
                          for source in sources}
            self.end = end
        return {source: [*self.older[source], _events_between(source, end - DAY, end)]
                for source in sources}


def _events_between(source: str, start: datetime.datetime, end: datetime.datetime) -> int:
    """A range of the (source, received_at, id) index, counted."""
    return WebhookEvent.select().where(WebhookEvent.source == source,
                                       WebhookEvent.received_at >= start,
                                       WebhookEvent.received_at < end).count()


def backlog() -> list[Backlog]:
    """Effects still to go out, per destination and status, with the oldest one's time:
    per destination and status, a count of the (kind, status, id) index and its first
    row (ids grow with time), never a look at each waiting row nor at the sent ones."""
    waiting = [status for status in operator.OUTBOX_STATUSES
               if status not in FINAL_OUTBOX_STATUSES]
    found: list[Backlog] = []
    for destination in operator.DESTINATIONS:
        for status in waiting:
            rows = Outbox.select().where(Outbox.kind == operator.KIND_OF[destination],
                                         Outbox.status == status)
            first = rows.order_by(Outbox.id).first()
            if first is not None:
                found.append(Backlog(destination, status, rows.count(), first.created_at))
    return found


# Events.

@dataclasses.dataclass(frozen=True)
class EventFilter:
    source: str = ""
    event_type: str = ""
    status: str = ""
    # An order number, an external id, or an id a fact waits for (engine.inbox's
    # `waiting_for`): any matches.
    search: str = ""
    since: datetime.datetime | None = None
    until: datetime.datetime | None = None

    def conditions(self) -> list[peewee.Expression]:
        """The filter as conditions on WebhookEvent, all to hold."""
        found = [column == value for column, value in (
            (WebhookEvent.source, self.source), (WebhookEvent.event_type, self.event_type))
            if value]
        if self.status:
            found.append(operator.status_is(self.status))
        if self.search:
            found.append((WebhookEvent.order_number == self.search)
                         | (WebhookEvent.external_id == self.search)
                         | waiting_for_an_id(self.search))
        if self.since:
            found.append(WebhookEvent.received_at >= self.since)
        if self.until:
            found.append(WebhookEvent.received_at < self.until)
        return found

    def apply(self, query: "peewee.ModelSelect[WebhookEvent]"
              ) -> "peewee.ModelSelect[WebhookEvent]":
        return query.where(*self.conditions()) if self.conditions() else query


@dataclasses.dataclass
class Page:
    rows: list
    # Where the next page starts (the last row's key: an event's cursor, an outbox row's
    # id), None on the last page.
    after: str | int | None = None


class BadCursor(ValueError):
    """A page cursor that is not one this console made."""


def event_page(filters: EventFilter, after: str | None = None, limit: int = PAGE_SIZE) -> Page:
    """Newest first, `limit` at a time. The cursor is the last row's (received_at, id):
    the next page starts strictly after it in that order, read from an index in order
    however deep the page, unlike an OFFSET."""
    query = filters.apply(WebhookEvent.select())
    if after:
        received_at, event_id = parse_cursor(after)
        # The first condition is a range of the index; the second cuts the ties.
        query = query.where(WebhookEvent.received_at <= received_at,
                            (WebhookEvent.received_at < received_at)
                            | (WebhookEvent.id < event_id))
    rows = list(query.order_by(WebhookEvent.received_at.desc(), WebhookEvent.id.desc())
                .limit(limit + 1))
    more = len(rows) > limit
    rows = operator.note_holds(rows[:limit])
    return Page(rows, cursor_of(rows[-1]) if more else None)


def awaiting_an_operator(filters: EventFilter) -> int:
    """How many of the events `filters` finds await an operator: what the events page's
    bulk retry and give-up act on, offered when it filters by one of the two statuses
    (failed; dead, given up by the retries), or by `waiting` (every fact the filter finds
    waits for its order)."""
    found = filters.apply(WebhookEvent.select())
    if filters.status == inbox.WAITING:
        return found.count()
    return found.where(operator.awaiting_an_operator(filters.status)).count()


def cursor_of(event: WebhookEvent) -> str:
    return f"{event.received_at.isoformat()}~{event.id}"


def parse_cursor(text: str) -> tuple[datetime.datetime, int]:
    try:
        received_at, event_id = text.split("~")
        return operator.parse_time(received_at), int(event_id)
    except ValueError:
        raise BadCursor(f"not a page cursor: {text[:40]!r}") from None


def shown_payload(event: WebhookEvent | Outbox) -> str:
    """The payload pretty-printed, with the value of every key that names a credential
    hidden; a body that is not JSON is shown as it came. One nested deeper than Python
    follows (a hostile sender's 100,000 brackets) is shown as it came too, the plain
    values of credential keys hidden in its text."""
    try:
        return json.dumps(_hide_secrets(json.loads(event.payload)), indent=2,
                          sort_keys=True, ensure_ascii=False)
    except ValueError:
        return event.payload
    except RecursionError:
        return SECRET_IN_TEXT.sub(_hidden_in_text, event.payload)


def _hidden_in_text(match: re.Match[str]) -> str:
    key = match.group("key")
    return f'{key}: "{HIDDEN}"' if SECRET_KEY.search(key) else match.group(0)


def _hide_secrets(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: HIDDEN if SECRET_KEY.search(str(key)) else _hide_secrets(item)
                for key, item in value.items()}
    if isinstance(value, list):
        return [_hide_secrets(item) for item in value]
    return value


# Effects: what each one is, what was sent, every attempt.

def effect_name(ctx: ConsoleContext, row: Outbox) -> str:
    """What an effect is, in the operator's words: `Frappe: Start Name Check on ORD-1`,
    `worker job name_search`, `alert to Telegram`, `mail to admin: Payment failed`."""
    try:
        payload = json.loads(row.payload)
    except ValueError:
        return row.kind
    if row.kind == "workflow_action":
        return f"Frappe: {payload.get('action')} on {payload.get('name')}"
    if row.kind == "job":
        return f"worker job {payload.get('action')}"
    if row.kind == "alert":
        return "alert to Telegram"
    if row.kind == "email":
        to = payload.get("to") or []
        whom = "admin" if ctx.settings.admin_email and to == [ctx.settings.admin_email] \
            else ", ".join(to)
        return f"mail to {whom}: {payload.get('subject')}"
    return row.kind


@dataclasses.dataclass
class SentRequest:
    """An effect's request as its client sends it, credentials hidden."""
    method: str
    url: str
    headers: dict
    body: str


def request_as_sent(ctx: ConsoleContext, row: Outbox) -> SentRequest:
    """The request `row` makes (each client builds it the same way when it sends), with
    the credentials hidden: Frappe's Authorization header, the bot token in Telegram's
    URL, the SMTP password (never part of what is shown here). A payload that cannot be
    read as its kind's request is shown as stored."""
    try:
        return _request_of(ctx, row, json.loads(row.payload))
    except (ValueError, KeyError, TypeError, AttributeError):
        return SentRequest("", "(the stored payload: it does not read as a request)", {},
                           shown_payload(row))


def _request_of(ctx: ConsoleContext, row: Outbox, payload: Any) -> SentRequest:
    if row.kind == "email":
        return SentRequest("SMTP", _smtp_server(ctx.settings.smtp_url),
                           {"From": ctx.settings.mail_from, "To": ", ".join(payload["to"]),
                            "Subject": payload["subject"]}, payload["text"])
    if row.kind == "job":
        request = ctx.worker.request(payload["action"], payload["payload"],
                                     row.idempotency_key)
    elif row.kind == "workflow_action":
        request = ctx.workflow.apply_request(outbox.action_doctype(ctx.settings, payload),
                                             payload["name"], payload["action"])
    else:
        request = ctx.telegram.request(payload["text"])
    url = request.url
    token = ctx.settings.telegram_bot_token
    if token:
        url = url.replace(token, HIDDEN)
    headers = {name: HIDDEN if SECRET_KEY.search(name) else value
               for name, value in {**JSON_HEADERS, **request.headers}.items()}
    body = json.dumps(_hide_secrets(request.body), indent=2, sort_keys=True,
                      ensure_ascii=False)
    return SentRequest("POST", url, headers, body)


def _smtp_server(url: str | None) -> str:
    """The SMTP URL without its user and password."""
    if not url:
        return "(SMTP_URL unset)"
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def attempts_of(row_ids: list[int]) -> dict[int, list[Attempt]]:
    """{outbox id: [Attempt, oldest first]} on the (outbox_id, id) index."""
    found: dict[int, list[Attempt]] = {row_id: [] for row_id in row_ids}
    if row_ids:
        for attempt in (Attempt.select().where(Attempt.outbox_id.in_(list(row_ids)))
                        .order_by(Attempt.outbox_id, Attempt.id)):
            found[attempt.outbox_id].append(attempt)
    return found


def retries_of(row_ids: list[int]) -> dict[int, list[ConsoleAction]]:
    """{outbox id: [ConsoleAction]}: the retries and give-ups operators made of these
    rows, from the console or the command line."""
    found: dict[int, list[ConsoleAction]] = {row_id: [] for row_id in row_ids}
    if row_ids:
        for action in (ConsoleAction.select()
                       .where(ConsoleAction.action.in_(EFFECT_ACTIONS),
                              ConsoleAction.target.in_([str(i) for i in row_ids]))
                       .order_by(ConsoleAction.id)):
            found[int(action.target)].append(action)
    return found


def attempt_summary(attempt: Attempt) -> str:
    """`HTTP 503 in 120 ms, will retry: <error>`, as one line; without an HTTP answer, what
    came instead (`connection refused in 2 ms, will retry: <error>`)."""
    said = (f"HTTP {attempt.status_code}" if attempt.status_code
            else without_an_answer(attempt.error))
    took = f" in {attempt.duration_ms} ms" if attempt.duration_ms is not None else ""
    outcome = ATTEMPT_OUTCOMES.get(attempt.outcome, attempt.outcome)
    error = f": {attempt.error}" if attempt.error and not attempt.status_code else ""
    return f"{said}{took}, {outcome}{error}"


def without_an_answer(error: str | None) -> str:
    """What an attempt met that no HTTP answer came to, in words, from its error's text
    (clients.http.describe): a refused connection is no silence, and the operator fixing
    it looks elsewhere (the peer is down) than for a timeout (the peer is slow)."""
    text = (error or "").lower()
    for words, said in WITHOUT_AN_ANSWER:
        if any(word in text for word in words):
            return said
    return "failed"


WITHOUT_AN_ANSWER = (
    (("connection refused",), "connection refused"),
    (("in time", "timeout"), "no answer in time"),
    (("name or service not known", "nodename", "getaddrinfo", "name resolution"),
     "address not found"),
    (("disconnected", "reset by peer"), "connection closed without an answer"),
)
ATTEMPT_OUTCOMES = {"sent": "sent", "pending": "will retry", "dead": "given up",
                    "logged": "logged, not sent", "waiting": "waits for its configuration"}
EFFECT_ACTIONS = ("retry effect", "give up effect")


def waits_for(ctx: ConsoleContext, row: Outbox) -> str | None:
    """What an unsent effect waits for, and so what comes next for it, in words; None
    once it is final."""
    if row.status == "waiting":
        return f"waits for its destination to be configured: {row.last_error}"
    if row.status == "logged":
        return f"logged, not sent (final): {row.last_error}"
    if row.status != "pending":
        return None
    now = ctx.clock()
    if row.next_attempt_at > now + lease(ctx):
        return f"next try {operator.format_time(row.next_attempt_at)} UTC"
    if row.next_attempt_at > now:
        return (f"on its way out, or its next try by "
                f"{operator.format_time(row.next_attempt_at)} UTC")
    earlier = _earlier_unsent(row)
    if earlier is not None:
        return (f"due now, after effect #{earlier.id} of its order ({earlier.status}): it "
                "goes once that one is sent or given up")
    destination = ctx.destinations.of(row.kind)
    if destination.configured and not destination.up:
        return (f"due now; {destination.name} is {destination.state}: it goes once a probe "
                f"finds it back (the next at {operator.format_time(destination.probe_at)} "
                "UTC)")
    return (f"due now: the scheduler sends it at its next run (every "
            f"{ctx.settings.scheduler_tick_seconds} s)")


def _earlier_unsent(row: Outbox) -> Outbox | None:
    """The earliest unsent effect of the same order that `row` goes out after, if any
    (the worker's jobs and the workflow's actions keep each order's order)."""
    if row.order_number is None or row.kind not in ORDERED_KINDS:
        return None
    return (Outbox.select().where(Outbox.order_number == row.order_number,
                                  Outbox.kind == row.kind, Outbox.status.in_(outbox.UNSENT),
                                  Outbox.id < row.id)
            .order_by(Outbox.id).first())


def after_retry(ctx: ConsoleContext, row: Outbox, asked_at: datetime.datetime) -> str:
    """What a retry of one effect did (`row` as it stands after it; `asked_at`: when it
    was asked for) and what comes next, in a sentence."""
    name = f"Effect #{row.id} ({effect_name(ctx, row)})"
    tried_now = row.last_attempt_at is not None and row.last_attempt_at >= asked_at
    if row.status == "sent":
        return f"{name} sent at {operator.format_time(row.sent_at)} UTC."
    if row.status == "dead":
        return (f"{name} tried now and refused for good: {row.last_error}. It is dead "
                "again: mend the cause, then retry it.")
    if row.status == "waiting":
        return f"{name} not sent: it {waits_for(ctx, row)}; it goes once the setting is there."
    if row.status == "pending" and tried_now:
        return (f"{name} tried now: {row.last_error}. It stays in line and is tried again "
                f"by itself, next at {operator.format_time(row.next_attempt_at)} UTC.")
    return f"{name} back in line, {waits_for(ctx, row)}."


def give_up(ctx: ConsoleContext, row_id: int, who: str, reason: str = "") -> Outbox:
    """Mark a pending or waiting effect dead: it is not sent unless retried. Returns the
    row; NotFound, or Refused for one sent, logged or dead already, or on its way out."""
    row = Outbox.get_or_none(Outbox.id == row_id)
    if row is None:
        raise operator.NotFound(f"no outbox row #{row_id}")
    if row.status not in ("pending", "waiting"):
        raise operator.Refused(f"effect #{row_id} is {row.status} already")
    now = ctx.clock()
    given_up = f"given up by {who}" + (f": {reason}" if reason else "")
    if not (Outbox.update(status="dead", last_error=given_up, updated_at=now)
            .where(Outbox.id == row_id, Outbox.status.in_(("pending", "waiting")),
                   operator.not_in_flight(ctx, Outbox)).execute()):
        raise operator.in_flight_refusal(ctx, row)
    return Outbox.get_by_id(row_id)


@dataclasses.dataclass
class EffectPage:
    row: Outbox
    name: str
    destination: str
    request: SentRequest
    attempts: list
    actions: list
    # What it waits for; None once it is final.
    waits_for: str | None


def effect_page(ctx: ConsoleContext, row_id: int) -> EffectPage:
    row = Outbox.get_or_none(Outbox.id == row_id)
    if row is None:
        raise operator.NotFound(f"no outbox row #{row_id}")
    return EffectPage(row, effect_name(ctx, row), operator.destination_of(row),
                      request_as_sent(ctx, row), attempts_of([row_id])[row_id],
                      retries_of([row_id])[row_id], waits_for(ctx, row))


# One order's timeline.

@dataclasses.dataclass
class Moment:
    at: datetime.datetime
    what: str
    detail: str = ""
    event_id: int | None = None
    outbox_id: int | None = None
    # Lines shown under this one: an effect's attempts, retries and what it waits for.
    under: list = dataclasses.field(default_factory=list)


def timeline(ctx: ConsoleContext, order_number: str) -> tuple[OrderBase | None, list[Moment]]:
    """(order or None, moments in time order): events from every source, effects sent or
    waiting, payment, settlement, holdback, reminders, link clicks, survey."""
    order = orders.find_any_kind(Transaction(ctx), order_number)
    moments = [*_event_moments(order_number), *_effect_moments(ctx, order_number),
               *_money_moments(order_number), *_click_moments(order_number)]
    if order is not None:
        moments += _order_moments(ctx, order)
    # At the same instant a cause comes before the effects it caused.
    moments.sort(key=lambda moment: (moment.at, moment.outbox_id is not None,
                                     moment.event_id or 0, moment.outbox_id or 0))
    return order, moments


def _event_moments(order_number: str) -> Iterator[Moment]:
    events = operator.note_holds(list(
        WebhookEvent.select().where(WebhookEvent.order_number == order_number)))
    for event in events:
        detail = f"{event.status}, {event.attempts} attempt(s)"
        if event.held:
            detail = f"{event.held}; {detail}"
        if event.last_error:
            detail += f": {event.last_error}"
        under = []
        if event.given_up_at:
            under.append(Moment(event.given_up_at, f"given up by {event.given_up_by}",
                                event.given_up_reason or "", event_id=event.id))
        yield Moment(event.received_at, f"{event.source} event {event.event_type}",
                     detail, event_id=event.id, under=under)


def _effect_moments(ctx: ConsoleContext, order_number: str) -> Iterator[Moment]:
    """One moment per effect, when it was caused, with its attempts, the operators'
    retries and what it still waits for under it, in time order."""
    rows = list(Outbox.select().where(Outbox.order_number == order_number))
    ids = [row.id for row in rows]
    attempts, actions = attempts_of(ids), retries_of(ids)
    for row in rows:
        cause = f"caused by event #{row.event_id}; " if row.event_id else ""
        # An operator's retry bears the time it was asked for, before the attempt it
        # made; at the same instant it comes first (the sort keeps the order of equals).
        under = [Moment(action.created_at, f"{action.action} by {action.operator}",
                        action.outcome, outbox_id=row.id) for action in actions[row.id]]
        under += [Moment(attempt.attempted_at, f"attempt {number}",
                         attempt_summary(attempt), outbox_id=row.id)
                  for number, attempt in enumerate(attempts[row.id], 1)]
        under.sort(key=lambda moment: moment.at)
        waiting = waits_for(ctx, row)
        if waiting:
            under.append(Moment(row.updated_at, "now", waiting, outbox_id=row.id))
        elif row.status == "dead":
            under.append(Moment(row.updated_at, "now dead", row.last_error or "",
                                outbox_id=row.id))
        yield Moment(row.created_at, effect_name(ctx, row), f"{cause}now {row.status}",
                     outbox_id=row.id, under=under)


def _money_moments(order_number: str) -> Iterator[Moment]:
    for job in TreasuryJob.select().where(TreasuryJob.order_id == order_number):
        yield Moment(job.received_at, "treasury job", f"{job.amount_coin} {job.coin} "
                     f"({money(job.amount_fiat_cents, job.fiat_currency)}), "
                     f"{job.state}")
    for entry in LedgerEntry.select().where(LedgerEntry.order_id == order_number):
        yield Moment(entry.acquired_at, "ledger entry",
                     f"{entry.movement_type} {entry.amount_coin} {entry.coin} via "
                     f"{entry.provider} ({entry.provider_status})")


@dataclasses.dataclass
class Amounts:
    """What an order's page shows of its money, as text with its currency: what its
    payment received, and (a CRTC order) what it was ordered for."""
    paid: str | None
    total: str | None


def order_amounts(order: OrderBase) -> Amounts:
    total = getattr(order, "total_cents", None)
    return Amounts(orders.paid_amount(order),
                   None if total is None else money(total, getattr(order, "currency", None)))


# The longest value of a change the timeline shows whole (a note's text is longer).
SHOWN_VALUE = 80


def first_values(order: OrderBase, history: list[OrderChange]) -> dict[str, Any]:
    """The order's columns as it was created, as JSON values: those its history's creation
    row keeps; for an order created before its history was kept (or by the shop's own
    INSERT), its columns now with each recorded change undone."""
    created = next((row for row in history if row.field == CREATED), None)
    if created is not None:
        kept: dict[str, Any] = json.loads(created.new_value or "{}")
        return kept
    values = {}
    for row in reversed(history):
        values[row.field] = json.loads(row.old_value or "null")
    names = [field.name for field in type(order)._meta.sorted_fields]
    return {name: values[name] if name in values
            else json.loads(history_value(getattr(order, name))) for name in names}


def _as_created(values: dict[str, Any]) -> str:
    """The order as it was created (`first_values`): who, for what, how much; not what it
    became (its changes, payment and later states have moments of their own)."""
    parts = [part for part in (values.get("customer_name"), values.get("customer_email")
                               and f"<{values['customer_email']}>",
                               values.get("service_name")) if part]
    for name in ("total_cents", "amb_annual_price_cents"):
        if values.get(name) is not None:
            parts.append(("" if name == "total_cents" else "AMB annual ")
                         + money(values[name], values.get("currency")))
    return ", ".join(parts)


def _value_shown(text: str | None) -> str:
    """A value of a change (JSON text) as the timeline shows it."""
    value = json.loads(text or "null")
    shown = "(none)" if value is None else value if isinstance(value, str) else json.dumps(value)
    return shown if len(shown) <= SHOWN_VALUE else shown[:SHOWN_VALUE - 3] + "..."


def _change_moments(history: list[OrderChange]) -> Iterator[Moment]:
    """One moment per change of the order (the fields one call changed together): who
    changed it, the fields' names, and under it a line per field with its old and new
    value."""
    changes = [row for row in history if row.field != CREATED]
    for (at, by, event_id), grouped in itertools.groupby(
            changes, key=lambda row: (row.changed_at, row.changed_by, row.event_id)):
        rows = list(grouped)
        yield Moment(at, f"order changed by {by}", ", ".join(row.field for row in rows),
                     event_id=event_id, under=[
                         Moment(at, row.field, f"{_value_shown(row.old_value)} -> "
                                               f"{_value_shown(row.new_value)}")
                         for row in rows])


def _click_moments(order_number: str) -> Iterator[Moment]:
    for filing in SelfFiling.select().where(SelfFiling.order_number == order_number):
        yield Moment(filing.self_filed_at, f"{filing.kind.upper()} link clicked",
                     f"already filed {filing.cycle}")
    for survey in SurveyResponse.select().where(SurveyResponse.order_number == order_number):
        yield Moment(survey.created_at, "survey answered", f"rating {survey.rating}")


def _order_moments(ctx: ConsoleContext, order: OrderBase) -> Iterator[Moment]:
    history = list(OrderChange.select().where(OrderChange.order_number == order.order_number,
                                              OrderChange.kind == order.kind)
                   .order_by(OrderChange.changed_at, OrderChange.id))
    created = next((row for row in history if row.field == CREATED), None)
    yield Moment(order.created_at, f"{order.kind} order created"
                 + (f" by {created.changed_by}" if created else ""),
                 _as_created(first_values(order, history)))
    yield from _change_moments(history)
    if order.paid_at:
        yield Moment(order.paid_at, "paid", getattr(order, "payment_method", None) or "")
    for column, what in ORDER_TIMES.get(order.kind or "", ()):
        value = getattr(order, column)
        if value:
            yield Moment(value, what, _order_detail(ctx, order, column))


ORDER_TIMES = {
    "canada_crtc": (("funds_available_at", "funds settled"),
                    ("delivered_at", "delivered; commission holdback starts"),
                    ("holdback_ends_at", "holdback ends"),
                    ("commission_released_at", "commission released"),
                    ("commission_forfeited_at", "commission forfeited")),
    "compliance": (("intake_reminded_at", "last intake reminder"),
                   ("cancelled_at", "subscription cancelled")),
}


def _order_detail(ctx: ConsoleContext, order: Any, column: str) -> str:
    """What goes beside `column`'s time: `order` is of the kind ORDER_TIMES names the
    column for (a CRTC or a compliance order), whose own columns are read."""
    if column == "commission_forfeited_at":
        return order.commission_forfeit_reason or ""
    if column == "intake_reminded_at":
        return f"{order.intake_reminders_sent} reminder(s) sent"
    if column == "holdback_ends_at" and order.holdback_ends_at > ctx.clock():
        return "not yet"
    return ""


# The outbox.

def outbox_counts() -> dict[tuple[str, str], int]:
    """{(destination, status): count} of the rows still to go out or given up on (the
    sent and logged rows, most of the table, are counted by no page): one range of the
    (kind, status, id) index counted per destination and status. A GROUP BY over the
    statuses was answered by scanning the whole index (SQLite: 191 ms at 1M rows)."""
    counts: dict[tuple[str, str], int] = {}
    for destination in operator.DESTINATIONS:
        for status in COUNTED_OUTBOX_STATUSES:
            count = Outbox.select().where(Outbox.kind == operator.KIND_OF[destination],
                                          Outbox.status == status).count()
            if count:
                counts[destination, status] = count
    return counts


def waiting_for_a_later_try(ctx: ConsoleContext, destination: str) -> peewee.Expression:
    """The pending effects of `destination` that wait for a later try (a backoff) and
    no send holds (operator.not_in_flight): what `make_due_now` makes due."""
    return ((Outbox.status == "pending") & (Outbox.kind == operator.KIND_OF[destination])
            & (Outbox.next_attempt_at > ctx.clock()) & operator.not_in_flight(ctx, Outbox))


def later_tries(ctx: ConsoleContext) -> dict[str, int]:
    """{destination: how many of its effects wait for a later try}, for the destinations
    that have any: one range of the (status, next_attempt_at) index each."""
    counts = {destination: Outbox.select().where(waiting_for_a_later_try(ctx, destination))
              .count() for destination in operator.DESTINATIONS}
    return {destination: count for destination, count in counts.items() if count}


def outbox_page(status: str, destination: str = "", before: int | None = None,
                limit: int = PAGE_SIZE) -> Page:
    """Rows of one status (and destination), newest first, on the (status, id) and
    (kind, status, id) indexes; `before` is the id the previous page ended at."""
    query = Outbox.select().where(Outbox.status == status)
    if destination:
        query = query.where(Outbox.kind == operator.KIND_OF[destination])
    if before:
        query = query.where(Outbox.id < before)
    rows = list(query.order_by(Outbox.id.desc()).limit(limit + 1))
    return Page(rows[:limit], rows[limit - 1].id if len(rows) > limit else None)


async def retry_now(ctx: ConsoleContext, row_id: int) -> Outbox:
    """Put one effect back in line (as `outbox retry` does) and send it now, unless an
    earlier effect of its order is still waiting, or its destination is down (then the
    scheduler sends it after that one, or once a probe finds it back). Returns the row as
    it then stands (`after_retry` says what that means)."""
    await ctx.db(functools.partial(operator.retry_outbox, ctx, row_id))
    due = ((Outbox.id == row_id) & (Outbox.status == "pending")
           & (Outbox.next_attempt_at <= ctx.clock()))
    rows = await claim(ctx, Outbox, due)
    await outbox.deliver(ctx, rows)
    return await ctx.db(functools.partial(Outbox.get_by_id, row_id))


def retry_dead(ctx: ConsoleContext, destination: str, retried_by: tuple[str, str]) -> int:
    """Every dead effect of one destination back in line, due now, each with its retry on
    its timeline (`retried_by`: operator, address); returns how many."""
    return operator.retry_all(ctx, "dead", retried_by, destination)


def make_due_now(ctx: ConsoleContext, destination: str) -> int:
    """The effects of one destination that wait for a later try (a backoff) become due
    now, their attempts counted on; returns how many. A row on its way out is left as it
    is (`operator.not_in_flight`). Effects waiting for their destination's settings are
    not among them: they go once the service starts with the setting."""
    now = ctx.clock()
    return (Outbox.update(next_attempt_at=now, updated_at=now)
            .where(waiting_for_a_later_try(ctx, destination)).execute())


# Settlement and holdbacks.

@dataclasses.dataclass
class Awaiting:
    order: CrtcOrder
    business_days: int
    needed: int
    due_on: datetime.date


def settlement_queue(ctx: ConsoleContext) -> list[Awaiting]:
    """CRTC orders paid and awaiting their funds: business days elapsed and the day each
    becomes due (the settlement runs advance it on or after that day)."""
    today = ctx.clock().astimezone(ctx.business_tz).date()
    queue: list[Awaiting] = []
    for order in settlement.waiting_orders(Transaction(ctx)):
        paid_on = order.paid_at.astimezone(ctx.business_tz).date()
        needed = settlement.BUSINESS_DAYS_TO_SETTLE[order.payment_method or ""]
        queue.append(Awaiting(order, settlement.business_days_after(paid_on, today), needed,
                              business_day_after(paid_on, needed)))
    return queue


def business_day_after(start: datetime.date, days: int) -> datetime.date:
    """The date on which `days` business days have passed since `start`."""
    day = start
    while settlement.business_days_after(start, day) < days:
        day += DAY
    return day


def holdback_orders() -> "peewee.ModelSelect[CrtcOrder]":
    return (CrtcOrder.select().where(CrtcOrder.delivered_at.is_null(False))
            .order_by(CrtcOrder.holdback_ends_at, CrtcOrder.id))
