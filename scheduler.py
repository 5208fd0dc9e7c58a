"""The periodic work, run in-process by APScheduler on the service's event loop.

Every SCHEDULER_TICK_SECONDS: send due outbox rows, retry due inbox events, drain the
spool. Every hour: reminders, the commission holdback's releases and pruning. Every
SETTLEMENT_INTERVAL_MINUTES (and once at start): the settlement fallback. Every
WORKFLOW_RECONCILE_MINUTES (and once at start): the reconciliation with Frappe.

Several processes may share one PostgreSQL: each run of a job first takes a
PostgreSQL advisory lock named after the job, and a process that does not get it skips
that run, so a job runs in one process at a time. On SQLite one process is assumed.
A run that lasts far longer than its job's interval is warned of, once, with where it
waits (`look_at_runs`), and each run's time so far is on /metrics: a stuck run keeps its
lock, and the other processes skip the job meanwhile. A run that stops with work left
(`Job.again`: the inbox retry's full batch) is followed by the next at once.
The spool drain takes none: each process drains its own spool, whatever another holds
(processes that share a SPOOL_DIR on one host take each file in turn, under its flock:
engine.spool). A lock is taken and given back in a thread of its own, on a session of
its own (`AdvisoryLock`), so a database that stops answering holds that thread, never
the loop.
"""
import asyncio
import concurrent.futures
import dataclasses
import datetime
import logging
import os
import zlib
from typing import Any, Awaitable, Callable, Protocol, Sequence

import psycopg2
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from engine import lograte
from models import UTC, database, is_postgres
from engine.errors import DatabaseDown
from domain import holdback, reconcile, reminders
from engine import inbox, outbox, retention
from engine.commits import budget
from engine.contracts import EngineContext
from engine.db import UNAVAILABLE, why_unavailable
from ops.metrics import Metrics
from settings import Settings

log = logging.getLogger("receiver.scheduler")
REPEATS = lograte.Repeats(log)

HOURLY = 3600
# A run lasting this many of its job's intervals, and LONG_RUN_SECONDS at least, is warned
# of once, with what it waits on: that far past its tick it is most likely stuck, and it
# keeps its lock meanwhile, so the other processes skip the job (said only at DEBUG).
LONG_RUN_TICKS = 10
LONG_RUN_SECONDS = 60
# How often the runs under way are looked at (their time on /metrics, a long one warned).
WATCH_EVERY_SECONDS = 1.0
ROOT = os.path.dirname(os.path.abspath(__file__))
# How long a stop waits for job runs in progress before cancelling them, at most: less
# when the requests in flight took most of the stop budget (app.server, STOP_TIMEOUT_SECONDS).
STOP_GRACE_SECONDS = 5


class SchedulerContext(EngineContext, Protocol):
    """What the scheduler asks of the context (app.context.Context): the engine's, and the
    metrics that count its jobs' runs."""
    metrics: Metrics


async def settle(ctx: SchedulerContext) -> Any:
    from domain.settlement import settle_crtc_orders
    from engine.transaction import Transaction
    return await settle_crtc_orders(ctx, Transaction(ctx, by="the settlement job"))


async def prune(ctx: SchedulerContext) -> tuple[int, int]:
    # In the database thread, in bounded batches: on SQLite a long delete would hold the
    # write lock the request path's turns wait for.
    return await retention.prune_all(ctx)


def nothing_refused(result: object) -> bool:
    return False


def never_again(result: object) -> bool:
    return False


def frappe_refused(counts: reconcile.Counts) -> bool:
    """A reconciliation run Frappe did not answer or refused (a doctype not listed) ran
    to its end without doing its work: a failed run to the console and /metrics."""
    return bool(counts.failed)


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    # A run's result is the job's own (counts, a number of rows...).
    run: Callable[[SchedulerContext], Awaitable[Any]]
    # Seconds between runs; 0: never.
    every: Callable[[Settings], float]
    at_start: bool = True
    # Runs in one process at a time (its advisory lock); False: in each process.
    one_process: bool = True
    # Whether a run that returned `result` was refused by what it depends on: counted
    # failed, as a run that raised.
    refused: Callable[[Any], bool] = nothing_refused
    # Whether a run that returned `result` stopped with work left due (a whole batch
    # done): the next run follows at once, not a tick later.
    again: Callable[[Any], bool] = never_again
    # A run goes on while work is due (a backlog sent in one run): a long one is its way,
    # shown on /metrics but not warned of.
    drains: bool = False

    @property
    def lock_id(self) -> int:
        return zlib.crc32(f"receiver.job.{self.name}".encode())


