"""Every send attempt of an outbox row is kept (models.Attempt): written by the UPDATE that
records its outcome, one per attempt, also when a drain records a whole batch in one
statement; pruned after RETENTION_DAYS."""
import datetime

import pytest

from engine import outbox, retention
from engine.outbox import Effects
from models import Attempt, Outbox
from ops import console as operator_console, operator
from tests.door import new_row_id, through_the_door


def attempts_of(row_id):
    return list(Attempt.select().where(Attempt.outbox_id == row_id).order_by(Attempt.id))


@pytest.mark.gen_test
async def test_each_attempt_is_kept_with_its_status_reply_and_duration(ctx, clock, worker):
    clock.set(2026, 11, 20, 9, 0)
    effects = Effects(ctx)
    row_id = new_row_id(effects.job, "name_search", {"order_number": "FO-1"}, key="job-FO-1")
    worker.fail_with(503, {"error": "worker\nbusy"})
    await outbox.deliver(ctx, effects.rows)
    first = Outbox.get_by_id(row_id)
    assert first.status == "pending" and first.attempts == 1

    worker.status, worker.body = 200, {"ok": True, "job_id": "job-7"}
    clock.set(2026, 11, 20, 10, 0)
    assert await outbox.send_due(ctx) == 1
    failed, sent = attempts_of(row_id)
    assert (failed.destination, failed.outcome, failed.status_code) == ("job", "pending", 503)
    assert failed.attempted_at == datetime.datetime(2026, 11, 20, 9, 0, tzinfo=datetime.UTC)
    assert failed.reply == '{"error": "worker\\nbusy"}' and "HTTP 503" in failed.error
    assert (sent.outcome, sent.status_code, sent.error) == ("sent", 200, None)
    assert sent.reply == '{"ok": true, "job_id": "job-7"}'
    assert sent.attempted_at == datetime.datetime(2026, 11, 20, 10, 0, tzinfo=datetime.UTC)
    assert all(attempt.duration_ms is not None and attempt.duration_ms >= 0
               for attempt in (failed, sent))
    row = Outbox.get_by_id(row_id)
    assert (row.last_status_code, row.last_reply) == (200, sent.reply)


@pytest.mark.gen_test
async def test_a_connection_error_is_an_attempt_without_a_status_code(ctx, clock, worker):
    clock.set(2026, 11, 20, 9, 0)
    effects = Effects(ctx)
    row_id = new_row_id(effects.job, "name_search", {"order_number": "FO-1"}, key="job-FO-1")
    worker.stop()
    await outbox.deliver(ctx, effects.rows)
    (attempt,) = attempts_of(row_id)
    assert attempt.status_code is None and attempt.reply is None
    assert attempt.error.startswith("Client") and attempt.outcome == "pending"
    # Said as what it was: a refused connection, not a silence.
    assert operator_console.attempt_summary(attempt).startswith("connection refused in ")


@pytest.mark.parametrize("error,said", [
    ("ConnectionTimeoutError: no answer in time", "no answer in time"),
    ("ClientConnectorDNSError: Cannot connect to host worker.invalid:80 ssl:default "
     "[Name or service not known]", "address not found"),
    ("ServerDisconnectedError: Server disconnected", "connection closed without an answer"),
    ("SMTPRecipientsRefused: {'x@example.com': (550, b'no such user')}", "failed"),
    ("SSLError", "failed"),
])
def test_an_attempt_without_an_http_answer_says_what_came_instead(error, said):
    attempt = Attempt(status_code=None, duration_ms=3, outcome="pending", error=error)
    assert operator_console.attempt_summary(attempt) == f"{said} in 3 ms, will retry: {error}"


@pytest.mark.gen_test
async def test_an_effect_waiting_for_its_configuration_has_no_attempt(ctx, clock):
    ctx.settings.__dict__["worker_url"] = ""
    effects = Effects(ctx)
    row_id = new_row_id(effects.job, "name_search", {"order_number": "FO-1"}, key="job-FO-1")
    await outbox.deliver(ctx, effects.rows)
    assert Outbox.get_by_id(row_id).status == "waiting" and attempts_of(row_id) == []


@pytest.mark.gen_test
async def test_a_retry_put_back_in_line_is_no_attempt_and_the_next_send_is(ctx, clock, worker):
    effects = Effects(ctx)
    row_id = new_row_id(effects.job, "name_search", {"order_number": "FO-1"}, key="job-FO-1")
    worker.fail_with(400)
    await outbox.deliver(ctx, effects.rows)
    assert Outbox.get_by_id(row_id).status == "dead"
    through_the_door(operator.retry_outbox, ctx, row_id)
    assert [attempt.outcome for attempt in attempts_of(row_id)] == ["dead"]
    worker.status, worker.body = 200, {"ok": True}
    await outbox.send_due(ctx)  # the admin's notice of the dead row goes too
    assert [attempt.outcome for attempt in attempts_of(row_id)] == ["dead", "sent"]


def test_attempts_are_pruned_after_retention(ctx, clock):
    clock.set(2026, 11, 20, 9, 0)
    old = clock() - datetime.timedelta(days=ctx.settings.retention_days, minutes=1)
    recent = clock() - datetime.timedelta(days=ctx.settings.retention_days - 1)
    for when in (old, recent):
        Attempt.create(outbox_id=1, destination="job", attempted_at=when, outcome="pending",
                       created_at=when, updated_at=when)
    through_the_door(retention.prune, ctx)
    assert [attempt.attempted_at for attempt in Attempt.select()] == [recent]
