"""Reconciliation with the workflow system (Frappe): the state changes whose webhook never
came, found in Frappe's own record of them and handled as if it had come, each once, in
the order they were made.

Frappe v15 tries a webhook three times within about 5 s and then never again, so an
outage of the service longer than that loses the state change. Each run lists, through
Frappe's REST list API, the documents of each doctype modified since the last run (with
an overlap), reads each one's workflow log (the Comments of type Workflow that every
workflow action writes: the state it led to, and when; `WorkflowClient.workflow_log`),
and hands every entry for a state with a webhook path (WORKFLOW_RECONCILE_STATES) to the
inbox, oldest first: the same body fields, the same plugin, the same effects, the event
marked `reconciled`. A state the document has already left is handled as its path says
(`WorkflowWebhook.when_left`: as the webhook would have been, or recorded and told).

A state change is one fact whoever reports it: the document, the state, and the save
that entered it. A webhook names that save by the document's `modified` (`change_key`);
the workflow log by its comment (`entered_key`), written in the same request just after
the save, so the save's `modified` lies between the comment before it and its own
(`entered_after` < modified <= `entered_at`). Either finding is recognised as the other
(`same_stay`) in the transaction that would store it, and is then a duplicate: one event
is handled, and its effects' keys (the worker's Idempotency-Key, the action's) derive
from it. Each change is placed among its document's by its save (`document_version`), and
the inbox hands a document's changes over in that order whichever finder brought them;
one older than a change already handled is history: recorded, never handled
(plugins.workflow.WorkflowWebhook).

Frappe writes its times as naive text in its System Settings' time zone, which the
service reads from Frappe (`site_zone`); a list that finds nothing while Frappe's newest
`modified` moved on says so (the window and Frappe's times do not meet).

A run waits on the database for WORKFLOW_RECONCILE_DATABASE_SECONDS in all at most
(`Transaction.database_allowance`): a slow database stops it between two units, each entry
stored and handled whole or not at all, and the doctype's cursor left where the last
finished run put it, so the next run looks at that span again (what was done is found
stored). It is not taken for the database being down.
"""
import asyncio
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import zoneinfo
from typing import Any, Callable, Iterable, Iterator, Optional, cast

from clients.http import Result
from clients.workflow import FRAPPE_DEFAULT_TIME_ZONE
from models import UTC, ReconcileRun, WebhookEvent
from settings import Settings
from engine import inbox
from engine.contracts import EngineContext
from engine.errors import DatabaseDown
from engine.transaction import DatabaseTimeSpent, Transaction

log = logging.getLogger("receiver.reconcile")

SOURCE = "workflow"
PAGE_SIZE = 100
# Documents looked at per doctype and run; the next run goes on from the last one.
MAX_DOCUMENTS_PER_RUN = 500
# Each run looks again at the last minutes of the one before: a change whose saving
# Frappe committed after the earlier run had listed is still found.
OVERLAP = datetime.timedelta(minutes=10)
# The first run of a doctype looks this far back.
FIRST_LOOKBACK = datetime.timedelta(hours=24)
# Frappe's first try of a webhook reaches us 0.3 to 2.3 s after its save, its second
# about 1.2 s after the first: a webhook older than this is a later try or one Frappe's
# queue held, and its document may have moved on since (`predecessors_first`).
LATE_AFTER = datetime.timedelta(seconds=5)
# Frappe writes `modified` as naive text in its system time zone.
FRAPPE_TIME = "%Y-%m-%d %H:%M:%S.%f"
# Paths grouped by the doctype their webhooks come from (settings.RECONCILED_PATH_PREFIXES).
GROUPS = {"formation/": "workflow_doctype", "crtc/": "crtc_doctype"}
# The events of one order and path looked at to recognise a state change: more than one
# order goes through one state in the life of an order.
STAYS_LOOKED_AT = 50
# A document modified this far ahead of our clock says our times and Frappe's differ.
AHEAD_TOLERANCE = datetime.timedelta(minutes=5)


