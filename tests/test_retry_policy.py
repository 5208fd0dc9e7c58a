"""One retry policy, and a failure that is always recorded (issue 24, part 3): error text
is cleaned where it is made, a failure to record an outcome still counts as an attempt,
and nothing after the commit changes the answer of a stored call."""
import contextlib
import dataclasses
import datetime

import pytest

from models import Outbox, WebhookEvent, is_postgres
from engine import inbox, outbox, retry
from settings import Settings
from tests.conftest import WEBHOOK_SECRET
from tests.door import through_the_door

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
ORDER = {"order_name": "ORD-2026-0042", "order_number": "FO-10042"}
# What a peer's crashing framework may answer: a NUL byte and other control characters
# (PostgreSQL cannot store a NUL in text), and far more than anyone reads.
NUL_BODY = b"Traceback\x00 (most recent call last)\x1b[31m\r\n" + b"x" * 5000


@pytest.mark.gen_test
async def test_a_peer_answering_500_with_a_nul_byte_is_recorded_and_retried_with_backoff(
        post, worker, clock, ctx):
    worker.fail_with(500, NUL_BODY)
    worker.content_type = "text/plain"
    clock.set(2026, 11, 23, 9, 0, 0)
    status, reply, _ = await post("/api/v1/webhooks/formation/ready", ORDER, AUTH)
    # Stored and handled before the send: its answer stands whatever the send met.
    assert (status, reply) == (200, {"received": True, "action": "delivery_dispatched"})
    assert WebhookEvent.get().status == "processed"
    job = Outbox.get(Outbox.kind == "job")
    assert (job.status, job.attempts) == ("pending", 1)
    assert job.last_error.startswith("HTTP 500: Traceback")
    assert not any(ord(char) < 32 for char in job.last_error)
    assert len(job.last_error) <= 300
    assert job.next_attempt_at > clock()
    # The scheduled sender's retry is counted as well, and backs off further.
    clock.advance(hours=1)
    await outbox.send_due(ctx)
    job = Outbox.get_by_id(job.id)
    assert (job.status, job.attempts) == ("pending", 2)
    assert job.next_attempt_at > clock()


@contextlib.contextmanager
def refusing(db, table, condition):
    """The database refuses an update of `table` whose new row meets `condition` (with
    psycopg2's %% for %): a refusal, not an outage, as a driver's limit would be."""
    condition = condition if is_postgres(db) else condition.replace("%%", "%")
    if is_postgres(db):
        db.execute_sql("CREATE FUNCTION refuse_in_test() RETURNS trigger AS $$ BEGIN "
                       "RAISE EXCEPTION 'refused by the test'; END $$ LANGUAGE plpgsql")
        db.execute_sql(f"CREATE TRIGGER refuse_in_test BEFORE UPDATE ON {table} FOR EACH ROW "
                       f"WHEN ({condition}) EXECUTE FUNCTION refuse_in_test()")
    else:
        db.execute_sql(f"CREATE TRIGGER refuse_in_test BEFORE UPDATE ON {table} "
                       f"WHEN {condition} BEGIN SELECT RAISE(ABORT, 'refused by the test'); END")
    try:
        yield
    finally:
        db.execute_sql(f"DROP TRIGGER refuse_in_test{' ON ' + table if is_postgres(db) else ''}")
        if is_postgres(db):
            db.execute_sql("DROP FUNCTION refuse_in_test()")


@pytest.mark.gen_test
async def test_an_outcome_the_database_refuses_still_counts_as_an_attempt(
        post, worker, clock, ctx, db):
    worker.fail_with(500, "overloaded")
    clock.set(2026, 11, 23, 9, 0, 0)
    with refusing(db, "outbox", "NEW.last_error LIKE 'HTTP 500%%'"):
        status, reply, _ = await post("/api/v1/webhooks/formation/ready", ORDER, AUTH)
        assert (status, reply) == (200, {"received": True, "action": "delivery_dispatched"})
        job = Outbox.get(Outbox.kind == "job")
        assert (job.status, job.attempts) == ("pending", 1)
        assert "could not be recorded" in job.last_error
        assert job.next_attempt_at > clock() + datetime.timedelta(seconds=10)
        # The scheduled sender's batch records it the same way.
        clock.set(2026, 11, 23, 12, 0, 0)
        await outbox.send_due(ctx)
    job = Outbox.get_by_id(job.id)
    assert (job.status, job.attempts) == ("pending", 2)
    assert job.next_attempt_at > clock() + datetime.timedelta(seconds=10)
    assert len(worker.requests) == 2


def test_the_policy_doubles_its_delay_with_jitter_up_to_its_cap_and_gives_up_at_its_bound():
    policy = retry.Policy(base_seconds=30, cap_seconds=300, max_attempts=4)
    for attempts, ceiling in ((1, 30), (2, 60), (3, 120), (4, 240), (5, 300), (9, 300)):
        for _ in range(20):
            assert ceiling / 2 <= policy.delay(attempts).total_seconds() <= ceiling
    assert [policy.gives_up(n) for n in (1, 3, 4, 5)] == [False, False, True, True]
    probes = retry.probes(Settings(outbound_probe_max_seconds=60))
    assert [probes.delay(n).total_seconds() for n in range(1, 6)] == [5, 10, 20, 40, 60]
    assert not probes.gives_up(10 ** 6)
    settlement = retry.settlement(Settings(settlement_refusals_before_alert=3))
    assert [settlement.tells_admin_at(n) for n in (1, 2, 3, 4, 30)] == [
        False, False, True, False, False]


@pytest.mark.gen_test
async def test_the_operator_sets_how_many_tries_an_effect_and_an_event_get(
        post, worker, clock, ctx, smtp):
    ctx.settings = dataclasses.replace(ctx.settings, outbox_max_attempts=3,
                                       inbox_max_attempts=2)
    clock.set(2026, 11, 23, 9, 0, 0)
    worker.fail_with(503)
    await post("/api/v1/webhooks/formation/ready", ORDER, AUTH)
    for _ in range(5):
        clock.advance(hours=7)
        await outbox.send_due(ctx)
    job = Outbox.get(Outbox.kind == "job")
    assert (job.status, job.attempts) == ("dead", 3) and len(worker.requests) == 3

    event, _ = through_the_door(inbox.store, ctx, "workflow", "formation/ready", "k-no-name",
                                b'{"order_number": "FO-5"}')  # no order_name: fails
    for _ in range(4):
        await inbox.process(ctx, WebhookEvent.get_by_id(event.id))
        clock.advance(hours=7)
    stored = WebhookEvent.get_by_id(event.id)
    assert (stored.status, stored.attempts) == ("dead", 2)
    await outbox.send_due(ctx)
    subjects = sorted(message["Subject"] for _, message in smtp.messages)
    assert subjects == [f"Outbox effect #{job.id} given up",
                        f"Webhook event #{event.id} given up"]
