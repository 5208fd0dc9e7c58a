"""Reconciliation with the workflow system (Frappe): the state changes whose webhook never
came, found by asking Frappe and handled as if it had come.

Frappe v15 tries a webhook three times within about 5 s and then never again, so an
outage of the service longer than that loses the state change. Each run lists, through
Frappe's REST list API, the documents of each doctype modified since the last run (with
an overlap) that are in a state with a webhook path (WORKFLOW_RECONCILE_STATES), and
hands each one whose state change has no stored event yet to the inbox: the same body
fields, the same plugin, the same effects, the event marked `reconciled`.

The identity of a state change is the path, the document's name and its `modified` at
the change (`change_key`): the webhook's body carries that `modified` (the templates of
docs/INTEGRATIONS.md), so a webhook is stored under the same key whether it comes before
or after the run. A document saved again in the same state has a later `modified` than
its change; so a run also counts a change as stored when the newest workflow event of
that order among its doctype's paths is of the path of its current state (the order has
not been seen leaving that state since). Changes younger than
WORKFLOW_RECONCILE_SETTLE_SECONDS are left to their webhook. The other way round, a
webhook older than that, of a document saved again since its change, names an earlier
`modified` than the run's copy: the webhook path asks `handled_since` (`came_late`).

A run waits on the database for WORKFLOW_RECONCILE_DATABASE_SECONDS in all at most
(engine.commits.allowance): a slow database stops it between two documents' units, each
document's change stored and handled whole or not at all, and the doctype's cursor left
where the last finished run put it, so the next run looks at that span again (what was
done is found stored). It is not taken for the database being down: see `allowance`.
"""
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import zoneinfo
from typing import Callable, Optional

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


@dataclasses.dataclass
class Counts:
    listed: int = 0
    handled: int = 0
    already: int = 0
    unusable: int = 0
    failed: list = dataclasses.field(default_factory=list)  # doctypes Frappe did not list
    # The run spent WORKFLOW_RECONCILE_DATABASE_SECONDS and stopped before its end.
    stopped: bool = False


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
    """The inbox key of one state change: its path, the document's name and its
    `modified` at the change (hashed: a name may be long). None without a `modified`."""
    moment = canonical_modified(modified)
    if moment is None:
        return None
    digest = hashlib.sha256(f"{name}\n{moment}".encode()).hexdigest()[:40]
    return f"{path}:change:{digest}"


# The newest event of one workflow path for one order (the order_number index).
NEWEST_OF_PATH = Prepared(lambda: WebhookEvent.select().where(
    WebhookEvent.order_number == slot(WebhookEvent.order_number),
    WebhookEvent.source == SOURCE,
    WebhookEvent.event_type == slot(WebhookEvent.event_type))
    .order_by(WebhookEvent.id.desc()).limit(1))


def came_late(settings, modified: str, now: datetime.datetime) -> bool:
    """Whether a webhook's change (its `modified`, a change key's) is older than the
    settle time: only then can a run have listed the document, since saved again, and
    handled the change first under a later `modified`."""
    moment = canonical_modified(modified)
    assert moment is not None, "a webhook with a change key has a `modified`"
    changed = from_frappe_time(moment, zoneinfo.ZoneInfo(settings.workflow_time_zone))
    return now - changed >= datetime.timedelta(
        seconds=settings.workflow_reconcile_settle_seconds)


def handled_since(path: str, order_name: str, order_number: str,
                  modified: str) -> WebhookEvent | None:
    """The order's newest event of `path` when it is of the same document and its
    `modified` is this one's or later: this path's state was already handled at or
    after this change (the same stay in that state, the document saved again since; or
    a later one, which this older change adds nothing to). None otherwise. One indexed
    statement."""
    newest = NEWEST_OF_PATH.first(order_number=order_number, event_type=path)
    if newest is None:
        return None
    try:
        stored = json.loads(newest.payload)
    except ValueError:
        return None
    if not isinstance(stored, dict) or stored.get("order_name") != order_name:
        return None
    theirs, ours = canonical_modified(stored.get("modified")), canonical_modified(modified)
    return newest if theirs is not None and ours is not None and theirs >= ours else None