JOBS = (
    Job("outbox", outbox.send_due, lambda s: s.scheduler_tick_seconds, drains=True),
    # A run hands each stream's held events over behind its first: a backlog held behind
    # a cut drains in one run, for as long as it takes.
    Job("inbox", inbox.retry_due, lambda s: s.scheduler_tick_seconds,
        again=inbox.stopped_at_its_batch, drains=True),
    Job("spool", inbox.drain_spool, lambda s: s.scheduler_tick_seconds, one_process=False),
    Job("settlement", settle, lambda s: 60 * s.settlement_interval_minutes),
    Job("reminders", reminders.send_reminders, lambda s: HOURLY),
    Job("holdback", holdback.release_due, lambda s: HOURLY),
    Job("retention", prune, lambda s: HOURLY, at_start=False),
    Job("reconcile", reconcile.reconcile_workflow,
        lambda s: 60 * s.workflow_reconcile_minutes, refused=frappe_refused),
)
JOBS_BY_NAME = {job.name: job for job in JOBS}


LOCK_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="job-locks")


class AdvisoryLock:
    """A PostgreSQL session-level advisory lock, taken without waiting; on SQLite the one
    process always has it.

    Each lock has a session of its own (`session_apart`: outside the circuit), opened to
    take it and closed once it is given back. A database known to be down is not asked
    for it (the circuit is open: DatabaseDown, as any statement would raise). Giving it
    back goes to its session whatever the circuit says: a circuit opened meanwhile (a
    short false alarm somewhere in the process) must not leave the lock with a session
    that lives on, which would keep the job from every other process for as long as this
    one lives. The session is closed whether the unlock went through or not: the server
    then ends it, and the lock with it."""

    def __init__(self, lock_id: int) -> None:
        self.lock_id = lock_id
        self.session: Any = None

    async def acquire(self) -> bool:
        if not is_postgres():
            return True
        circuit = database.obj.circuit
        if circuit is not None and circuit.is_open:
            raise DatabaseDown(f"the database is down ({circuit.reason}); not tried until "
                               "a probe finds it back")
        try:
            return await asyncio.get_running_loop().run_in_executor(LOCK_THREAD, self._take)
        except asyncio.CancelledError:
            # The thread takes it all the same: given back after, in the same thread.
            LOCK_THREAD.submit(self._give_back)
            raise

    async def release(self) -> None:
        if self.session is not None:
            await asyncio.get_running_loop().run_in_executor(LOCK_THREAD, self._give_back)

    def _take(self) -> bool:
        try:
            self.session = database.obj.session_apart()
            cursor = self.session.cursor()
            cursor.execute("SELECT pg_try_advisory_lock(%s)", (self.lock_id,))
            taken = bool(cursor.fetchone()[0])
        except psycopg2.Error as failure:
            self._close()
            raise DatabaseDown(why_unavailable(failure)) from failure
        if not taken:
            self._close()
        return taken

    def _give_back(self) -> None:
        if self.session is None:
            return
        try:
            self.session.cursor().execute("SELECT pg_advisory_unlock(%s)", (self.lock_id,))
        except psycopg2.Error as failure:
            log.debug("lock %s not given back, its session is closed instead: %s",
                      self.lock_id, why_unavailable(failure))
        finally:
            self._close()

    def _close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()


def waiting_on(task: "asyncio.Task[Any]") -> str:
    """Where a task waits: each coroutine of its chain of awaits, the outermost first,
    with its file and line (the innermost is what it waits on: a unit of work for its
    turn, a send, a lock)."""
    steps = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
        if frame is None:
            break  # a future, or a generator's iterator: the chain ends in what it awaits
        path = frame.f_code.co_filename
        # The service's files by their place in it, a library's by its last two parts.
        where = os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else \
            os.path.join(*path.split(os.sep)[-2:])
        steps.append(f"{frame.f_code.co_qualname} ({where}:{frame.f_lineno})")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
    return " > ".join(steps) or "nothing: it is not suspended"


