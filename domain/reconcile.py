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
from it. A change older than one already handled for the document (`newer_change`) is
recorded and never handled: handling it would re-order what went out.

Frappe writes its times as naive text in its System Settings' time zone, which the
service reads from Frappe (`site_zone`); a list that finds nothing while Frappe's newest
`modified` moved on says so (the window and Frappe's times do not meet).

A run waits on the database for WORKFLOW_RECONCILE_DATABASE_SECONDS in all at most
(engine.commits.allowance): a slow database stops it between two units, each entry
stored and handled whole or not at all, and the doctype's cursor left where the last
finished run put it, so the next run looks at that span again (what was done is found
stored). It is not taken for the database being down: see `allowance`.
"""
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import zoneinfo
from typing import Any, Callable, Optional

from clients.workflow import FRAPPE_DEFAULT_TIME_ZONE
from models import UTC, ReconcileRun, WebhookEvent
from engine import inbox
from engine.commits import AllowanceSpent, allowance
from engine.prepared import Prepared, slot

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
# Frappe writes `modified` as naive text in its system time zone.
FRAPPE_TIME = "%Y-%m-%d %H:%M:%S.%f"
# Paths grouped by the doctype their webhooks come from (settings.RECONCILED_PATH_PREFIXES).
GROUPS = {"formation/": "workflow_doctype", "crtc/": "crtc_doctype"}
# The events of one order and path looked at to recognise a state change: more than one
# order goes through one state in the life of an order.
STAYS_LOOKED_AT = 50
# A document modified this far ahead of our clock says our times and Frappe's differ.
AHEAD_TOLERANCE = datetime.timedelta(minutes=5)
# Statuses of an event whose change was (or is being) handled: a change recorded only
# (ignored), refused or given up holds nothing behind it.
HANDLED = ("received", "processed", "failed")


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
    failed: list = dataclasses.field(default_factory=list)  # doctypes Frappe did not list
    # The run spent WORKFLOW_RECONCILE_DATABASE_SECONDS and stopped before its end.
    stopped: bool = False
    # Doctypes whose documents changed in Frappe while the run's window found none.
    quiet: list = dataclasses.field(default_factory=list)


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


def _stay(body: dict) -> tuple[str, str] | None:
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


# An order's newest workflow events, of any path (the order_number index).
EVENTS_OF_ORDER = Prepared(lambda: WebhookEvent.select().where(
    WebhookEvent.order_number == slot(WebhookEvent.order_number),
    WebhookEvent.source == SOURCE)
    .order_by(WebhookEvent.id.desc()).limit(STAYS_LOOKED_AT))
# An order's newest events of one workflow path (the order_number index).
EVENTS_OF_PATH = Prepared(lambda: WebhookEvent.select().where(
    WebhookEvent.order_number == slot(WebhookEvent.order_number),
    WebhookEvent.source == SOURCE,
    WebhookEvent.event_type == slot(WebhookEvent.event_type))
    .order_by(WebhookEvent.id.desc()).limit(STAYS_LOOKED_AT))


def _stays_of(events, order_name: str):
    for event in events:
        try:
            stored = json.loads(event.payload)
        except ValueError:
            continue
        if isinstance(stored, dict) and stored.get("order_name") == order_name:
            span = _stay(stored)
            if span is not None:
                yield event, span


def same_stay(path: str, order_name: str, order_number: str,
              body: dict) -> WebhookEvent | None:
    """The stored event that found this same state change (the same save entering the
    state) under another key: a webhook's against a log entry's, or the other way. Run
    in the storing's transaction (`inbox.accept`'s `handled_by`): indexed reads."""
    ours = _stay(body)
    if ours is None:
        return None
    events = EVENTS_OF_PATH.all(order_number=order_number, event_type=path)
    return next((event for event, span in _stays_of(events, order_name)
                 if _same(ours, span)), None)


def newer_change(paths: list[str], body: dict) -> WebhookEvent | None:
    """A change of the same document handled (or being handled) that was made after this
    one, on any of `paths` (its doctype's): this one is then older than what was acted
    on, and is recorded, not handled. Read by the plugin in the event's transaction: one
    indexed statement."""
    ours = _stay(body)
    if ours is None:
        return None
    events = [event for event in EVENTS_OF_ORDER.all(order_number=body["order_number"])
              if event.event_type in paths and event.status in HANDLED]
    return next((event for event, span in _stays_of(events, body["order_name"])
                 if _later(ours, span)), None)


def may_be_superseded(ctx: Any, body: dict) -> bool:
    """Whether a change may be older than one already handled, so `newer_change` is worth
    its read: a log entry's (found late by definition), or a webhook older than the settle
    time (only then can a run, or a later webhook, have come first). Pure: no read."""
    if "entered_at" in body:
        return True
    return canonical_modified(body.get("modified")) is not None and came_late(
        ctx, body["modified"], ctx.clock())


def site_zone(ctx: Any) -> zoneinfo.ZoneInfo:
    """The time zone Frappe writes its times in: its System Settings' as Frappe last said
    it (clients.workflow.WorkflowClient.read_time_zone), else WORKFLOW_TIME_ZONE, else
    what v15 uses when System Settings name none."""
    return zoneinfo.ZoneInfo(ctx.workflow.time_zone or ctx.settings.workflow_time_zone
                             or FRAPPE_DEFAULT_TIME_ZONE)


def came_late(ctx: Any, modified: str, now: datetime.datetime) -> bool:
    """Whether a webhook's change (its `modified`, a change key's) is older than the
    settle time: only then can a run have listed the document and handled the change
    first."""
    moment = canonical_modified(modified)
    assert moment is not None, "a webhook with a change key has a `modified`"
    changed = from_frappe_time(moment, site_zone(ctx))
    return now - changed >= datetime.timedelta(
        seconds=ctx.settings.workflow_reconcile_settle_seconds)


def doctype_states(settings) -> dict:
    """{doctype: {Frappe state: path}} of the configured states."""
    found = {}
    for path, state in settings.workflow_reconcile_states:
        for prefix, attribute in GROUPS.items():
            if path.startswith(prefix):
                found.setdefault(getattr(settings, attribute), {})[state] = path
    return found


def group_paths(ctx: Any, path: str) -> list[str]:
    """Every webhook path of the doctype `path` belongs to."""
    prefix = path.split("/")[0] + "/"
    return [other for other in ctx.plugins[SOURCE].keys() if other.startswith(prefix)]


def frappe_time(moment: datetime.datetime, zone: zoneinfo.ZoneInfo) -> str:
    return moment.astimezone(zone).strftime(FRAPPE_TIME)


def from_frappe_time(text: str, zone: zoneinfo.ZoneInfo) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text).replace(tzinfo=zone).astimezone(UTC)


async def reconcile_workflow(
        ctx, since: datetime.datetime | None = None,
        progress: Optional[Callable[[int, Optional[int]], None]] = None) -> Counts:
    """One run over every configured doctype; `since` (aware) instead of where the last
    run got to. Frappe not answering, or refusing, is logged once (when it starts) and
    recorded; the next run tries again from the same place. `progress(looked at, None)`
    after each document (how many there are is not known before the last page)."""
    global _stopping
    counts = Counts()
    if not ctx.settings.workflow_url:
        return counts
    if ctx.workflow.time_zone is None:
        # Frappe's times are read in its own time zone: without it a run would look at
        # the wrong hours and find nothing, saying nothing.
        zone = await ctx.workflow.read_time_zone()
        if not zone.ok:
            for doctype in doctype_states(ctx.settings):
                run = await ctx.db(functools.partial(_run_of, doctype))
                await _record_failure(ctx, doctype, run,
                                      f"Frappe's time zone could not be read: {zone.error}")
                counts.failed.append(doctype)
            return counts
    seconds = ctx.settings.workflow_reconcile_database_seconds
    try:
        with allowance(seconds):
            for doctype, states in doctype_states(ctx.settings).items():
                await _reconcile_doctype(ctx, doctype, states, since, counts, progress)
    except AllowanceSpent:
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
    `upper` (Frappe's local times, canonical text), younger ones left to their webhook."""
    lower: str
    upper: str
    states: dict


