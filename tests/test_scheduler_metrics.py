"""A scheduled job's runs and its last success show on /metrics of the real app, so a
job that keeps failing is seen without reading the log; a stop does not wait for a job
beyond its grace."""
import asyncio
import dataclasses
import os
import re
import time
import urllib.parse

import psycopg2
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler import JOBS_BY_NAME, STOP_GRACE_SECONDS, Job, Scheduler
from tests.console_helpers import Operator, console_settings, text
from tests.frappe_site import FrappeSite
from tests.ops_helpers import ROOT
from tests.service_process import postgres_only
from tests.waits import eventually


async def broken(ctx):
    raise RuntimeError("the job broke")


BROKEN = Job("broken", broken, lambda s: 3600)


@pytest.fixture
def settings(settings):
    """With the console on: it shows the jobs' runs too."""
    return console_settings(settings)


def samples(body):
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples}


def runs(found, job, result):
    return found.get(("receiver_job_runs_total", frozenset({"job": job, "result": result}.items())))


def last_success(found, job):
    return found.get(("receiver_job_last_success_timestamp_seconds",
                      frozenset({"job": job}.items())))


@pytest.mark.gen_test
async def test_job_runs_and_last_success_show_on_metrics(http_server, base_url, client, ctx,
                                                         clock):
    spool = JOBS_BY_NAME["spool"]
    scheduler = Scheduler(ctx, jobs=(spool, BROKEN))  # not started: runs are called here
    found = samples((await client.fetch(base_url + "/metrics")).body)
    assert runs(found, "broken", "failed") == 0 and last_success(found, "broken") == 0

    clock.set(2026, 11, 20, 9, 0, 0)
    await scheduler.run(spool)
    await scheduler.run(BROKEN)
    await scheduler.run(BROKEN)
    found = samples((await client.fetch(base_url + "/metrics")).body)
    assert runs(found, "spool", "ok") == 1 and runs(found, "spool", "failed") == 0
    assert last_success(found, "spool") == clock().timestamp()
    assert runs(found, "broken", "failed") == 2 and runs(found, "broken", "ok") == 0
    assert last_success(found, "broken") == 0


@postgres_only
@pytest.mark.gen_test
async def test_a_run_another_process_holds_counts_as_skipped(ctx, database_url):
    retry = JOBS_BY_NAME["inbox"]
    parts = urllib.parse.urlsplit(database_url)
    other = psycopg2.connect(host=parts.hostname, port=parts.port or 5432,
                             user=parts.username, dbname=parts.path.lstrip("/"))
    try:
        other.cursor().execute("SELECT pg_advisory_lock(%s)", (retry.lock_id,))
        other.commit()
        await Scheduler(ctx, jobs=(retry,)).run(retry)
    finally:
        other.close()
    found = samples(generate_latest(ctx.metrics.registry))
    assert runs(found, "inbox", "skipped") == 1 and runs(found, "inbox", "ok") == 0


def running_seconds(found, job):
    return found.get(("receiver_job_running_seconds", frozenset({"job": job}.items())))


@pytest.mark.gen_test(timeout=30)
async def test_a_run_far_past_its_tick_is_warned_of_once_with_where_it_waits(
        http_server, base_url, client, ctx, clock, caplog):
    """A run that does not end (here: waiting for what never comes) keeps its job's lock
    from the other processes, which only skip it: it is warned of, once, after ten of its
    ticks, with where it waits, and its time shows on /metrics. A job whose runs drain
    a backlog (the outbox sender) is not warned of."""
    go_on = asyncio.Event()

    async def waits(ctx):
        await go_on.wait()  # a unit whose turn never comes, say: the behaviour under test

    stuck = Job("stuck", waits, lambda s: 10)
    draining = Job("draining", waits, lambda s: 10, drains=True)
    scheduler = Scheduler(ctx, jobs=(stuck, draining))
    clock.set(2026, 11, 20, 9, 0, 0)
    underway = [asyncio.ensure_future(scheduler.run(job)) for job in (stuck, draining)]
    await eventually(lambda: len(scheduler.runs) == 2, interval=0.01)
    clock.advance(seconds=99)
    scheduler.look_at_runs()
    assert "has run for" not in caplog.text
    clock.advance(seconds=1)
    scheduler.look_at_runs()
    scheduler.look_at_runs()
    [warning] = [record for record in caplog.records if "has run for" in record.getMessage()]
    said = warning.getMessage()
    assert warning.levelname == "WARNING" and said.startswith(
        "job stuck has run for 100 s (it runs every 10 s)")
    # The run's own coroutine, then the one it awaits: where it waits, line by line.
    assert said.split("it waits on: ")[1].startswith(
        "Scheduler.run (scheduler.py:"), said
    assert (f"waits (tests/test_scheduler_metrics.py:{waits.__code__.co_firstlineno + 1})"
            " > Event.wait (asyncio/locks.py:") in said, said
    found = samples((await client.fetch(base_url + "/metrics")).body)
    assert running_seconds(found, "stuck") == running_seconds(found, "draining") == 100

    go_on.set()
    await asyncio.gather(*underway)
    found = samples((await client.fetch(base_url + "/metrics")).body)
    assert running_seconds(found, "stuck") == running_seconds(found, "draining") == 0