@dataclasses.dataclass
class Counts:
    listed: int = 0
    handled: int = 0
    already: int = 0
    unusable: int = 0
    # State changes recorded and not handled (left before they were handled, or older
    # than one handled), the administrator told.
    recorded: int = 0
    # State changes stored and waiting behind an earlier call of their order that is not
    # finished: handled in that order's turn (engine.inbox).
    held: int = 0
    failed: list[str] = dataclasses.field(default_factory=list)  # doctypes Frappe did not list
    # The run spent WORKFLOW_RECONCILE_DATABASE_SECONDS and stopped before its end.
    stopped: bool = False
    # Doctypes whose documents changed in Frappe while the run's window found none.
    quiet: list[str] = dataclasses.field(default_factory=list)


# Whether this process's last run stopped at its allowance: said when runs start
# stopping, and when one finishes again, not at every run.
_stopping = False


def canonical_modified(text: object) -> str | None:
    """Frappe's `modified` as one text however it was written ("... 09:00:12" and
    "... 09:00:12.000000" are one time); None when it is not a time."""
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    return moment.isoformat(sep=" ", timespec="microseconds")


def change_key(path: str, name: str, modified: object) -> str | None:
    """The inbox key of one state change as a webhook names it: its path, the document's
    name and its `modified` at the change (hashed: a name may be long). None without a
    `modified`."""
    moment = canonical_modified(modified)
    if moment is None:
        return None
    digest = hashlib.sha256(f"{name}\n{moment}".encode()).hexdigest()[:40]
    return f"{path}:change:{digest}"


def entered_key(path: str, name: str, entry: str) -> str:
    """The inbox key of one state change as Frappe's workflow log names it: the path, the
    document and the log's entry (its comment's name; for a state entered without a
    workflow action, what came before it: `since <time>`)."""
    digest = hashlib.sha256(f"{name}\n{entry}".encode()).hexdigest()[:40]
    return f"{path}:entered:{digest}"


def _stay(body: dict[str, Any]) -> tuple[str, str] | None:
    """(after, at]: the span of Frappe's local times in which the save that entered the
    body's state was made: a webhook's `modified` exactly ((modified, modified] read as
    the point), a log entry's from the entry before it to its own. None when the body
    says neither."""
    at = canonical_modified(body.get("modified"))
    if at is not None:
        return at, at
    at = canonical_modified(body.get("entered_at"))
    if at is None:
        return None
    return canonical_modified(body.get("entered_after")) or "", at


def _same(ours: tuple[str, str], theirs: tuple[str, str]) -> bool:
    """Two findings of one save: a point (a webhook's `modified`) inside the other's span,
    or the same span."""
    if ours == theirs:
        return True
    (after, at), (other_after, other_at) = sorted((ours, theirs),
                                                   key=lambda span: span[0] == span[1])
    if other_after == other_at:  # a point against a span
        return after < other_at <= at
    return False


def _later(ours: tuple[str, str], theirs: tuple[str, str]) -> bool:
    """Whether the save `theirs` spans surely came after the one `ours` does."""
    their_after, their_at = theirs
    our_after, our_at = ours
    if their_after == their_at:  # a point: after all of ours
        return their_at > our_at
    return their_after >= our_at


def _stays_of(events: Iterable[WebhookEvent],
              order_name: str) -> Iterator[tuple[WebhookEvent, tuple[str, str]]]:
    for event in events:
        try:
            stored = json.loads(event.payload)
        except ValueError:
            continue
        if isinstance(stored, dict) and stored.get("order_name") == order_name:
            span = _stay(stored)
            if span is not None:
                yield event, span


def same_stay(tx: Transaction, path: str, order_name: str, order_number: str,
              body: dict[str, Any]) -> list[WebhookEvent]:
    """The stored events that found this same state change (the same save entering the
    state), newest first, whichever key each was stored under: a webhook's and a log
    entry's. Run in the storing's transaction and in the handling's (engine.inbox's
    `_found_otherwise`, `_copy_handled`): one indexed read."""
    ours = _stay(body)
    if ours is None:
        return []
    events = tx.newest_events_of_type(SOURCE, order_number, path, STAYS_LOOKED_AT)
    return [event for event, span in _stays_of(events, order_name) if _same(ours, span)]


