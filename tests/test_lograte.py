"""Repeated identical failures: one line and a count, not one line per call."""
import dataclasses
import logging

import pytest

from engine import lograte
from tests.service_process import database_down
from tests.conftest import WEBHOOK_SECRET


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def messages(caplog, logger):
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_identical_failures_are_one_line_and_a_summary_with_their_count(caplog):
    clock = Clock()
    repeats = lograte.Repeats("test.repeats", interval=60, clock=clock)
    for _ in range(500):
        repeats.warning("peer down", "peer %s down: %s", "worker", "connection refused")
    assert messages(caplog, "test.repeats") == ["peer worker down: connection refused"]
    clock.now += 60
    repeats.flush()
    assert messages(caplog, "test.repeats")[1:] == [
        "peer worker down: connection refused: repeated 499 more time(s) in 60 s"]
    repeats.flush()
    assert len(messages(caplog, "test.repeats")) == 2


def test_a_failure_after_the_interval_is_logged_again_after_the_count(caplog):
    clock = Clock()
    repeats = lograte.Repeats("test.repeats", interval=60, clock=clock)
    for _ in range(3):
        repeats.error("k", "boom")
    clock.now += 61
    assert repeats.error("k", "boom")
    assert messages(caplog, "test.repeats") == [
        "boom", "boom: repeated 2 more time(s) in 61 s", "boom"]


def test_different_failures_are_each_logged(caplog):
    repeats = lograte.Repeats("test.repeats", clock=Clock())
    repeats.warning("a", "a failed")
    repeats.warning("b", "b failed")
    assert messages(caplog, "test.repeats") == ["a failed", "b failed"]


def test_a_traceback_is_written_with_the_first_only(caplog):
    repeats = lograte.Repeats("test.repeats", clock=Clock())
    for _ in range(10):
        try:
            raise RuntimeError("the same")
        except RuntimeError as exc:
            repeats.exception(lograte.key_of(exc), "job failed")
    assert [bool(r.exc_info) for r in caplog.records if r.name == "test.repeats"] == [True]


@pytest.mark.gen_test
async def test_an_outage_logs_the_database_failure_once_not_per_call(post, ctx, db, caplog):
    ctx.settings = dataclasses.replace(ctx.settings, spool_dir="/dev/null/spool")
    body = {"order_name": "ORD-1", "order_number": "FO-1"}
    headers = {"X-Webhook-Secret": WEBHOOK_SECRET}
    with database_down(db):
        for _ in range(20):
            status, _, _ = await post("/api/v1/webhooks/formation/ready", body, headers)
            assert status == 503
    lines = [m for m in messages(caplog, "receiver.http") if "database unavailable" in m]
    assert len(lines) == 1


@pytest.mark.gen_test
async def test_a_peer_down_logs_its_failure_once_not_per_effect(post, worker, caplog):
    worker.fail_with(503)
    headers = {"X-Webhook-Secret": WEBHOOK_SECRET}
    for number in range(20):
        body = {"order_name": f"ORD-{number}", "order_number": f"FO-{number}"}
        assert (await post("/api/v1/webhooks/formation/ready", body, headers))[0] == 200
    lines = [m for m in messages(caplog, "receiver.outbox") if "will retry" in m]
    # After OUTBOUND_DOWN_AFTER failures in a row the worker is down: the other jobs wait
    # for a probe instead of being tried (engine.destinations).
    assert len(worker.requests) == 5 and len(lines) == 1