async def _reconcile_doctype(ctx, doctype, states, since, counts, progress):
    settings = ctx.settings
    zone = site_zone(ctx)
    now = ctx.clock()
    run = await ctx.db(functools.partial(_run_of, doctype))
    if since is not None:
        lower = frappe_time(since, zone)
    elif run is not None and run.cursor:
        lower = run.cursor
    else:
        lower = frappe_time(now - FIRST_LOOKBACK, zone)
    upper = frappe_time(
        now - datetime.timedelta(seconds=settings.workflow_reconcile_settle_seconds), zone)
    window = _Window(canonical_modified(lower) or lower, canonical_modified(upper) or upper,
                     states)
    registry = ctx.plugins[SOURCE]
    fields = sorted({"name", "modified", "workflow_state"} | {
        field for path in states.values() for field in registry.get(path).fields
        if field != "order_name"})
    start, looked_at, last_modified, last_name, page_from = 0, 0, None, None, lower
    while looked_at < MAX_DOCUMENTS_PER_RUN:
        # Every document saved since: a state with a path may have been entered and
        # left for one without (the log says so), and a document saved again since its
        # change is listed by its latest save.
        page = await ctx.workflow.list_documents(
            doctype, fields, [["modified", ">=", page_from]], "modified asc, name asc",
            start, PAGE_SIZE)
        if not page.ok:
            await _record_failure(ctx, doctype, run, page.error)
            counts.failed.append(doctype)
            return
        # Frappe answers: if its actions wait for a probe to find it back, they need not.
        ctx.destinations.of("workflow_action").answered()
        for document in page.body[:MAX_DOCUMENTS_PER_RUN - looked_at]:
            unread = await _reconcile_document(ctx, doctype, document, window, counts)
            if unread:
                await _record_failure(ctx, doctype, run, unread)
                counts.failed.append(doctype)
                return
            looked_at += 1
            counts.listed += 1
            last_modified, last_name = document.get("modified"), document.get("name")
            if progress:
                progress(counts.listed, None)
        if len(page.body) < PAGE_SIZE:
            break
        start, page_from = _next_page(page.body, start, page_from)
    if looked_at >= MAX_DOCUMENTS_PER_RUN and canonical_modified(last_modified):
        # More to do: the next run goes on from the last document looked at (at it: the
        # documents of that same time are looked at again, and found stored).
        cursor = canonical_modified(last_modified)
    else:
        cursor = frappe_time(from_frappe_time(upper, zone) - OVERLAP, zone)
    if (since is not None and run is not None and run.cursor
            and canonical_modified(lower) > canonical_modified(run.cursor)):
        # A run from later than where the last one got to (`--since`) did not look at
        # what lies between: the next run still starts there.
        cursor = run.cursor
    quiet = None
    if not looked_at:
        quiet = await _changed_unseen(ctx, doctype, run, window, zone)
    elif canonical_modified(last_modified) and from_frappe_time(
            canonical_modified(last_modified), zone) > now + AHEAD_TOLERANCE:
        # Times read in a zone east of the site's: every change looks younger than the
        # settle time, and is left to a webhook that never comes.
        quiet = _unmet(run, f"{doctype} {last_name} was modified at {last_modified}",
                       f"ahead of this service's clock in {zone.key}")
    if quiet:
        counts.quiet.append(doctype)
    newest = last_modified if looked_at else (run.newest_seen if run else None)
    await ctx.db(functools.partial(_record_success, ctx, doctype, cursor, quiet,
                                   canonical_modified(newest)))
    if run is not None and run.last_error and not quiet:
        log.info("reconciliation: Frappe lists %s again", doctype)


