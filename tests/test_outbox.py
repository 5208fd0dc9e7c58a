"""The outbox sender against a real SMTP server, real HTTP peers and the real database:
a row goes out once however slow its sending, and a sender that raises cannot leave a
row stuck (tests/test_outbox_destinations.py: each destination on its own)."""
import asyncio
import concurrent.futures
import dataclasses
import datetime
import logging
import threading

import pytest

from models import Outbox, database
from engine import outbox
from engine.outbox import Effects
from tests.door import name_search_jobs, new_row_id, through_the_door
from tests.waits import eventually


def mail(to="customer@example.test", subject="Your order", text="Hello"):
    return {"to": [to], "subject": subject, "text": text}


def admin_mail(smtp):
    return [message for rcpt, message in smtp.messages if rcpt == ["admin@example.test"]]


@pytest.fixture
def new_job(ctx, clock):
    """A worker job for FO-1 just written at 2026-11-20 09:00: (its Effects, its row id)."""
    clock.set(2026, 11, 20, 9, 0)
    effects = Effects(ctx)
    return effects, new_row_id(effects.job, "deliver", {"order_number": "FO-1"},
                               key="job-FO-1-deliver")


@pytest.fixture
def one_mail_thread(ctx):
    """The mailer with a single thread, kept busy until the test opens the gate: sends
    queue behind it as they do when every thread is held by a slow mail server."""
    gate = threading.Event()
    executor = QueuedSends(1, thread_name_prefix="smtp-test")
    executor.submit(gate.wait)
    ctx.mailer.executor = executor
    yield gate, executor
    gate.set()
    executor.shutdown(wait=True)


