"""A database that is slow rather than down: it answers everything, each reply late but
within the per-statement bound (DATABASE_TIMEOUT_MS), so no statement fails. A call's
time on the database is bounded as a whole (DATABASE_CALL_BUDGET_SECONDS): past it a
webhook is spooled and a page answers 503, the circuit opens, and the loop answers
/healthz all along."""
import asyncio
import contextlib
import dataclasses
import glob
import os
import sqlite3
import threading
import time
import urllib.parse

import pytest

from models import ReferralCode, WebhookEvent, database, is_postgres
from engine.connection import BoundedWaits, open_database
from engine import inbox, outbox
from engine.db import Circuit
from tests.conftest import WEBHOOK_SECRET
from tests.service_process import TcpProxy
from tests.waits import eventually

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
JSON = {"Content-Type": "application/json"}
# Every reply this late: under the 1 s per-statement bound, over the test's call budget.
REPLY_DELAY_SECONDS = 0.7
CALL_BUDGET_SECONDS = 0.5


@pytest.fixture
def settings(settings):
    return dataclasses.replace(settings, database_call_budget_seconds=CALL_BUDGET_SECONDS)


class SlowSqlite:
    """Another connection holds SQLite's write lock for `seconds` at a time, letting it
    go for a moment in between: every transaction of the service waits up to that long
    for its turn, and gets it, within the busy timeout."""

    def __init__(self, path):
        self.path = path
        self.stopped = threading.Event()
        self.holding = threading.Event()
        self.thread = None

    def slow(self, seconds):
        """Returns once the lock is held: a call made right after waits for it (a
        thread slow to start, on a loaded machine, would let the call through first)."""
        self.stop()
        if not seconds:
            return
        self.stopped.clear()
        self.holding.clear()
        self.thread = threading.Thread(target=self._hold, args=(seconds,), daemon=True)
        self.thread.start()
        assert self.holding.wait(5), "the lock was not taken within 5 s"

    def _hold(self, seconds):
        connection = sqlite3.connect(self.path, isolation_level=None)
        try:
            while not self.stopped.is_set():
                connection.execute("BEGIN IMMEDIATE")
                self.holding.set()
                self.stopped.wait(seconds)
                connection.execute("ROLLBACK")
                time.sleep(0.05)  # a gap between holds, in which waiting calls get in
        finally:
            connection.close()

    def stop(self):
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()


@pytest.fixture
def slow_database(db, database_url):
    """`slow(seconds)` makes the database answer that late (PostgreSQL behind a proxy
    with DATABASE_TIMEOUT_MS=1000; SQLite behind a lock taken and given back);
    `slow(0)` ends it."""
    if is_postgres(db):
        proxy, proxied_url = TcpProxy.in_front_of(database_url)
        bound = BoundedWaits.seconds
        open_database(proxied_url, timeout_ms=1000)
        yield proxy
        proxy.close()
        BoundedWaits.seconds = bound
        database.initialize(db)
    else:
        slow = SlowSqlite(urllib.parse.urlsplit(database_url).path)
        yield slow
        slow.stop()


@contextlib.asynccontextmanager
async def attached_circuit():
    circuit = Circuit(database.obj, interval=0.2)
    circuit.attach()
    try:
        yield circuit
    finally:
        await circuit.detach()


def spooled(ctx):
    lines = 0
    for path in glob.glob(os.path.join(ctx.settings.spool_dir, "*")):
        with open(path, encoding="utf-8") as handle:
            lines += sum(1 for _ in handle)
    return lines


def submitted(number):
    return {"order_name": f"ORD-{number}", "order_number": f"FO-{number}",
            "state_code": "WY", "entity_name": f"Acme {number} LLC"}


@pytest.mark.gen_test(timeout=60)
async def test_a_webhook_past_its_budget_on_a_slow_database_is_spooled_and_handled_once(
        post, ctx, clock, slow_database, worker):
    async with attached_circuit() as circuit:
        slow_database.slow(REPLY_DELAY_SECONDS)
        status, body, _ = await post("/api/v1/webhooks/formation/submitted", submitted(1),
                                     AUTH)
        assert status == 200 and body["received"]
        assert spooled(ctx) == 1
        assert circuit.is_open and "budget" in circuit.reason

        slow_database.slow(0)
        await eventually(lambda: not circuit.is_open, timeout=30)
    await inbox.drain_spool(ctx)
    # Stored once, whether the unit that overran its budget committed in the end (its
    # job is then sent by the scheduled sender, one lease later) or never ran (the drain
    # handles the spooled copy); its job sent once either way.
    assert WebhookEvent.select().count() == 1
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)
    await outbox.send_due(ctx)
    assert [r.json["action"] for r in worker.requests] == ["name_search"]


@pytest.mark.gen_test(timeout=60)
async def test_a_page_past_its_budget_on_a_slow_database_answers_503(
        post, ctx, slow_database):
    ReferralCode.create(code="FRIEND10", owner_email="pat@example.com", percent_off=10,
                        reward_cents=2500)
    async with attached_circuit() as circuit:
        slow_database.slow(REPLY_DELAY_SECONDS)
        status, body, response = await post("/api/v1/referral/check", {"code": "friend10"},
                                             JSON)
        assert (status, body) == (503, {"error": "temporarily unavailable"})
        assert response.headers["Retry-After"]
        assert circuit.is_open
        slow_database.slow(0)


@pytest.mark.gen_test(timeout=60)
async def test_calls_waiting_on_a_slow_database_never_hold_healthz(
        post, ctx, slow_database, client, base_url, app):
    """/healthz is answered while the calls waiting on the database are still waiting:
    they wait in the database thread, not on the loop. (An order, not a time.)"""
    slow_database.slow(REPLY_DELAY_SECONDS)
    finished = []

    async def check(n):
        await post("/api/v1/referral/check", {"code": f"CODE{n}"}, JSON)
        finished.append(f"check {n}")
    checks = [asyncio.ensure_future(check(n)) for n in range(5)]
    await eventually(lambda: app.in_flight == 5, interval=0.01)  # all in, waiting
    health = await client.fetch(base_url + "/healthz")
    finished.append("healthz")
    await asyncio.gather(*checks)
    slow_database.slow(0)
    assert health.code == 200
    assert finished.index("healthz") < len(finished) - 1