def document_version(body: dict[str, Any]) -> str | None:
    """A change's place among its document's changes (its Placement's version): the save's
    `modified` a webhook names, or when the workflow log entry of a change found by a run
    was written (just after its save, before the next one). None when the body says
    neither."""
    return canonical_modified(body.get("modified")) or canonical_modified(body.get("entered_at"))


def site_zone(ctx: EngineContext) -> zoneinfo.ZoneInfo:
    """The time zone Frappe writes its times in: its System Settings' as Frappe last said
    it (clients.workflow.WorkflowClient.read_time_zone), else WORKFLOW_TIME_ZONE, else
    what v15 uses when System Settings name none."""
    return zoneinfo.ZoneInfo(ctx.workflow.time_zone or ctx.settings.workflow_time_zone
                             or FRAPPE_DEFAULT_TIME_ZONE)


def doctype_states(settings: Settings) -> dict[str, dict[str, str]]:
    """{doctype: {Frappe state: path}} of the configured states."""
    found: dict[str, dict[str, str]] = {}
    for path, state in settings.workflow_reconcile_states:
        for prefix, attribute in GROUPS.items():
            if path.startswith(prefix):
                found.setdefault(getattr(settings, attribute), {})[state] = path
    return found


def frappe_time(moment: datetime.datetime, zone: zoneinfo.ZoneInfo) -> str:
    """`moment` as Frappe writes its times: naive text in its time zone."""
    return moment.astimezone(zone).strftime(FRAPPE_TIME)


def from_frappe_time(text: str, zone: zoneinfo.ZoneInfo) -> datetime.datetime:
    """A time Frappe wrote (naive, in `zone`) as an aware UTC one."""
    return datetime.datetime.fromisoformat(text).replace(tzinfo=zone).astimezone(UTC)


async def reconcile_workflow(
        ctx: EngineContext, since: datetime.datetime | None = None,
        progress: Optional[Callable[[int, Optional[int]], None]] = None) -> Counts:
    """One run over every configured doctype; `since` (aware) instead of where the last
    run got to. Frappe not answering, or refusing, is logged once (when it starts) and
    recorded; the next run tries again from the same place. `progress(looked at, None)`
    after each document (how many there are is not known before the last page)."""
    global _stopping
    counts = Counts()
    if not ctx.settings.workflow_url:
        return counts
    tx = Transaction(ctx)
    if ctx.workflow.time_zone is None:
        # Frappe's times are read in its own time zone: without it a run would look at
        # the wrong hours and find nothing, saying nothing.
        zone = await ctx.workflow.read_time_zone()
        if not zone.ok:
            for doctype in doctype_states(ctx.settings):
                run = await ctx.db(functools.partial(tx.reconcile_run, doctype))
                await _record_failure(ctx, tx, doctype, run,
                                      f"Frappe's time zone could not be read: {zone.error}")
                counts.failed.append(doctype)
            return counts
    seconds = ctx.settings.workflow_reconcile_database_seconds
    try:
        with tx.database_allowance(seconds):
            for doctype, states in doctype_states(ctx.settings).items():
                await _reconcile_doctype(ctx, tx, doctype, states, since, counts, progress)
    except DatabaseTimeSpent:
        counts.stopped = True
        if not _stopping:
            log.warning("reconciliation stopped after %d document(s): it waited on the "
                        "database for WORKFLOW_RECONCILE_DATABASE_SECONDS (%g s); the next "
                        "run goes on from where the last finished one left off",
                        counts.listed, seconds)
        _stopping = True
        return counts
    if _stopping:
        log.info("reconciliation finished within WORKFLOW_RECONCILE_DATABASE_SECONDS again")
    _stopping = False
    return counts