class QueuedSends(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that counts the work given to it: a send queued for a thread is a
    send its sender has made."""
    queued = 0

    def submit(self, *args, **kwargs):
        self.queued += 1
        return super().submit(*args, **kwargs)


@pytest.mark.gen_test
async def test_a_mail_waiting_for_a_thread_past_its_lease_is_sent_once(
        ctx, clock, smtp, one_mail_thread):
    clock.set(2026, 11, 20, 9, 0)
    effects = Effects(ctx)
    row_id = new_row_id(effects.add, "email", mail(), key="email-FO-1", order_number="FO-1")
    gate, threads = one_mail_thread
    request = asyncio.ensure_future(outbox.deliver(ctx, effects.rows))  # its request sends it
    await eventually(lambda: threads.queued == 2, interval=0.01)  # the gate, then the mail

    # The lease the request holds runs out while its mail waits for a thread, so the
    # scheduled sender claims the row too.
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)
    scheduled = asyncio.ensure_future(outbox.send_due(ctx))
    await eventually(lambda: scheduled.done() or threads.queued == 3, interval=0.01)
    gate.set()

    assert await request == [None]
    assert await scheduled == 1
    assert len(smtp.messages) == 1
    row = Outbox.get_by_id(row_id)
    assert (row.status, row.attempts) == ("sent", 1)


@pytest.mark.gen_test
async def test_a_job_claimed_by_another_sender_meanwhile_is_not_sent_again(
        ctx, clock, worker, new_job):
    _, row_id = new_job
    [held] = Outbox.select().where(Outbox.id == row_id)  # what the request's sender read
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)
    assert await outbox.send_due(ctx) == 1

    assert await outbox.send(ctx, held) is None
    assert len(worker.requests) == 1


@pytest.mark.gen_test
async def test_a_sender_that_raises_makes_its_row_dead_not_stuck(ctx, clock, smtp, caplog):
    clock.set(2026, 11, 20, 9, 0)
    effects = Effects(ctx)
    # A line break in an address cannot go into a header: composing the mail raises.
    poison = new_row_id(effects.add, "email",
                        mail(to="a@example.test\nBcc: b@example.test"),
                        key="email-FO-1-poison", order_number="FO-1")
    later = new_row_id(effects.add, "email", mail(subject="Next step"),
                       key="email-FO-1-later", order_number="FO-1")
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)

    # The order's later mail is not held behind it (mails are ordered behind nothing),
    # and the admin's notice follows in the same run.
    assert await outbox.send_due(ctx) == 2
    row = Outbox.get_by_id(poison)
    assert (row.status, row.attempts) == ("dead", 1)
    assert row.last_error == "ValueError raised while sending"
    assert "b@example.test" not in row.last_error
    assert "Traceback" in caplog.text
    assert Outbox.get_by_id(later).status == "sent"
    [notice] = admin_mail(smtp)
    assert notice["Subject"] == f"Outbox effect #{poison} given up"


@pytest.mark.gen_test
async def test_a_subject_with_a_line_break_is_sent_on_one_line_without_injected_headers(
        ctx, smtp):
    effects = Effects(ctx)
    through_the_door(effects.add, "email",
                     mail(subject="Your order\r\nBcc: intruder@example.test"),
                     key="email-injected")
    [result] = await outbox.deliver(ctx, effects.rows)

    assert result.ok
    [(recipients, message)] = smtp.messages
    assert recipients == ["customer@example.test"]
    assert message["Subject"] == "Your order Bcc: intruder@example.test"
    assert message["Bcc"] is None


@pytest.mark.gen_test
async def test_a_mail_sent_again_after_its_outcome_was_lost_keeps_its_message_id(
        ctx, clock, smtp):
    clock.set(2026, 11, 20, 9, 0)
    effects = Effects(ctx)
    first = new_row_id(effects.add, "email", mail(), key="email-first")
    through_the_door(effects.add, "email", mail(), key="email-second")
    await outbox.deliver(ctx, effects.rows)
    # The process died before it recorded the first one as sent: it goes out again.
    Outbox.update(status="pending").where(Outbox.id == first).execute()
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)
    assert await outbox.send_due(ctx) == 1

    ids = [message["Message-ID"] for _, message in smtp.messages]
    assert len(ids) == 3 and ids.count(ids[-1]) == 2 and len(set(ids)) == 2


@pytest.mark.gen_test
async def test_a_row_sent_right_after_its_creation_is_not_re_taken_first(
        ctx, clock, worker, new_job):
    effects, row_id = new_job
    leased_until = Outbox.get_by_id(row_id).next_attempt_at
    clock.advance(seconds=0.5)  # a re-take now would move the lease by half a second
    await outbox.deliver(ctx, effects.rows)
    row = Outbox.get_by_id(row_id)
    assert row.status == "sent" and len(worker.requests) == 1
    assert row.next_attempt_at == leased_until  # no write before the send


@pytest.mark.gen_test
async def test_a_row_whose_lease_has_run_down_is_re_taken_before_it_is_sent(
        ctx, clock, worker, new_job):
    effects, row_id = new_job
    clock.advance(seconds=2)  # more than RETAKE_SLACK of the lease is gone
    await outbox.deliver(ctx, effects.rows)
    row = Outbox.get_by_id(row_id)
    assert row.status == "sent" and len(worker.requests) == 1
    assert row.next_attempt_at == clock() + datetime.timedelta(
        seconds=ctx.settings.claim_lease_seconds)


@pytest.mark.gen_test
async def test_a_re_take_whose_turn_is_undone_and_run_again_still_takes_the_row(
        ctx, clock, worker, new_job):
    """The re-take is a unit of the group commit: a turn it shares with a failing unit is
    undone and run again. It must find the row as it was the second time too, or the
    row would be taken for someone else's and not sent."""
    effects, row_id = new_job
    clock.advance(seconds=2)  # more than RETAKE_SLACK of the lease is gone

    def fails():
        raise RuntimeError("this unit fails")
    sent, failed = await asyncio.gather(outbox.send(ctx, effects.rows[0], live=True),
                                        ctx.commits.run(fails), return_exceptions=True)
    assert isinstance(failed, RuntimeError)
    assert sent is not None and sent.ok and len(worker.requests) == 1
    assert Outbox.get_by_id(row_id).status == "sent"


@pytest.mark.gen_test
async def test_a_mail_only_logged_whose_lease_has_run_down_is_re_taken_through_the_door(
        ctx, clock):
    """With SMTP_URL unset the mail is only logged, on the loop: its re-take is a write
    all the same, made in the database thread (the thread check refuses it elsewhere)."""
    ctx.settings = ctx.mailer.settings = dataclasses.replace(ctx.settings, smtp_url="")
    clock.set(2026, 11, 20, 9, 0)
    effects = Effects(ctx)
    row_id = new_row_id(effects.add, "email", mail(), key="email-FO-1",
                        order_number="FO-1")
    clock.advance(seconds=2)  # more than RETAKE_SLACK of the lease is gone
    [result] = await outbox.deliver(ctx, effects.rows)
    row = Outbox.get_by_id(row_id)
    assert result.logged and row.status == "logged"
    assert row.next_attempt_at == clock() + datetime.timedelta(
        seconds=ctx.settings.claim_lease_seconds)


@pytest.mark.gen_test
async def test_a_mail_whose_lease_has_run_down_is_re_taken_from_its_mail_thread(
        ctx, clock, smtp):
    clock.set(2026, 11, 20, 9, 0)
    effects = Effects(ctx)
    row_id = new_row_id(effects.add, "email", mail(), key="email-FO-1",
                        order_number="FO-1")
    clock.advance(seconds=2)
    [result] = await outbox.deliver(ctx, effects.rows)
    row = Outbox.get_by_id(row_id)
    assert result.ok and row.status == "sent" and len(smtp.messages) == 1
    assert row.next_attempt_at == clock() + datetime.timedelta(
        seconds=ctx.settings.claim_lease_seconds)


@pytest.mark.gen_test
async def test_a_claim_walks_a_backlog_in_index_order_rather_than_sorting_all_of_it(
        ctx, clock, caplog, database_url):
    """A backlog (a destination back after an outage) is claimed SEND_BATCH rows of a
    kind at a time. Each claim must walk one kind's due rows oldest first on an index
    and stop there: a plan that read every due row and sorted them cost each claim as
    much as the backlog (21 ms at 45,000 rows on SQLite, 30-55 ms on PostgreSQL), and
    the live requests' turns waited behind it."""
    clock.set(2026, 11, 20, 9, 0)
    now = clock()
    due = dict(created_at=now, updated_at=now, payload="{}", status="pending", attempts=0,
               next_attempt_at=now - datetime.timedelta(seconds=5))
    Outbox.insert_many([{**due, "kind": kind, "order_number": f"FO-{n}",
                         "idempotency_key": f"{kind}-{n}"}
                        for n in range(2_000) for kind in ("job", "alert")]).execute()
    caplog.set_level(logging.DEBUG, logger="peewee")
    claimed = await outbox._claim_due(ctx)
    assert sorted(row.kind for row in claimed) == ["alert"] * 50 + ["job"] * 50
    assert [row.order_number for row in claimed if row.kind == "job"] == [
        f"FO-{n}" for n in range(50)]
    selects = [record.msg for record in caplog.records if record.name == "peewee"
               and isinstance(record.msg, tuple) and record.msg[0].startswith("SELECT")]
    explain = "EXPLAIN " if database_url.startswith("postgres") else "EXPLAIN QUERY PLAN "
    for sql, params in selects:
        plan = str(await ctx.db(lambda sql=sql, params=params: database.execute_sql(
            explain + sql, params).fetchall()))
        assert "Sort" not in plan and "TEMP B-TREE" not in plan, plan
    assert len(selects) == 4  # one claim per kind


@pytest.mark.gen_test
async def test_a_backlog_larger_than_a_claim_is_sent_in_one_run(ctx, clock, worker):
    clock.set(2026, 11, 20, 9, 0)
    effects = Effects(ctx)
    name_search_jobs(effects, range(outbox.SEND_BATCH + 10))
    clock.advance(minutes=5)  # past the lease their request held them under
    assert await outbox.send_due(ctx) == outbox.SEND_BATCH + 10
    assert len(worker.requests) == outbox.SEND_BATCH + 10
