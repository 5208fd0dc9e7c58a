"""For the operator and their monitoring: liveness, readiness and Prometheus metrics.

None of them needs a secret and none of them shows one: they say what is wrong in words
an operator can act on (which part is down), never a connection string."""
import asyncio
import logging
import os
from typing import Any

import tornado.web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from engine import lograte
from handlers.base import ApiHandler, same_secret
from handlers.context import HandlerContext
from domain import reconcile
from models import database
from engine import spool
from engine.commits import set_budget
from engine.db import why_unavailable
from engine.transaction import Transaction
from ops.metrics import spool_waits

log = logging.getLogger("receiver.ops")
REPEATS = lograte.Repeats(log)

# Within a load balancer's usual probe timeout, above the database's own bound (1 s).
READY_TIMEOUT_SECONDS = 2


class HealthHandler(ApiHandler):
    """The process is up and its event loop answers."""

    def get(self) -> None:
        self.answer(200, {"status": "ok"})

    head = get


class ReadyHandler(ApiHandler):
    """Ready to take webhooks: the database answers, the scheduler runs, the spool
    (where calls go while the database is down) can be written, and no call has waited
    in it past SPOOL_WAIT_LIMIT_SECONDS with the database answering. The destinations'
    health is told too, but does not make the service unready: webhooks are still
    accepted, and their effects wait."""

    async def get(self) -> None:
        checks = {"database": await self.database_check(),
                  "scheduler": self.scheduler_check(), "spool": self.spool_check()}
        age, waiting = spool_waits(self.ctx)
        # Calls that wait with the database answering are stuck: the drain runs at every
        # tick and as soon as the database is back. With the database down, its own
        # check says so.
        checks["spool_drain"] = ("behind" if checks["database"] == "ok"
                                 and waiting > self.ctx.settings.spool_wait_limit_seconds
                                 else "ok")
        # The destinations' configuration (Frappe's credentials and doctypes): asked at
        # most every CHECK_SECONDS, waited for only briefly.
        await self.ctx.destinations.check(within=READY_TIMEOUT_SECONDS)
        problems = {name: problem for name, problem in checks.items() if problem != "ok"}
        status = 503 if problems else 200
        body: dict[str, Any] = {
            "status": "ready" if not problems else "not ready", "checks": checks,
            "destinations": {destination.name: destination.state
                             for destination in self.ctx.destinations}}
        misconfigured = {destination.name: destination.problem
                         for destination in self.ctx.destinations if destination.problem}
        if misconfigured:
            body["destination_problems"] = misconfigured
        # What the check found that leaves the destination in use but is to fix (Frappe:
        # the Workflow read permission, the time zone): not a reason to be unready.
        warnings = {destination.name: destination.warnings
                    for destination in self.ctx.destinations if destination.warnings}
        if warnings:
            body["destination_warnings"] = warnings
        # Calls the database refused: worth an operator's look, no reason to take this
        # process out of service.
        quarantined = len(spool.quarantined(self.ctx.settings.spool_dir))
        if quarantined:
            body["spool_quarantined"] = quarantined
        if age:
            body["spool_oldest_seconds"] = round(age)
        if checks["database"] == "ok":
            # When reconciliation with Frappe last finished, per doctype (null: never).
            # And why a doctype's last run failed, or what a finished one found wrong
            # (its window met none of Frappe's changes): runs that say nothing are not
            # enough. One unit, one turn.
            settings = self.ctx.settings
            tx = Transaction(self.ctx)
            last, found = await self.ctx.db(lambda: (reconcile.last_successes(tx, settings),
                                                     reconcile.problems(tx, settings)))
            body["reconciled"] = {doctype: at.isoformat() if at else None
                                  for doctype, at in last.items()}
            if found:
                body["reconcile_problems"] = found
        self.answer(status, body)

    head = get

    async def database_check(self) -> str:
        """A database known to be down is unreachable at once; otherwise a connection of
        the probe's own must take a write, in a thread, within READY_TIMEOUT_SECONDS: the
        loop never waits on it, and a frozen database is reported as such in time. A
        probe every few seconds during an outage: one line, then a count."""
        db = database.obj
        if db.circuit is not None and db.circuit.is_open:
            return f"unreachable; {db.circuit.held_for}" if db.circuit.held_for else "unreachable"
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, db.probe),
                                   READY_TIMEOUT_SECONDS)
        except asyncio.TimeoutError:
            REPEATS.warning("unavailable", "readiness: database unavailable: no answer in "
                            "%s s", READY_TIMEOUT_SECONDS)
            return "unreachable"
        except Exception as exc:  # whatever the driver raises, it is not ready
            REPEATS.warning("unavailable", "readiness: database unavailable: %s",
                            why_unavailable(exc))
            return "unreachable"
        return "ok"

    def spool_check(self) -> str:
        """Cheap enough for every probe: no file is written; the directory, its
        permissions and the room left on its filesystem are looked at. "full" when there
        is no room for two of the largest calls (MAX_BODY_BYTES each) or no inode left:
        the spool would refuse the next call, and with the database down every call
        would be answered 503."""
        folder = self.ctx.settings.spool_dir
        if not os.path.isdir(folder):
            return "not a directory" if os.path.exists(folder) else "missing"
        if not os.access(folder, os.W_OK | os.X_OK):
            return "not writable"
        room = os.statvfs(folder)
        # A filesystem without an inode count (btrfs) says 0 of 0.
        no_inodes = room.f_files > 0 and room.f_favail == 0
        if no_inodes or room.f_bavail * room.f_frsize < 2 * self.ctx.settings.max_body_bytes:
            return "full"
        return "ok"

    def scheduler_check(self) -> str:
        scheduler = self.ctx.scheduler
        if scheduler is None:
            return "not started"
        return "ok" if scheduler.running else "stopped"


class MetricsHandler(tornado.web.RequestHandler):
    """Prometheus text format; the gauges come from indexed queries, run at most every
    METRICS_CACHE_SECONDS. With METRICS_TOKEN set, only a scraper that sends it as a
    bearer token (Prometheus: `authorization: {credentials: ...}`) is answered."""

    def initialize(self, ctx: HandlerContext) -> None:
        self.ctx = ctx

    def prepare(self) -> None:
        set_budget(self.ctx.settings.database_call_budget_seconds)
        token = self.ctx.settings.metrics_token
        if not token:
            return
        scheme, _, given = self.request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not same_secret(given.strip(), token):
            self.set_status(401)
            self.set_header("WWW-Authenticate", 'Bearer realm="metrics"')
            self.finish("unauthorized\n")

    async def get(self) -> None:
        # The classic text format: every Prometheus version (and most agents) reads it.
        self.set_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.set_header("Cache-Control", "no-store")
        self.finish(await self.ctx.metrics.exposition(self.ctx))