def _still_running(record: logging.LogRecord) -> bool:
    """APScheduler warns of every tick that finds the job's last run still going on. The
    outbox's run lasts as long as a backlog drains, on purpose: not worth a warning."""
    message = record.getMessage()
    return not (message.startswith('Execution of job "outbox ')
                and "maximum number of running instances reached" in message)


class Scheduler:
    def __init__(self, ctx: SchedulerContext, jobs: Sequence[Job] = JOBS) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self.apscheduler = AsyncIOScheduler(timezone=UTC)
        self.in_progress: set[asyncio.Task[Any]] = set()
        self.running_jobs: set[str] = set()
        # Jobs asked to run while a run of theirs went on (`run_soon`).
        self.run_again: set[str] = set()
        # The runs under way: each job's task and when it began (the context's clock),
        # and those warned of already (`look_at_runs`).
        self.runs: dict[str, tuple[asyncio.Task[Any], datetime.datetime]] = {}
        self.warned: set[str] = set()
        self.watching: asyncio.Task[None] | None = None
        ctx.metrics.jobs_scheduled(job.name for job in jobs)

    @property
    def running(self) -> bool:
        """For /readyz: the jobs are scheduled and will run."""
        return self.apscheduler.running

    async def start(self) -> None:
        """Drain the spool left by an earlier run, then schedule every job."""
        await self.run(JOBS_BY_NAME["spool"])
        now = datetime.datetime.now(UTC)
        for job in self.jobs:
            if not job.every(self.ctx.settings):
                continue  # turned off (WORKFLOW_RECONCILE_MINUTES=0)
            self.apscheduler.add_job(
                self._scheduled_run, IntervalTrigger(seconds=job.every(self.ctx.settings)), args=[job],
                id=job.name, name=job.name, max_instances=1, coalesce=True,
                misfire_grace_time=None,
                next_run_time=now if job.at_start else None)
        # APScheduler logs every run at INFO; a run that fails is logged by `run` itself.
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
        logging.getLogger("apscheduler.scheduler").addFilter(_still_running)
        self.apscheduler.start()
        # A destination back after an outage: its backlog goes now, not at the next tick
        # (asked from the send that found it back, so after that send is done).
        if "outbox" in {job.name for job in self.jobs}:
            loop = asyncio.get_running_loop()

            def send_the_backlog() -> None:
                loop.call_soon(self.run_soon, "outbox")
            self.ctx.destinations.when_recovered(send_the_backlog)
        self.watching = asyncio.create_task(self._watch())
        log.info("scheduler started: %s", ", ".join(job.name for job in self.jobs))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY_SECONDS)
            self.look_at_runs()

    def look_at_runs(self) -> None:
        """Each job's run under way, for how long (/metrics); one that has lasted far
        longer than its tick (LONG_RUN_TICKS, LONG_RUN_SECONDS) warned of, once, with
        where it waits, unless its job `drains`."""
        now = self.ctx.clock()
        for job in self.jobs:
            under_way = self.runs.get(job.name)
            seconds = 0.0 if under_way is None else (now - under_way[1]).total_seconds()
            self.ctx.metrics.job_running(job.name, seconds)
            if under_way is None or job.drains or job.name in self.warned:
                continue
            every = job.every(self.ctx.settings)
            if seconds >= max(LONG_RUN_SECONDS, LONG_RUN_TICKS * every):
                self.warned.add(job.name)
                kept_from = ("; the other processes skip it meanwhile"
                             if job.one_process and is_postgres() else "")
                log.warning("job %s has run for %d s (it runs every %g s)%s; it waits on: "
                            "%s", job.name, seconds, every, kept_from,
                            waiting_on(under_way[0]))

    def run_soon(self, name: str) -> None:
        """Run job `name` now; when a run of it is going on, once more as soon as that run
        has ended: it may have looked for its work before this work came (a call made due
        after the inbox retry claimed what was due)."""
        if not self.apscheduler.running:
            return
        if name in self.running_jobs:
            self.run_again.add(name)
            return
        self.apscheduler.modify_job(name, next_run_time=datetime.datetime.now(UTC))

    async def _scheduled_run(self, job: Job) -> Any:
        """`run`, as APScheduler starts it in a task of its own: a run asked for while it
        went on (`run_soon`), or one the job asks for by what this one returned
        (`Job.again`), follows once APScheduler counts this one ended, after its own
        callback on the task (sooner, it would refuse it as a second instance)."""
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        task.add_done_callback(lambda _: loop.call_soon(self._after_run, job.name))
        result = await self.run(job)
        if result is not None and job.again(result):
            self.run_again.add(job.name)
        return result

    def _after_run(self, name: str) -> None:
        """A run of job `name` has ended and APScheduler counts it ended: the run asked for
        meanwhile (`run_soon`) is due now."""
        if name in self.run_again:
            self.run_again.discard(name)
            self.run_soon(name)

    async def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """No new runs; wait up to `grace` seconds for the runs in progress, then cancel
        those left (a long outbox pass, say). Cancelling is safe: what a run had claimed
        stays leased, and a later run, here or in another process, takes it after the
        lease, as after a crash; each effect keeps its idempotency key.

        Paused first, shut down last: APScheduler's shutdown cancels the runs in progress
        at once, which would leave no grace at all."""
        if self.watching is not None:
            self.watching.cancel()
            await asyncio.gather(self.watching, return_exceptions=True)
        if self.apscheduler.running:
            self.apscheduler.pause()
        if self.in_progress:
            _done, left = await asyncio.wait(set(self.in_progress), timeout=grace)
            if left:
                log.warning("stopping: %d job run(s) still busy after %s s; cancelling "
                            "them", len(left), grace)
                for task in left:
                    task.cancel()
                await asyncio.gather(*left, return_exceptions=True)
        if self.apscheduler.running:
            self.apscheduler.shutdown(wait=False)
        while self.apscheduler.running:  # AsyncIOScheduler shuts down on the next loop turn
            await asyncio.sleep(0.01)

    async def run(self, job: Job) -> Any:
        """One run of `job` if this process gets its lock; returns the job's result, or
        None when skipped or failed (a failure is logged, once for a failure repeating
        at every tick; the next run tries again)."""
        lograte.flush_all()
        task = asyncio.current_task()
        assert task is not None  # a coroutine the loop runs is in a task
        self.in_progress.add(task)
        self.running_jobs.add(job.name)
        self.runs[job.name] = (task, self.ctx.clock())
        try:
            # Never a call's budget, though a run asked for by a call (`run_soon`) starts
            # in a copy of that call's context.
            with budget(None):
                return await self._run_locked(job)
        finally:
            self.in_progress.discard(task)
            self.running_jobs.discard(job.name)
            self.runs.pop(job.name, None)
            self.warned.discard(job.name)
            self.ctx.metrics.job_running(job.name, 0.0)

    async def _run_locked(self, job: Job) -> Any:
        lock = AdvisoryLock(job.lock_id)
        try:
            if job.one_process and not await lock.acquire():
                log.debug("job %s skipped: running in another process", job.name)
                self.ctx.metrics.job_ran(job.name, "skipped", self.ctx.clock())
                return None
        except UNAVAILABLE as exc:
            REPEATS.warning(("unavailable", job.name), "job %s skipped, the database is "
                            "unavailable: %s", job.name, why_unavailable(exc))
            # Not done, and not done elsewhere either: a failure to the operator.
            self.ctx.metrics.job_ran(job.name, "failed", self.ctx.clock())
            return None
        try:
            result = await job.run(self.ctx)
            self.ctx.metrics.job_ran(job.name, "failed" if job.refused(result) else "ok",
                                     self.ctx.clock())
            return result
        except UNAVAILABLE as exc:
            REPEATS.warning(("unavailable", job.name), "job %s stopped, the database is "
                            "unavailable: %s", job.name, why_unavailable(exc))
        except Exception as exc:
            REPEATS.exception((job.name, *lograte.key_of(exc)), "job %s failed", job.name)
        finally:
            await lock.release()
        self.ctx.metrics.job_ran(job.name, "failed", self.ctx.clock())
        return None