async def _changed_unseen(ctx, doctype, run, window, zone) -> str | None:
    """A run that listed nothing: did a document change in Frappe since the last run
    that saw one? Then the run's window and Frappe's times do not meet (a time zone that
    is not the site's, a clock off), and the reason is returned (and logged once)."""
    newest = await ctx.workflow.list_documents(doctype, ["name", "modified"], [],
                                               "modified desc, name desc", 0, 1)
    if not newest.ok or not newest.body:
        return None
    modified = canonical_modified(newest.body[0].get("modified"))
    seen = run.newest_seen if run is not None else None
    if modified is None or modified == seen or (seen is None and modified < window.lower):
        return None
    if modified >= window.lower:
        return None  # listed by the next run
    return _unmet(run, f"{doctype} {newest.body[0].get('name')} was modified at {modified}",
                  f"after the last document a run saw, yet before this run's window from "
                  f"{window.lower} in {zone.key}")


def _unmet(run, what: str, where: str) -> str:
    """The problem of a window that does not meet Frappe's times, logged once."""
    problem = (f"{what} (Frappe's time), {where}: Frappe's times and ours do not meet (the "
               f"site's time zone, or a clock); changes go unseen")
    if run is None or run.last_error != problem:
        log.error("reconciliation: %s", problem)
    return problem


def _next_page(documents: list, start: int, page_from: str) -> tuple[int, str]:
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