@pytest.mark.gen_test(timeout=30)
async def test_stop_cancels_a_run_still_busy_after_its_grace(ctx, caplog):
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def endless(ctx):
        started.set()
        try:
            await asyncio.sleep(3600)  # a pass through a long backlog, say: never ends
        except asyncio.CancelledError:
            cancelled.set()
            raise

    scheduler = Scheduler(ctx, jobs=())
    run = asyncio.ensure_future(scheduler.run(Job("endless", endless, lambda s: 3600)))
    await started.wait()
    began = time.monotonic()
    await scheduler.stop(grace=0.5)
    assert 0.4 < time.monotonic() - began < 3
    assert cancelled.is_set() and run.cancelled()
    assert "1 job run(s) still busy after 0.5 s; cancelling them" in caplog.text
    assert not scheduler.in_progress


@pytest.mark.gen_test(timeout=30)
async def test_stop_waits_for_a_run_that_ends_within_its_grace(ctx):
    async def short(ctx):
        await asyncio.sleep(0.3)  # a run still busy as the stop begins: the behaviour
        return "done"

    scheduler = Scheduler(ctx, jobs=())
    run = asyncio.ensure_future(scheduler.run(Job("short", short, lambda s: 3600)))
    await eventually(lambda: scheduler.in_progress, interval=0.01)
    await scheduler.stop(grace=5)
    assert run.done() and run.result() == "done"


def test_the_stop_ends_before_systemd_kills_the_service():
    from app.server import SHUTDOWN_GRACE_SECONDS
    unit = open(os.path.join(ROOT, "deploy", "receiver.service"), encoding="utf-8").read()
    timeout_stop = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.MULTILINE).group(1))
    assert SHUTDOWN_GRACE_SECONDS + STOP_GRACE_SECONDS < timeout_stop


@pytest.mark.gen_test(timeout=30)
async def test_stop_gives_a_run_apscheduler_started_its_grace_too(ctx):
    """APScheduler's own shutdown cancels the runs it started at once: the stop pauses it
    first, and shuts it down only once the runs are done or their grace is over."""
    ended = asyncio.Event()

    async def short(ctx):
        await asyncio.sleep(0.3)  # a run still busy as the stop begins: the behaviour
        ended.set()

    scheduler = Scheduler(ctx, jobs=(Job("short", short, lambda s: 3600),))
    await scheduler.start()  # runs it at once
    await eventually(lambda: scheduler.running_jobs, interval=0.01)
    await scheduler.stop(grace=5)
    assert ended.is_set() and not scheduler.running


@pytest.mark.gen_test(timeout=30)
async def test_a_reconciliation_frappe_refuses_counts_as_failed_on_metrics_and_the_console(
        http_server, base_url, client, ctx):
    """Frappe refusing our list calls (here: our API key) leaves the run without its work:
    counted failed, as a run that raised, not ok."""
    site = FrappeSite({"Formation Order": ["order_number"], "CRTC Order": ["order_number"]})
    try:
        ctx.settings = ctx.workflow.settings = dataclasses.replace(
            ctx.settings, workflow_url=site.url, workflow_api_key="wrong")
        reconcile = JOBS_BY_NAME["reconcile"]
        await Scheduler(ctx, jobs=(reconcile,)).run(reconcile)
    finally:
        site.stop()
    found = samples((await client.fetch(base_url + "/metrics")).body)
    assert runs(found, "reconcile", "failed") == 1 and runs(found, "reconcile", "ok") == 0
    assert last_success(found, "reconcile") == 0
    operator = Operator(client, base_url)
    await operator.log_in()
    page = text(await operator.get("/console/")).split("Scheduled jobs", 1)[1]
    row = " ".join(re.sub(r"<[^>]+>", " ", page.split("reconcile", 1)[1].split("</tr>")[0])
                   .split())
    assert row == "Last success: never Runs ok: 0 Runs failed: 1"