@dataclasses.dataclass
class _Window:
    """What one run of one doctype looks at: log entries made after `lower` and up to
    `upper` (Frappe's local times, canonical text), younger ones left to their webhook;
    documents listed from `start` (`lower` as asked of Frappe)."""
    lower: str
    upper: str
    states: dict[str, str]
    start: str


@dataclasses.dataclass
class _Seen:
    """What one run of one doctype looked at: how many documents, the last one's name
    and `modified` (as Frappe wrote it); `unread`, why it stopped short when Frappe did
    not list the documents or show one's log."""
    looked_at: int = 0
    last_modified: object = None
    last_name: object = None
    unread: str | None = None


async def _reconcile_doctype(ctx: EngineContext, tx: Transaction, doctype: str,
                             states: dict[str, str], since: datetime.datetime | None,
                             counts: Counts,
                             progress: Optional[Callable[[int, Optional[int]], None]]
                             ) -> None:
    """Handle the doctype's state changes made since its last run (or `since`), and
    record where the next run starts, or why this one failed."""
    zone = site_zone(ctx)
    now = ctx.clock()
    run = await ctx.db(functools.partial(tx.reconcile_run, doctype))
    window = _window_of(ctx, run, states, since, zone, now)
    seen = await _look_at_documents(ctx, tx, doctype, window, counts, progress)
    if seen.unread is not None:
        await _record_failure(ctx, tx, doctype, run, seen.unread)
        counts.failed.append(doctype)
        return
    cursor = _next_cursor(run, window, seen, since, zone)
    quiet = await _window_problem(ctx, doctype, run, window, seen, zone, now)
    if quiet:
        counts.quiet.append(doctype)
    newest = seen.last_modified if seen.looked_at else (run.newest_seen if run else None)
    await ctx.db(lambda: tx.record_reconcile_success(
        doctype, cursor, quiet, canonical_modified(newest), ctx.clock()))
    if run is not None and run.last_error and not quiet:
        log.info("reconciliation: Frappe lists %s again", doctype)


def _window_of(ctx: EngineContext, run: ReconcileRun | None, states: dict[str, str],
               since: datetime.datetime | None, zone: zoneinfo.ZoneInfo,
               now: datetime.datetime) -> _Window:
    """From `since`, else where the last run got to, else FIRST_LOOKBACK ago; up to the
    settle time ago (younger changes are left to their webhook)."""
    if since is not None:
        lower = frappe_time(since, zone)
    elif run is not None and run.cursor:
        lower = run.cursor
    else:
        lower = frappe_time(now - FIRST_LOOKBACK, zone)
    upper = frappe_time(now - datetime.timedelta(
        seconds=ctx.settings.workflow_reconcile_settle_seconds), zone)
    return _Window(canonical_modified(lower) or lower, canonical_modified(upper) or upper,
                   states, lower)


def _fields_listed(ctx: EngineContext, states: dict[str, str]) -> list[str]:
    """The document fields a list asks for: those the paths' webhooks send."""
    registry = ctx.plugins[SOURCE]
    return sorted({"name", "modified", "workflow_state"} | {
        field for path in states.values() for field in registry.get(path).fields
        if field != "order_name"})


async def _look_at_documents(ctx: EngineContext, tx: Transaction, doctype: str,
                             window: _Window, counts: Counts,
                             progress: Optional[Callable[[int, Optional[int]], None]]
                             ) -> _Seen:
    """Handle the state changes of the documents saved since the window's start, page
    after page, MAX_DOCUMENTS_PER_RUN at most."""
    seen = _Seen()
    fields = _fields_listed(ctx, window.states)
    start, page_from = 0, window.start
    while seen.looked_at < MAX_DOCUMENTS_PER_RUN:
        # Every document saved since: a state with a path may have been entered and
        # left for one without (the log says so), and a document saved again since its
        # change is listed by its latest save.
        page = await ctx.workflow.list_documents(
            doctype, fields, [["modified", ">=", page_from]], "modified asc, name asc",
            start, PAGE_SIZE)
        if not page.ok:
            seen.unread = page.error
            return seen
        # Frappe answers: if its actions wait for a probe to find it back, they need not.
        ctx.destinations.of("workflow_action").answered()
        documents = _documents(page)
        await _look_at_page(ctx, tx, doctype, documents, window, counts, progress, seen)
        if seen.unread is not None or len(documents) < PAGE_SIZE:
            return seen
        start, page_from = _next_page(documents, start, page_from)
    return seen