def _entries(document: dict, log_entries: list, window: _Window) -> list[dict]:
    """The document's state changes with a path in the window, oldest first, each as
    {path, entry, entered_after, entered_at, left_for}: every log entry (a workflow
    action) for a state with a path, and the document's current state when no entry
    led to it (entered by other means: its span is from the last entry to its
    `modified`)."""
    found = []
    times = [canonical_modified(entry["creation"]) for entry in log_entries]
    current = document.get("workflow_state")
    for index, entry in enumerate(log_entries):
        path = window.states.get(entry.get("content"))
        at = times[index]
        if path is None or at is None or not window.lower <= at <= window.upper:
            continue
        left = index < len(log_entries) - 1 or entry.get("content") != current
        found.append({"path": path, "entry": entry["name"],
                      "entered_after": times[index - 1] if index else None,
                      "entered_at": at, "left_for": current if left else None})
    last = log_entries[-1].get("content") if log_entries else None
    modified = canonical_modified(document.get("modified"))
    if (current in window.states and current != last and modified is not None
            and window.lower <= modified <= window.upper):
        after = times[-1] if times else None
        found.append({"path": window.states[current], "entry": f"since {after}",
                      "entered_after": after, "entered_at": modified, "left_for": None})
    return found


async def _reconcile_document(ctx, doctype, document, window, counts) -> str | None:
    """Handle the document's state changes in the window, oldest first; what went wrong
    when Frappe did not show its log (the run stops there, its cursor unmoved)."""
    name = document.get("name")
    history = await ctx.workflow.workflow_log(doctype, str(name))
    if not history.ok:
        return f"{doctype} {name}: {history.error}"
    for found in _entries(document, history.body, window):
        path = found.pop("path")
        webhook = ctx.plugins[SOURCE].get(path)
        body = {"order_name": name,
                **{field: document.get(field) for field in webhook.fields
                   if field != "order_name"},
                "workflow_entry": found.pop("entry"), **found}
        if found["left_for"] is None:
            del body["left_for"]
        problem = webhook.field_error(body)
        if problem:
            counts.unusable += 1
            log.warning("reconciliation: %s %s (%s at %s) not handled: %s", path, name,
                        doctype, found["entered_at"], problem)
            continue
        event, created, outcome = await inbox.accept(
            ctx, SOURCE, path, entered_key(path, name, body["workflow_entry"]),
            json.dumps(body).encode(), order_number=body["order_number"], reconciled=True,
            handled_by=functools.partial(same_stay, path, name, body["order_number"], body))
        if not created and event is not None:
            counts.already += 1
            continue
        if outcome == "ignored":
            counts.recorded += 1
            continue
        if outcome == inbox.HELD:
            # Stored, and handled in its order's turn (BEHAVIOUR.md 6.1).
            counts.held += 1
            continue
        counts.handled += 1
        log.warning("reconciliation: %s of %s (%s), entered at %s, had no webhook; handled "
                    "as event #%s: %s", path, name, body["order_number"], found["entered_at"],
                    event.id if event else "(spooled)", outcome or "stored")
    return None


def _run_of(doctype):
    return ReconcileRun.get_or_none(ReconcileRun.doctype == doctype)


def _record_success(ctx, doctype, cursor, problem=None, newest=None):
    """The run finished: its cursor, and `problem` (a window that found nothing while
    documents changed) kept as the doctype's error, shown like a failure's."""
    now = ctx.clock()
    (ReconcileRun.insert(doctype=doctype, cursor=cursor, succeeded_at=now, last_error=problem,
                         newest_seen=newest, created_at=now, updated_at=now)
     .on_conflict(conflict_target=[ReconcileRun.doctype],
                  update={ReconcileRun.cursor: cursor, ReconcileRun.succeeded_at: now,
                          ReconcileRun.last_error: problem,
                          ReconcileRun.newest_seen: newest, ReconcileRun.updated_at: now})
     .execute())


async def _record_failure(ctx, doctype, run, error):
    if run is None or run.last_error != error:
        # Once, when it starts (or its reason changes), not at every run.
        log.warning("reconciliation: Frappe does not list %s (%s); tried again at the "
                    "next run", doctype, error)
    now = ctx.clock()
    await ctx.db(lambda: (
        ReconcileRun.insert(doctype=doctype, last_error=error, created_at=now, updated_at=now)
        .on_conflict(conflict_target=[ReconcileRun.doctype],
                     update={ReconcileRun.last_error: error, ReconcileRun.updated_at: now})
        .execute()))


def last_successes(settings) -> dict:
    """{doctype: when its reconciliation last succeeded (None: never)}, for every
    configured doctype; none when no Frappe is configured."""
    if not settings.workflow_url:
        return {}
    stored = {run.doctype: run.succeeded_at for run in ReconcileRun.select()}
    return {doctype: stored.get(doctype) for doctype in sorted(doctype_states(settings))}


def problems(settings) -> dict:
    """{doctype: why its last run failed, or what it found wrong} for the doctypes that
    have one; shown by /readyz and /metrics."""
    if not settings.workflow_url:
        return {}
    configured = doctype_states(settings)
    return {run.doctype: run.last_error for run in ReconcileRun.select()
            if run.doctype in configured and run.last_error}