def doctype_states(settings) -> dict:
    """{doctype: {Frappe state: path}} of the configured states."""
    found = {}
    for path, state in settings.workflow_reconcile_states:
        for prefix, attribute in GROUPS.items():
            if path.startswith(prefix):
                found.setdefault(getattr(settings, attribute), {})[state] = path
    return found


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


async def _reconcile_doctype(ctx, doctype, states, since, counts, progress):
    settings = ctx.settings
    zone = zoneinfo.ZoneInfo(settings.workflow_time_zone)
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
    registry = ctx.plugins[SOURCE]
    fields = sorted({"name", "modified", "workflow_state"} | {
        field for path in states.values() for field in registry.get(path).fields
        if field != "order_name"})
    start, looked_at, last_modified, page_from = 0, 0, None, lower
    while looked_at < MAX_DOCUMENTS_PER_RUN:
        filters = [["modified", ">=", page_from], ["modified", "<=", upper],
                   ["workflow_state", "in", sorted(states)]]
        page = await ctx.workflow.list_documents(
            doctype, fields, filters, "modified asc, name asc", start, PAGE_SIZE)
        if not page.ok:
            await _record_failure(ctx, doctype, run, page.error)
            counts.failed.append(doctype)
            return
        for document in page.body[:MAX_DOCUMENTS_PER_RUN - looked_at]:
            await _reconcile_document(ctx, document, states, counts)
            looked_at += 1
            counts.listed += 1
            last_modified = document.get("modified")
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
    await ctx.db(functools.partial(_record_success, ctx, doctype, cursor))
    if run is not None and run.last_error:
        log.info("reconciliation: Frappe lists %s again", doctype)


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


async def _reconcile_document(ctx, document, states, counts):
    path = states.get(document.get("workflow_state"))
    webhook = ctx.plugins[SOURCE].get(path)
    body = {"order_name": document.get("name"),
            **{field: document.get(field) for field in webhook.fields if field != "order_name"},
            "modified": document.get("modified")}
    problem = webhook.field_error(body)
    key = None if problem else change_key(path, body["order_name"], body["modified"])
    if key is None:
        counts.unusable += 1
        log.warning("reconciliation: %s %s in %r not handled: %s", path, body["order_name"],
                    document.get("workflow_state"), problem or "no modified time")
        return
    group = [other for other in ctx.plugins[SOURCE].keys()
             if other.split("/")[0] == path.split("/")[0]]
    seen = await ctx.db(functools.partial(
        _latest_path_of_order, body["order_number"], group))
    if seen == path:
        counts.already += 1
        return
    event, created, outcome = await inbox.accept(
        ctx, SOURCE, path, key, json.dumps(body).encode(),
        order_number=body["order_number"], reconciled=True)
    if not created and event is not None:
        counts.already += 1
        return
    counts.handled += 1
    log.warning("reconciliation: %s of %s (%s) had no webhook; handled as event #%s: %s",
                path, body["order_name"], body["order_number"],
                event.id if event else "(spooled)", outcome or "stored")


def _run_of(doctype):
    return ReconcileRun.get_or_none(ReconcileRun.doctype == doctype)


def _latest_path_of_order(order_number, paths):
    """Of the order's workflow events on `paths` (those of one doctype), the newest's
    path, or None."""
    latest = (WebhookEvent.select(WebhookEvent.event_type)
              .where(WebhookEvent.order_number == order_number,
                     WebhookEvent.source == SOURCE, WebhookEvent.event_type.in_(paths))
              .order_by(WebhookEvent.id.desc()).first())
    return latest.event_type if latest else None


def _record_success(ctx, doctype, cursor):
    now = ctx.clock()
    (ReconcileRun.insert(doctype=doctype, cursor=cursor, succeeded_at=now, last_error=None,
                         created_at=now, updated_at=now)
     .on_conflict(conflict_target=[ReconcileRun.doctype],
                  update={ReconcileRun.cursor: cursor, ReconcileRun.succeeded_at: now,
                          ReconcileRun.last_error: None, ReconcileRun.updated_at: now})
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