def _documents(listed: Result) -> list[dict[str, Any]]:
    """The documents a list of Frappe's answered."""
    return cast(list[dict[str, Any]], listed.body)


async def _look_at_page(ctx: EngineContext, tx: Transaction, doctype: str,
                        documents: list[dict[str, Any]], window: _Window, counts: Counts,
                        progress: Optional[Callable[[int, Optional[int]], None]],
                        seen: _Seen) -> None:
    """Handle the state changes of a page's documents, up to the run's cap; stop at the
    first whose log Frappe does not show (`seen.unread`)."""
    for document in documents[:MAX_DOCUMENTS_PER_RUN - seen.looked_at]:
        seen.unread = await _reconcile_document(ctx, doctype, document, window, counts)
        if seen.unread:
            return
        seen.looked_at += 1
        counts.listed += 1
        seen.last_modified, seen.last_name = document.get("modified"), document.get("name")
        if progress:
            progress(counts.listed, None)


def _next_cursor(run: ReconcileRun | None, window: _Window, seen: _Seen,
                 since: datetime.datetime | None, zone: zoneinfo.ZoneInfo) -> str:
    """Where the doctype's next run starts."""
    last = canonical_modified(seen.last_modified)
    if seen.looked_at >= MAX_DOCUMENTS_PER_RUN and last:
        # More to do: the next run goes on from the last document looked at (at it: the
        # documents of that same time are looked at again, and found stored).
        cursor = last
    else:
        cursor = frappe_time(from_frappe_time(window.upper, zone) - OVERLAP, zone)
    if (since is not None and run is not None and run.cursor
            and window.lower > (canonical_modified(run.cursor) or run.cursor)):
        # A run from later than where the last one got to (`--since`) did not look at
        # what lies between: the next run still starts there.
        cursor = run.cursor
    return cursor


async def _window_problem(ctx: EngineContext, doctype: str, run: ReconcileRun | None,
                          window: _Window, seen: _Seen, zone: zoneinfo.ZoneInfo,
                          now: datetime.datetime) -> str | None:
    """Why the run's window and Frappe's times do not meet, or None: it listed nothing
    while documents changed, or a document it listed was modified ahead of our clock."""
    if not seen.looked_at:
        return await _changed_unseen(ctx, doctype, run, window, zone)
    last = canonical_modified(seen.last_modified)
    if last and from_frappe_time(last, zone) > now + AHEAD_TOLERANCE:
        # Times read in a zone east of the site's: every change looks younger than the
        # settle time, and is left to a webhook that never comes.
        return _unmet(run, f"{doctype} {seen.last_name} was modified at "
                      f"{seen.last_modified}", f"ahead of this service's clock in {zone.key}")
    return None


async def _changed_unseen(ctx: EngineContext, doctype: str, run: ReconcileRun | None,
                          window: _Window, zone: zoneinfo.ZoneInfo) -> str | None:
    """A run that listed nothing: did a document change in Frappe since the last run
    that saw one? Then the run's window and Frappe's times do not meet (a time zone that
    is not the site's, a clock off), and the reason is returned (and logged once)."""
    newest = await ctx.workflow.list_documents(doctype, ["name", "modified"], [],
                                               "modified desc, name desc", 0, 1)
    if not newest.ok or not newest.body:
        return None
    document = _documents(newest)[0]
    modified = canonical_modified(document.get("modified"))
    seen = run.newest_seen if run is not None else None
    if modified is None or modified == seen or (seen is None and modified < window.lower):
        return None
    if modified >= window.lower:
        return None  # listed by the next run
    return _unmet(run, f"{doctype} {document.get('name')} was modified at {modified}",
                  f"after the last document a run saw, yet before this run's window from "
                  f"{window.lower} in {zone.key}")


