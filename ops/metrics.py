"""Prometheus metrics: what happened (counters kept in memory) and what is waiting now
(gauges read from the database and the spool directory when /metrics is scraped, at
most once every METRICS_CACHE_SECONDS: in between, a scrape gets the same gauges).

The gauges' queries run on the event loop. Scraped by 20 clients at once (161 scrapes a
second) they had raised a webhook's median answer from 8.7 ms to 681 ms; from the cache,
a scrape costs what formatting the counters costs (docs/PERFORMANCE.md).

Each Context owns its own registry, so tests and several apps in one process never share
counts."""
import datetime
import functools
import itertools
import json
import logging
import os
from typing import Iterable, Iterator, cast

from peewee import fn
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.samples import Sample

from models import UTC, Outbox, WebhookEvent, database
from domain import reconcile
from engine import commits, inbox, spool
from engine.commits import on_commit
from engine.contracts import EngineContext
from engine.db import UNAVAILABLE
from engine.destinations import DESTINATION_OF
from engine.transaction import Transaction
from ops import operator

# What Frappe's configuration check may find that leaves it in use (clients.workflow).
WORKFLOW_WARNINGS = ("workflow_read", "time_zone")

log = logging.getLogger("receiver.metrics")

# Handling runs from a few milliseconds (a plain plugin) to the outbound timeout (an
# effect sent while the sender waits).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
JOB_RESULTS = ("ok", "failed", "skipped")


class Metrics:
    def __init__(self, cache_seconds: float = 0) -> None:
        self.cache_seconds = cache_seconds
        # (when, the gauges' text) of the last computation.
        self.state: tuple[datetime.datetime, bytes] | None = None
        self.registry = CollectorRegistry()
        self.events = Counter(
            "receiver_events", "Inbound events by source, type and outcome of handling "
            "(processed, ignored, rejected, failed, dead, duplicate; held: it waits behind an "
            "earlier event of its stream, and is counted again when handled).",
            ["source", "type", "outcome"], registry=self.registry)
        self.handling = Histogram(
            "receiver_event_handling_seconds", "Time to handle one stored event, "
            "including sending its effects.", ["source"], buckets=LATENCY_BUCKETS,
            registry=self.registry)
        self.sends = Counter(
            "receiver_outbox_sends", "Attempts to send an outbox effect, by destination "
            "and result (sent, logged, retry, dead).", ["destination", "result"],
            registry=self.registry)

        self.job_runs = Counter(
            "receiver_job_runs", "Runs of a scheduled job by result: ok, failed (an error "
            "or the database went away; see the log), skipped (another process ran it).",
            ["job", "result"], registry=self.registry)
        self.job_last_success = Gauge(
            "receiver_job_last_success_timestamp_seconds", "Unix time of the job's last "
            "run that succeeded in this process (0: none yet).", ["job"],
            registry=self.registry)
        self.job_running_seconds = Gauge(
            "receiver_job_running_seconds", "How long the job's run under way in this "
            "process has lasted (0: none). One far past its tick is also logged, once, at "
            "WARNING with what it waits on; it keeps the job from the other processes.",
            ["job"], registry=self.registry)
        self.login_failures = Counter(
            "receiver_console_login_failures", "Console logins refused: wrong_password "
            "(checked), unchecked (the budget of wrong passwords was spent).", ["reason"],
            registry=self.registry)
        for reason in ("wrong_password", "unchecked"):
            self.login_failures.labels(reason)
        self.registry.register(StatementCollector())

    def jobs_scheduled(self, names: Iterable[str]) -> None:
        """Every job's series from the start, so that `absent` or a rate sees them."""
        for name in names:
            for result in JOB_RESULTS:
                self.job_runs.labels(name, result)
            self.job_last_success.labels(name)
            self.job_running_seconds.labels(name)

    def job_ran(self, name: str, result: str, at: datetime.datetime) -> None:
        self.job_runs.labels(name, result).inc()
        if result == "ok":
            self.job_last_success.labels(name).set(at.timestamp())

    def job_running(self, name: str, seconds: float) -> None:
        self.job_running_seconds.labels(name).set(seconds)

    def job_status(self) -> dict[str, tuple[float | None, int, int]]:
        """{job: (last success as a Unix time or None, runs ok, runs failed)} of this
        process, for the console."""
        last = {sample.labels["job"]: sample.value
                for sample in _samples(self.job_last_success)}
        runs = {(sample.labels["job"], sample.labels["result"]): int(sample.value)
                for sample in _samples(self.job_runs) if sample.name.endswith("_total")}
        return {job: (last[job] or None, runs.get((job, "ok"), 0), runs.get((job, "failed"), 0))
                for job in sorted(last)}

    # Each may be called in a unit of work (engine.commits), which may run twice or be
    # undone: it is counted once its changes are committed.

    def event_handled(self, event: WebhookEvent, outcome: str, seconds: float) -> None:
        on_commit(self.events.labels(event.source, event.event_type, outcome).inc)
        on_commit(functools.partial(self.handling.labels(event.source).observe, seconds))

    def event_duplicate(self, source: str, event_type: str) -> None:
        on_commit(self.events.labels(source, event_type, "duplicate").inc)

    def login_failed(self, reason: str) -> None:
        self.login_failures.labels(reason).inc()

    def effect_sent(self, kind: str, result: str) -> None:
        """An effect of `kind` (the outbox's) counted under its destination's name."""
        on_commit(self.sends.labels(DESTINATION_OF.get(kind, kind), result).inc)

    async def exposition(self, ctx: EngineContext) -> bytes:
        """The text format: our counters, then the gauges of this moment (or of the last
        computation, when it is less than `cache_seconds` old)."""
        return generate_latest(self.registry) + await self.gauges(ctx)

    async def gauges(self, ctx: EngineContext) -> bytes:
        now = ctx.clock()
        if self.state is None or not 0 <= (now - self.state[0]).total_seconds() < \
                self.cache_seconds:
            counted: list[Metric]
            try:
                counted = await ctx.db(lambda: list(database_families(ctx)))
            except UNAVAILABLE as exc:
                log.warning("metrics: database unavailable: %s", exc)
                counted = []
            now_registry = CollectorRegistry()
            now_registry.register(StateCollector(ctx, counted))
            self.state = (now, generate_latest(now_registry))
        return self.state[1]