def _unmet(run: ReconcileRun | None, what: str, where: str) -> str:
    """The problem of a window that does not meet Frappe's times, logged once."""
    problem = (f"{what} (Frappe's time), {where}: Frappe's times and ours do not meet (the "
               f"site's time zone, or a clock); changes go unseen")
    if run is None or run.last_error != problem:
        log.error("reconciliation: %s", problem)
    return problem


def _next_page(documents: list[dict[str, Any]], start: int,
               page_from: str) -> tuple[int, str]:
    """(start, page_from) of the page after `documents`: it begins at the last `modified`
    they reach, not at an offset (a document saved again while the pages are read leaves
    the window, and every later offset would skip one document that no later run looks
    at); only the documents of that very time already read are skipped by count."""
    newest = canonical_modified(documents[-1].get("modified"))
    if newest is None:
        return start + len(documents), page_from
    read_at_newest = sum(canonical_modified(d.get("modified")) == newest for d in documents)
    if newest == canonical_modified(page_from):
        return start + read_at_newest, page_from
    return read_at_newest, newest


def _entries(document: dict[str, Any], log_entries: list[dict[str, Any]],
             window: _Window) -> list[dict[str, Any]]:
    """The document's state changes with a path in the window, oldest first, each as
    {path, entry, entered_after, entered_at, left_for}: every log entry (a workflow
    action) for a state with a path, and the document's current state when no entry
    led to it (entered by other means: its span is from the last entry to its
    `modified`)."""
    found: list[dict[str, Any]] = []
    times = [canonical_modified(entry["creation"]) for entry in log_entries]
    current = document.get("workflow_state")
    modified = canonical_modified(document.get("modified"))
    if (times and times[-1] and modified and times[-1] > modified
            and log_entries[-1].get("content") != current):
        # An action applied between the list and the log (an entry after the listed save
        # leads elsewhere): the log is the newer record, and no state was entered by other
        # means. (An action's own entry is written just after its save, so a later time
        # alone says nothing.)
        current, modified = log_entries[-1].get("content"), None
    for index, entry in enumerate(log_entries):
        content = entry.get("content")
        path = window.states.get(content) if isinstance(content, str) else None
        at = times[index]
        if path is None or at is None or not window.lower <= at <= window.upper:
            continue
        left = index < len(log_entries) - 1 or entry.get("content") != current
        found.append({"path": path, "entry": entry["name"],
                      "entered_after": times[index - 1] if index else None,
                      "entered_at": at, "left_for": current if left else None})
    last = log_entries[-1].get("content") if log_entries else None
    if (current in window.states and current != last and modified is not None
            and window.lower <= modified <= window.upper):
        after = times[-1] if times else None
        found.append({"path": window.states[current], "entry": f"since {after}",
                      "entered_after": after, "entered_at": modified, "left_for": None})
    return found


async def _reconcile_document(ctx: EngineContext, doctype: str,
                             document: dict[str, Any], window: _Window,
                             counts: Counts) -> str | None:
    """Handle the document's state changes in the window, oldest first; what went wrong
    when Frappe did not show its log (the run stops there, its cursor unmoved)."""
    name: Any = document.get("name")  # as Frappe sent it
    history = await ctx.workflow.workflow_log(doctype, str(name))
    if not history.ok:
        return f"{doctype} {name}: {history.error}"
    found = _entries(document, cast(list[dict[str, Any]], history.body), window)
    await _hand_over(ctx, doctype, name, document, found, counts)
    return None