class StatementCollector:
    """The database's own count of the statements it was asked (engine.connection.ServiceDatabase):
    read at each scrape, never cached."""

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "receiver_database_statements", "Statements sent to the database by this "
            "process, BEGIN, COMMIT and ROLLBACK included.",
            value=getattr(database.obj, "statements", 0))
        yield CounterMetricFamily(
            "receiver_database_round_trips", "Times this process waited for the "
            "database's answer: the statements, less those sent with another (on "
            "PostgreSQL a turn's BEGIN and the writes whose result is not read).",
            value=getattr(database.obj, "round_trips", 0))
        yield CounterMetricFamily(
            "receiver_database_turns", "Group-commit turns run by this process (one "
            "transaction each, shared by the units asked for meanwhile).",
            value=commits.turns_run)


class StateCollector:
    """Gauges computed at scrape time. Every query uses the (status, next_attempt_at)
    indexes; the spool is a directory listing and the first line of each file."""

    def __init__(self, ctx: EngineContext, counted: list[Metric]) -> None:
        self.ctx = ctx
        # database_families' answer, or nothing when the database did not give it.
        self.counted = counted

    def collect(self) -> Iterator[Metric]:
        database_up = GaugeMetricFamily(
            "receiver_database_up", "1 when the database answered this scrape.")
        database_up.add_metric([], 1 if self.counted else 0)
        yield database_up
        yield from self.counted
        yield from self.destination_families()
        yield from self.spool_families()

    def destination_families(self) -> Iterator[Metric]:
        """What this process has learnt of each destination (kept in its memory)."""
        up = GaugeMetricFamily(
            "receiver_destination_up", "1 while a destination answers, 0 while it is down "
            "(its effects wait; one is tried now and then); as this process sees it.",
            labels=["destination"])
        in_flight = GaugeMetricFamily(
            "receiver_destination_in_flight", "Calls to a destination in flight now.",
            labels=["destination"])
        refused = GaugeMetricFamily(
            "receiver_destination_credentials_refused", "1 while a destination refuses our "
            "credentials (its effects wait until they are fixed).", labels=["destination"])
        misconfigured = GaugeMetricFamily(
            "receiver_destination_misconfigured", "1 while a destination says our settings "
            "name what it does not have (a doctype).", labels=["destination"])
        warning = GaugeMetricFamily(
            "receiver_destination_warning", "1 while a destination's configuration check "
            "finds what leaves it in use but is to fix: workflow_read (Frappe's API user may "
            "not read Workflow, or a doctype has no active Workflow), time_zone "
            "(WORKFLOW_TIME_ZONE is not the site's).", labels=["destination", "warning"])
        for destination in self.ctx.destinations:
            found = destination.warnings
            if destination.name == "workflow":
                for what in WORKFLOW_WARNINGS:
                    warning.add_metric([destination.name, what], 1 if what in found else 0)
            up.add_metric([destination.name], 1 if destination.up else 0)
            in_flight.add_metric([destination.name], destination.in_flight)
            refused.add_metric([destination.name], 1 if destination.credentials_refused else 0)
            misconfigured.add_metric([destination.name], 1 if destination.misconfigured else 0)
        yield from (up, in_flight, refused, misconfigured, warning)

    def spool_families(self) -> Iterator[Metric]:
        files, size = spool_usage(self.ctx.settings.spool_dir)
        yield _gauge("receiver_spool_files", "Files in SPOOL_DIR (calls kept while the "
                     "database was down).", files)
        yield _gauge("receiver_spool_bytes", "Bytes in SPOOL_DIR.", size)
        yield _gauge("receiver_spool_quarantined", "Spooled calls the database refused to "
                     "store; see `receiver.py spool quarantined`.",
                     len(spool.quarantined(self.ctx.settings.spool_dir)))
        age, waiting = spool_waits(self.ctx)
        yield _gauge("receiver_spool_oldest_age_seconds", "Age of the oldest call waiting "
                     "in the spool (0 when none waits).", age)
        yield _gauge("receiver_spool_waiting_seconds", "How long calls have waited in the "
                     "spool while the database answered (0 when none waits); past "
                     "SPOOL_WAIT_LIMIT_SECONDS /readyz is not ready.", waiting)


def database_families(ctx: EngineContext) -> Iterator[Metric]:
    """The gauges the database counts. In a unit of work (ctx.db)."""
    # One (count, the earliest created_at as the database gives it) row.
    pending = cast(tuple[int, object], Outbox.select(fn.COUNT(Outbox.id),
                                                     fn.MIN(Outbox.created_at))
                   .where(Outbox.status == "pending").tuples().get())
    dead = Outbox.select().where(Outbox.status == "dead").count()
    events = operator.failures_awaiting_an_operator()
    failed, dead_events, given_up_events = events["failed"], events["dead"], events["given up"]
    backlog, oldest = pending
    yield _gauge("receiver_outbox_pending", "Effects waiting to be sent.", backlog)
    age = 0.0
    created = Outbox.created_at.python_value(oldest)
    if created is not None:
        age = max(0.0, (ctx.clock() - created).total_seconds())
    yield _gauge("receiver_outbox_oldest_pending_age_seconds",
                 "Age of the oldest effect still waiting (0 when none).", age)
    yield _gauge("receiver_outbox_dead", "Effects given up on; see `outbox list "
                 "--status dead`.", dead)
    # (kind, how many) rows: peewee's types know rows of models only.
    waiting = dict(cast(Iterable[tuple[str, int]], Outbox.select(
        Outbox.kind, fn.COUNT(Outbox.id)).where(Outbox.status == "waiting")
        .group_by(Outbox.kind).tuples()))
    family = GaugeMetricFamily(
        "receiver_outbox_waiting", "Effects waiting for their destination to be "
        "configured (sent once the service starts with it); not failures.",
        labels=["destination"])
    for kind, destination in DESTINATION_OF.items():
        family.add_metric([destination], waiting.get(kind, 0))
    yield family
    yield _gauge("receiver_events_failed", "Stored events whose handling failed and "
                 "waits for a retry.", failed)
    yield _gauge("receiver_events_dead", "Stored events their retries gave up on after "
                 "too many failures, and no operator has since; see `events replay "
                 "--failed` and `events give-up`.", dead_events)
    yield _gauge("receiver_events_given_up", "Stored events an operator gave up (dead and "
                 "final, with the reason).", given_up_events)
    held, held_since = inbox.held_count()
    yield _gauge("receiver_events_held", "Stored events waiting behind an unfinished "
                 "earlier event of their order.", held)
    yield _gauge("receiver_events_oldest_held_age_seconds", "How long the event held "
                 "longest has waited since it came (0 when none).",
                 max(0.0, (ctx.clock() - held_since).total_seconds()) if held_since else 0.0)
    reconciled = GaugeMetricFamily(
        "receiver_reconcile_last_success_timestamp_seconds", "Unix time the "
        "reconciliation with Frappe last finished for a doctype, in any process (0: "
        "never).", labels=["doctype"])
    for doctype, at in reconcile.last_successes(Transaction(ctx), ctx.settings).items():
        reconciled.add_metric([doctype], at.timestamp() if at else 0)
    yield reconciled
    failing = GaugeMetricFamily(
        "receiver_reconcile_problem", "1 while a doctype's last reconciliation run failed "
        "or found its window meeting none of Frappe's changes (/readyz says why).",
        labels=["doctype"])
    found = reconcile.problems(Transaction(ctx), ctx.settings)
    for doctype in reconcile.last_successes(Transaction(ctx), ctx.settings):
        failing.add_metric([doctype], 1 if doctype in found else 0)
    yield failing