async def _hand_over(ctx: EngineContext, doctype: str, name: Any,
                     document: dict[str, Any], changes: list[dict[str, Any]],
                     counts: Counts, before_a_webhook: bool = False) -> None:
    """Hand each change found in the document's log (`_entries`) to the inbox, oldest
    first, as its webhook would have come. `before_a_webhook`: stop at the first the
    database could not take (spooled): the webhook that asked joins it in the spool, and
    a run finds the rest once the spool is drained."""
    for found in changes:
        path = found.pop("path")
        webhook = ctx.plugins[SOURCE].get(path)
        body = _body_of(webhook.fields, name, document, found)
        problem = webhook.field_error(body)
        if problem:
            counts.unusable += 1
            log.warning("reconciliation: %s %s (%s at %s) not handled: %s", path, name,
                        doctype, found["entered_at"], problem)
            continue
        placed = ctx.plugins[SOURCE].placed(path, body)
        event, created, outcome = await inbox.accept(
            ctx, SOURCE, path, entered_key(path, name, body["workflow_entry"]),
            json.dumps(body).encode(), order_number=body["order_number"], reconciled=True,
            stream=placed.stream, version=placed.version)
        if event is None and before_a_webhook:
            return
        if _counted_as_done(counts, event, created, outcome):
            continue
        counts.handled += 1
        log.warning("reconciliation: %s of %s (%s), entered at %s, had no webhook; handled "
                    "as event #%s: %s", path, name, body["order_number"], found["entered_at"],
                    event.id if event else "(spooled)", outcome or "stored")


async def predecessors_first(ctx: EngineContext, path: str, body: dict[str, Any]) -> Counts:
    """Before a webhook's change is accepted, its document's workflow log hands the inbox
    what the webhook alone cannot tell, as a run would hand it (`_hand_over`):

    - when its path follows others in its workflow (`WorkflowWebhook.after`) and none of
      those is stored: the changes from before this one, so that a webhook that comes
      late, or never (Frappe gave up on it), is placed before this one (its job goes
      first, or its path's rule for a state left applies);
    - when the webhook itself comes late (LATE_AFTER past its save: a later try, or a call
      Frappe's queue held): every change up to now, this one among them, so that a state
      its document has left since follows its path's rule whichever finder comes first;
      the webhook is then that change's copy.

    Frappe not answering within half the answer budget: logged, and this change goes on
    alone (a run finds the others later)."""
    counts = Counts()
    webhook = ctx.plugins[SOURCE].get(path)
    modified = canonical_modified(body.get("modified"))
    doctype = _doctype_of(ctx.settings, path)
    if (modified is None or doctype is None or not ctx.settings.workflow_url
            or inbox.spool_holds_calls(ctx)):
        # While calls wait in the spool this one joins them, and so would the log's
        # entries handed over now: nothing is placed by reading Frappe before the drain.
        # The run finds what is missing afterwards.
        return counts
    late = ctx.clock() - from_frappe_time(modified, site_zone(ctx)) >= LATE_AFTER
    if not late and not webhook.after:
        return counts
    tx = Transaction(ctx)
    try:
        # Read even for a late one: with the database down nothing is handed over, since
        # the changes would be spooled beside this webhook and stored apart by the drain.
        stored = await ctx.db(lambda: tx.has_event_of_types(
            SOURCE, body["order_number"], webhook.after or (path,)))
    except DatabaseDown:
        return counts  # the call goes to the spool, and waits there behind the others
    if not late and stored:
        return counts
    try:
        document, entries = await asyncio.wait_for(
            _document_and_log(ctx, doctype, body["order_name"]),
            ctx.settings.workflow_answer_budget_seconds / 2)
    except asyncio.TimeoutError:
        document, entries = None, "Frappe did not answer in time"
    if document is None:
        log.warning("%s of %s: its document's workflow log not read from Frappe (%s); it "
                    "is handled alone", path, body["order_name"], entries)
        return counts
    assert not isinstance(entries, str)
    if late:
        now = frappe_time(ctx.clock(), site_zone(ctx))
        found = _entries(document, entries, _Window("", now, _states(ctx, doctype), ""))
    else:
        found = [change for change in _entries(
            document, entries, _Window("", modified, _states(ctx, doctype), ""))
            if change["entered_at"] != modified]
    await _hand_over(ctx, doctype, body["order_name"], document, found, counts,
                     before_a_webhook=True)
    return counts