def _samples(metric: MetricWrapperBase) -> list[Sample]:
    return [sample for family in metric.collect() for sample in family.samples]


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def spool_waits(ctx: EngineContext) -> tuple[float, float]:
    """(the oldest spooled call's age, how long calls have waited in the spool while the
    database answered), in seconds; (0, 0) when none waits. The second counts from the
    later of the oldest call's arrival and the database's return as this process last
    found it (`Circuit.answering_for`): a spool left by an outage is on its way once the
    database is back (the drain starts at once), one that outlasts it is stuck."""
    oldest = oldest_spooled_at(ctx.settings.spool_dir)
    if oldest is None:
        return 0.0, 0.0
    age = max(0.0, (ctx.clock() - oldest).total_seconds())
    circuit = getattr(database.obj, "circuit", None)
    return age, age if circuit is None else min(age, circuit.answering_for())


def oldest_spooled_at(folder: str) -> datetime.datetime | None:
    """When the oldest call waiting in the spool came (in the live file or a file being
    drained), or None when none waits. A file's calls are appended as they come, so its
    first readable line is its oldest (engine.spool's lines)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    came = [_first_call_at(os.path.join(folder, name)) for name in names
            if name == spool.LIVE_NAME or name.endswith(spool.DRAINING_SUFFIX)]
    return min((at for at in came if at is not None), default=None)


# Lines of a file read for its first readable call at most: one that cannot be read is
# quarantined by the drain, and a file of them is not worth reading whole here.
FIRST_LINES_READ = 10


def _first_call_at(path: str) -> datetime.datetime | None:
    try:
        with open(path, "rb") as lines:
            for line in itertools.islice(lines, FIRST_LINES_READ):
                try:
                    return datetime.datetime.fromisoformat(
                        json.loads(line)["received_at"]).astimezone(UTC)
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError:  # drained and deleted while we looked
        return None
    return None


def spool_usage(folder: str) -> tuple[int, int]:
    """(files, bytes) under `folder`; a missing folder is an empty spool."""
    files = size = 0
    for root, _dirs, names in os.walk(folder):
        for name in names:
            try:
                size += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # drained while we looked
                continue
            files += 1
    return files, size