def _states(ctx: EngineContext, doctype: str) -> dict[str, str]:
    return doctype_states(ctx.settings)[doctype]


async def _document_and_log(ctx: EngineContext, doctype: str, name: str) -> tuple[
        dict[str, Any] | None, list[dict[str, Any]] | str]:
    """The document as Frappe lists it and its workflow log, or (None, what went wrong)."""
    listed = await ctx.workflow.list_documents(
        doctype, _fields_listed(ctx, _states(ctx, doctype)), [["name", "=", name]],
        "modified asc, name asc", 0, 1)
    if not listed.ok or not listed.body:
        return None, listed.error or "the document is not listed"
    history = await ctx.workflow.workflow_log(doctype, name)
    if not history.ok:
        return None, history.error or "no workflow log"
    return _documents(listed)[0], cast(list[dict[str, Any]], history.body)


def _doctype_of(settings: Settings, path: str) -> str | None:
    """The doctype whose webhooks come to `path`, or None for a path of none."""
    for prefix, attribute in GROUPS.items():
        if path.startswith(prefix):
            return cast(str, getattr(settings, attribute))
    return None


def _body_of(fields: Iterable[str], name: Any, document: dict[str, Any],
             found: dict[str, Any]) -> dict[str, Any]:
    """The body of a state change found in the log (`found`, from `_entries`): the
    webhook's `fields` as the document has them now, the log entry, and the span in
    which the state was entered (and what it was left for, if it was)."""
    body = {"order_name": name,
            **{field: document.get(field) for field in fields if field != "order_name"},
            "workflow_entry": found.pop("entry"), **found}
    if found["left_for"] is None:
        del body["left_for"]
    return body


def _counted_as_done(counts: Counts, event: WebhookEvent | None, created: bool,
                     outcome: str | None) -> bool:
    """Whether the inbox found the change stored already, recorded it only, or holds it
    behind an earlier call of its order (counted so); else it was handled now."""
    if not created and event is not None:
        counts.already += 1
    elif outcome == "ignored":
        counts.recorded += 1
    elif outcome == inbox.HELD:
        # Stored, and handled in its order's turn (BEHAVIOUR.md 6.1).
        counts.held += 1
    else:
        return False
    return True


async def _record_failure(ctx: EngineContext, tx: Transaction, doctype: str,
                          run: ReconcileRun | None, error: str) -> None:
    """The doctype's run failed for `error`: recorded (the next run starts where the
    last finished one did), and logged when it starts or its reason changes."""
    if run is None or run.last_error != error:
        # Once, when it starts (or its reason changes), not at every run.
        log.warning("reconciliation: Frappe does not list %s (%s); tried again at the "
                    "next run", doctype, error)
    now = ctx.clock()
    await ctx.db(lambda: tx.record_reconcile_failure(doctype, error, now))


def last_successes(tx: Transaction, settings: Settings) -> dict[str, datetime.datetime | None]:
    """{doctype: when its reconciliation last succeeded (None: never)}, for every
    configured doctype; none when no Frappe is configured."""
    if not settings.workflow_url:
        return {}
    stored = {run.doctype: run.succeeded_at for run in tx.reconcile_runs()}
    return {doctype: stored.get(doctype) for doctype in sorted(doctype_states(settings))}


def problems(tx: Transaction, settings: Settings) -> dict[str, str]:
    """{doctype: why its last run failed, or what it found wrong} for the doctypes that
    have one; shown by /readyz and /metrics."""
    if not settings.workflow_url:
        return {}
    configured = doctype_states(settings)
    return {run.doctype: run.last_error for run in tx.reconcile_runs()
            if run.doctype in configured and run.last_error}
