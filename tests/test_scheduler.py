"""The scheduler's jobs, run against real peers and the real database: the outbox
sender, the inbox retry, claims and job locks across connections, pruning."""
import asyncio
import dataclasses
import datetime
import json

import pytest

import migrations
from clients.http import Result
from models import ComplianceOrder, CrtcOrder, Outbox, WebhookEvent, database
from engine.errors import DatabaseDown
from scheduler import JOBS_BY_NAME, AdvisoryLock, Job, Scheduler
from engine import inbox, outbox, retention
from engine.db import Circuit
from settings import ConfigurationError, Settings
from tests.conftest import WEBHOOK_SECRET
from tests.service_process import database_down, postgres_only
from tests.door import name_search_jobs, through_the_door
from tests.waits import eventually

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}


def url(path):
    return f"/api/v1/webhooks/{path}"


def order(number, **extra):
    return {"order_name": f"ORD-{number}", "order_number": number, **extra}


def admin_mail(smtp):
    return [message for rcpt, message in smtp.messages if rcpt == ["admin@example.test"]]


async def run_sender_until_quiet(ctx, clock, rounds=40):
    """Let time pass and the sender run, as the scheduler would, until nothing waits."""
    for _ in range(rounds):
        clock.advance(hours=7)
        await outbox.send_due(ctx)
        if not Outbox.select().where(Outbox.status == "pending").exists():
            return


# --- outbox sender ---------------------------------------------------------------------

@pytest.mark.gen_test
async def test_a_failed_send_is_retried_with_growing_backoff_until_it_goes_out(
        post, ctx, clock, worker):
    clock.set(2026, 11, 20, 9, 0)
    worker.fail_with(503)
    await post(url("formation/ready"), order("FO-1"), AUTH)
    [row] = Outbox.select()
    delays = []
    for _ in range(4):
        row = Outbox.get_by_id(row.id)
        delays.append((row.next_attempt_at - clock()).total_seconds())
        clock.fixed = row.next_attempt_at
        assert await outbox.send_due(ctx) == 0
    assert 15 <= delays[0] <= 30 and all(b > a for a, b in zip(delays, delays[1:]))

    worker.fail_with(200, {"ok": True})
    clock.advance(hours=7)
    # The job goes, with the notices of the worker down (its fifth failure) and back.
    sent = await outbox.send_due(ctx)
    await ctx.drain_background()
    notices = Outbox.select().where(Outbox.idempotency_key.contains("destination-"))
    assert notices.count() == 4 and 1 <= sent <= 1 + notices.count()
    row = Outbox.get_by_id(row.id)
    assert (row.status, row.attempts) == ("sent", 6)
    assert len({r.headers["Idempotency-Key"] for r in worker.requests}) == 1


@pytest.mark.gen_test
async def test_after_the_last_attempt_the_row_is_dead_and_the_admin_gets_one_mail(
        post, ctx, clock, worker, smtp):
    clock.set(2026, 11, 20, 9, 0)
    worker.fail_with(502)
    await post(url("formation/ready"), order("FO-7"), AUTH)
    await run_sender_until_quiet(ctx, clock)
    await run_sender_until_quiet(ctx, clock)

    job = Outbox.get(Outbox.kind == "job")
    assert (job.status, job.attempts) == ("dead", ctx.settings.outbox_max_attempts)
    assert len(worker.requests) == ctx.settings.outbox_max_attempts
    [mail] = [mail for mail in admin_mail(smtp)
              if not mail["Subject"].startswith("Destination worker")]
    assert mail["Subject"] == f"Outbox effect #{job.id} given up"
    assert "FO-7" in mail.get_body(("plain",)).get_content()
    assert "HTTP 502" in mail.get_body(("html",)).get_content()


@pytest.mark.gen_test
async def test_a_refusal_no_retry_can_change_is_dead_at_once_with_one_mail(
        post, ctx, clock, frappe, smtp):
    frappe.fail_with(417, {"exc_type": "WorkflowTransitionError"})
    await post(url("formation/approved"), order("FO-8"), AUTH)
    await run_sender_until_quiet(ctx, clock)

    [action] = Outbox.select().where(Outbox.kind == "workflow_action")
    assert (action.status, action.attempts) == ("dead", 1)
    posts = [r for r in frappe.requests if r.method == "POST"]
    assert len(posts) == 1 and len(admin_mail(smtp)) == 1


@pytest.mark.gen_test
async def test_a_dead_admin_mail_is_not_announced_by_another(post, ctx, clock, frappe, smtp):
    frappe.fail_with(417)
    smtp.box.refuse_with = "550 mailbox unavailable"
    await post(url("formation/approved"), order("FO-9"), AUTH)
    await run_sender_until_quiet(ctx, clock)

    assert [row.status for row in Outbox.select().order_by(Outbox.id)] == ["dead", "dead"]
    assert smtp.messages == []


@pytest.mark.gen_test
async def test_an_orders_later_effect_waits_for_its_earlier_one(post, ctx, clock, worker):
    clock.set(2026, 11, 20, 9, 0)
    worker.fail_with(503)
    await post(url("formation/filed-skip-ein"), order("FO-3"), AUTH)
    worker.fail_with(200, {"ok": True})
    await post(url("formation/ready"), order("FO-3"), AUTH)
    await post(url("formation/ready"), order("FO-4"), AUTH)
    # The other order is not held up; FO-3's delivery waits for its document generation.
    assert [r.json["action"] for r in worker.requests[1:]] == ["deliver"]
    assert worker.requests[1].json["order_number"] == "FO-4"

    await run_sender_until_quiet(ctx, clock)
    fo3 = [r.json["action"] for r in worker.requests if r.json["order_number"] == "FO-3"]
    assert fo3 == ["generate_docs", "generate_docs", "deliver"]


# --- inbox retry -----------------------------------------------------------------------

def stored_event(ctx, number, payload=None, **fields):
    body = json.dumps(order(number) if payload is None else payload)
    event, created = through_the_door(inbox.store, ctx, "workflow", "formation/ready",
                                      f"key-{number}", body, order_number=number)
    assert created
    if fields:
        WebhookEvent.update(**fields).where(WebhookEvent.id == event.id).execute()
    return event


@pytest.mark.gen_test
async def test_an_event_stored_but_left_unhandled_is_handled_once_after_its_lease(
        ctx, clock, worker):
    clock.set(2026, 11, 20, 9, 0)
    stored_event(ctx, "FO-1")
    clock.advance(seconds=ctx.settings.claim_lease_seconds - 1)
    assert await inbox.retry_due(ctx) == 0  # its own request may still be handling it

    clock.advance(seconds=2)
    assert await inbox.retry_due(ctx) == 1
    assert await inbox.retry_due(ctx) == 0
    clock.advance(hours=1)
    assert await inbox.retry_due(ctx) == 0
    assert WebhookEvent.get().status == "processed"
    assert [r.json["order_number"] for r in worker.requests] == ["FO-1"]


@pytest.mark.gen_test
async def test_a_failing_event_is_retried_then_dead_with_one_mail(ctx, clock, smtp):
    clock.set(2026, 11, 20, 9, 0)
    event = stored_event(ctx, "FO-5", payload={"order_number": "FO-5"})  # no order_name
    assert await inbox.process(ctx, event) == "failed"
    event = WebhookEvent.get_by_id(event.id)
    assert (event.status, event.attempts) == ("failed", 1)
    assert "order_name" in event.last_error

    for _ in range(ctx.settings.inbox_max_attempts + 3):
        clock.advance(hours=7)
        await inbox.retry_due(ctx)
        await outbox.send_due(ctx)

    event = WebhookEvent.get_by_id(event.id)
    assert (event.status, event.attempts) == ("dead", ctx.settings.inbox_max_attempts)
    [mail] = admin_mail(smtp)
    assert mail["Subject"] == f"Webhook event #{event.id} given up"
    assert "FO-5" in mail.get_body(("plain",)).get_content()


@pytest.mark.gen_test
async def test_a_failed_event_waits_for_its_retry_time(ctx, clock, worker):
    clock.set(2026, 11, 20, 9, 0)
    later = clock() + datetime.timedelta(minutes=5)
    stored_event(ctx, "FO-6", status="failed", attempts=1, next_attempt_at=later)
    clock.advance(minutes=4)
    assert await inbox.retry_due(ctx) == 0
    clock.advance(minutes=2)
    assert await inbox.retry_due(ctx) == 1
    assert [r.json["order_number"] for r in worker.requests] == ["FO-6"]


# --- claims and locks across processes (PostgreSQL) --------------------------------------

@postgres_only
@pytest.mark.gen_test
async def test_a_row_another_process_is_claiming_is_skipped_not_waited_for(
        post, ctx, clock, worker, other_connection):
    worker.fail_with(503)
    for number in ("FO-1", "FO-2"):
        await post(url("formation/ready"), order(number), AUTH)
    worker.fail_with(200, {"ok": True})
    first, second = Outbox.select().order_by(Outbox.id)
    cursor = other_connection.cursor()
    cursor.execute("SELECT id FROM outbox WHERE id = %s FOR UPDATE", (first.id,))

    clock.advance(hours=7)
    assert await outbox.send_due(ctx) == 1
    assert [r.json["order_number"] for r in worker.requests[2:]] == ["FO-2"]

    other_connection.rollback()
    assert await outbox.send_due(ctx) == 1
    assert [r.json["order_number"] for r in worker.requests[2:]] == ["FO-2", "FO-1"]


@pytest.mark.gen_test
async def test_a_claimed_row_is_left_alone_for_its_lease(post, ctx, clock, worker):
    clock.set(2026, 11, 20, 9, 0)
    worker.fail_with(503)
    await post(url("formation/ready"), order("FO-1"), AUTH)
    worker.hold = asyncio.Event()
    clock.advance(hours=1)
    sending = asyncio.ensure_future(outbox.send_due(ctx))
    # The first run has claimed the row and waits on the worker.
    await eventually(lambda: worker.in_flight == 1, interval=0.01)
    assert await outbox.send_due(ctx) == 0
    worker.hold.set()
    await sending
    assert len(worker.requests) == 2


@postgres_only
@pytest.mark.gen_test
async def test_a_job_another_process_is_running_is_skipped(ctx, clock, frappe,
                                                           other_connection):
    clock.set(2026, 11, 20, 9, 0)
    CrtcOrder.create(order_number="CR-1", payment_status="paid", payment_method="card",
                     paid_at=clock() - datetime.timedelta(days=7))
    settlement = JOBS_BY_NAME["settlement"]
    cursor = other_connection.cursor()
    cursor.execute("SELECT pg_advisory_lock(%s)", (settlement.lock_id,))
    other_connection.commit()

    scheduler = Scheduler(ctx)
    assert await scheduler.run(settlement) is None
    assert frappe.requests == []

    cursor.execute("SELECT pg_advisory_unlock(%s)", (settlement.lock_id,))
    other_connection.commit()
    assert (await scheduler.run(settlement))["settled"] == 1
    assert len(frappe.requests) == 1
    assert await AdvisoryLock(settlement.lock_id).acquire()  # released after the run
    await AdvisoryLock(settlement.lock_id).release()


def taken_elsewhere(connection, lock_id):
    """Whether another process (`connection`'s session) gets the lock now; it gives it
    back at once."""
    cursor = connection.cursor()
    cursor.execute("SELECT pg_try_advisory_lock(%s)", (lock_id,))
    taken = cursor.fetchone()[0]
    if taken:
        cursor.execute("SELECT pg_advisory_unlock(%s)", (lock_id,))
    connection.commit()
    return taken


@postgres_only
@pytest.mark.gen_test
async def test_a_lock_is_given_back_though_the_database_was_taken_for_down_meanwhile(
        ctx, other_connection):
    """A short false "database down" over a run's end (a statement timeout of a call
    somewhere in the process): the circuit is open when the run gives its lock back.
    The lock is given back on its own session all the same, so the other processes get
    the job again at once, not once this process ends."""
    circuit = Circuit(database.obj, interval=3600)  # no probe closes it meanwhile
    circuit.attach()

    async def taken_for_down(ctx):
        circuit.trip(DatabaseDown("the database did not answer within 1 s"))
    job = Job("false-alarm", taken_for_down, lambda s: 10)
    try:
        await Scheduler(ctx, jobs=()).run(job)
        assert circuit.is_open
    finally:
        await circuit.detach()
    assert taken_elsewhere(other_connection, job.lock_id)


@postgres_only
@pytest.mark.gen_test
async def test_each_process_drains_its_own_spool_whatever_another_holds(
        post, ctx, db, worker, other_connection):
    """Another process holds the spool job's lock for good (leaked by a session that
    lives on): this process's spooled calls are stored and handled all the same. The
    spool is this process's own (or shared on one host, each file drained under its
    flock), so no lock across processes guards it."""
    with database_down(db):
        status, _, _ = await post(url("formation/ready"), order("FO-1"), AUTH)
    assert status == 200 and not WebhookEvent.select().exists()
    cursor = other_connection.cursor()
    cursor.execute("SELECT pg_advisory_lock(%s)", (JOBS_BY_NAME["spool"].lock_id,))
    other_connection.commit()

    assert await Scheduler(ctx).run(JOBS_BY_NAME["spool"]) == 1
    assert WebhookEvent.get().status == "processed"
    assert [r.json["order_number"] for r in worker.requests] == ["FO-1"]


# --- the scheduler itself ----------------------------------------------------------------

@pytest.mark.gen_test
async def test_the_scheduler_runs_its_jobs_until_stopped(ctx, worker, db):
    event = stored_event(ctx, "FO-1")
    WebhookEvent.update(received_at=event.received_at - datetime.timedelta(hours=1)).where(
        WebhookEvent.id == event.id).execute()
    scheduler = Scheduler(ctx)
    assert not scheduler.running
    await scheduler.start()
    assert scheduler.running
    await eventually(lambda: worker.requests, timeout=2, interval=0.02)
    await scheduler.stop()
    assert not scheduler.running
    assert [r.json["order_number"] for r in worker.requests] == ["FO-1"]


@pytest.mark.gen_test
async def test_a_run_asked_for_while_one_goes_on_follows_it_not_the_next_tick(ctx):
    """The work a running run had already looked for (the inbox retry had claimed what was
    due) misses what comes meanwhile (a call made due by its order's arrival): the run
    asked for then follows this one, not the next tick, an hour away here."""
    looked = asyncio.Event()
    let_go = asyncio.Event()
    runs = []

    async def claims(ctx):
        runs.append(len(runs) + 1)
        if len(runs) == 1:
            looked.set()
            await let_go.wait()
    job = Job("claims", claims, lambda s: 3600, one_process=False)
    scheduler = Scheduler(ctx, jobs=(job,))
    await scheduler.start()
    try:
        await asyncio.wait_for(looked.wait(), 5)
        scheduler.run_soon("claims")
        let_go.set()
        await eventually(lambda: len(runs) == 2, timeout=5, interval=0.01)
    finally:
        await scheduler.stop()
    assert runs == [1, 2]


@pytest.mark.gen_test
async def test_a_run_that_fails_is_logged_not_raised(ctx, caplog):
    async def broken(ctx):
        raise RuntimeError("the disk is on fire")
    assert await Scheduler(ctx).run(Job("broken", broken, lambda s: 10)) is None
    assert "job broken failed" in caplog.text and "the disk is on fire" in caplog.text


@pytest.mark.gen_test
async def test_an_unusable_spool_directory_does_not_fail_the_drain_at_every_tick(
        ctx, caplog, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ctx.settings = dataclasses.replace(ctx.settings, spool_dir=str(blocker / "spool"))
    assert await Scheduler(ctx).run(JOBS_BY_NAME["spool"]) == 0
    assert "job spool failed" not in caplog.text and "Traceback" not in caplog.text


# --- pruning -----------------------------------------------------------------------------

def test_pruning_deletes_only_handled_events_and_sent_effects_past_retention(ctx, clock):
    clock.set(2026, 11, 20, 9, 0)
    old = clock() - datetime.timedelta(days=ctx.settings.retention_days, minutes=1)
    recent = clock() - datetime.timedelta(days=ctx.settings.retention_days - 1)
    kept, pruned = [], []
    for n, (status, when) in enumerate([("processed", old), ("ignored", old),
                                        ("processed", recent), ("failed", old),
                                        ("dead", old), ("rejected", old)]):
        event = stored_event(ctx, f"FO-{n}", status=status, processed_at=when)
        (pruned if status in ("processed", "ignored") and when == old else kept).append(
            event.id)
    for n, (status, when) in enumerate([("sent", old), ("sent", recent), ("pending", old),
                                        ("dead", old)]):
        Outbox.create(kind="job", payload="{}", idempotency_key=f"k{n}", status=status,
                      sent_at=when, event=kept[0])

    assert through_the_door(retention.prune, ctx) == (2, 1)
    assert sorted(e.id for e in WebhookEvent.select()) == sorted(kept)
    assert sorted(r.status for r in Outbox.select()) == ["dead", "pending", "sent"]
    assert through_the_door(retention.prune, ctx) == (0, 0)


@pytest.mark.gen_test
async def test_pruning_deletes_in_bounded_batches_until_nothing_is_left(ctx, clock):
    """However much has piled up, each statement deletes a bounded number of rows (a
    transaction of its own), so none outlasts the statement timeout."""
    clock.set(2026, 11, 20, 9, 0)
    old = clock() - datetime.timedelta(days=ctx.settings.retention_days, minutes=1)
    for n in range(5):
        stored_event(ctx, f"FO-{n}", status="processed", processed_at=old)
    assert through_the_door(retention.prune, ctx, limit=2) == (2, 0)
    assert WebhookEvent.select().count() == 3
    assert await retention.prune_all(ctx, limit=2) == (3, 0)
    assert WebhookEvent.select().count() == 0
    assert await JOBS_BY_NAME["retention"].run(ctx) == (0, 0)


def test_events_stored_already_ignored_are_pruned_after_retention_from_their_arrival(
        ctx, clock):
    clock.set(2026, 11, 20, 9, 0)
    for key in ("old", "recent"):
        if key == "recent":
            clock.advance(days=ctx.settings.retention_days - 1)
        event, created = through_the_door(inbox.store, ctx, "crypto", "callback",
                                          f"no-external-id:{key}", "{}", status="ignored")
        assert created and event.processed_at is None
    clock.advance(days=1, minutes=1)

    assert through_the_door(retention.prune, ctx) == (1, 0)
    assert [e.dedup_key for e in WebhookEvent.select()] == ["no-external-id:recent"]


def test_migration_0005_adds_the_reminder_columns_to_an_older_database(db):
    db.execute_sql("ALTER TABLE compliance_orders DROP COLUMN intake_reminders_sent")
    db.execute_sql("ALTER TABLE compliance_orders DROP COLUMN intake_reminded_at")
    db.execute_sql("DELETE FROM schema_migrations WHERE name = '0005_intake_reminders'")

    assert migrations.migrate(db) == ["0005_intake_reminders"]
    columns = {column.name for column in db.get_columns("compliance_orders")}
    assert {"intake_reminders_sent", "intake_reminded_at"} <= columns
    assert ComplianceOrder.create(order_number="CO-1").intake_reminders_sent == 0
    assert migrations.migrate(db) == []


# --- settings ----------------------------------------------------------------------------

def test_the_scheduler_settings_come_from_the_environment():
    settings = Settings.from_env({"SCHEDULER_TICK_SECONDS": "5", "CLAIM_LEASE_SECONDS": "90",
                                  "RETENTION_DAYS": "14"})
    assert (settings.scheduler_tick_seconds, settings.claim_lease_seconds,
            settings.retention_days) == (5, 90, 14)


@pytest.mark.parametrize("environment,complaint", [
    ({"CLAIM_LEASE_SECONDS": "10", "OUTBOUND_TIMEOUT_SECONDS": "10"},
     "CLAIM_LEASE_SECONDS must be longer than OUTBOUND_TIMEOUT_SECONDS"),
    ({"SCHEDULER_TICK_SECONDS": "0"}, "must be a whole number above zero"),
    ({"RETENTION_DAYS": "-1"}, "must be a whole number above zero"),
])
def test_scheduler_settings_that_cannot_work_are_refused(environment, complaint):
    with pytest.raises(ConfigurationError, match=complaint):
        Settings.from_env(environment)


@pytest.mark.gen_test(timeout=30)
async def test_a_destination_found_back_has_its_backlog_sent_at_once_not_at_the_next_tick(
        ctx, clock, worker):
    ctx.settings = dataclasses.replace(ctx.settings, scheduler_tick_seconds=3600)
    clock.set(2026, 11, 20, 9, 0)
    worker_destination = ctx.destinations.of("job")
    for _ in range(ctx.settings.outbound_down_after):
        worker_destination.observe(Result.failed("connection refused"))
    assert worker_destination.state == "down"
    effects = outbox.Effects(ctx)
    name_search_jobs(effects, range(1, 4))
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)  # due, but not yet probed

    scheduler = Scheduler(ctx)
    await scheduler.start()
    try:
        # The runs at start are over.
        await eventually(lambda: not scheduler.running_jobs, timeout=10, interval=0.02)
        assert worker.requests == []
        worker_destination.observe(Result(ok=True))  # a probe got through
        await eventually(lambda: len(worker.requests) == 3, timeout=10, interval=0.02)
    finally:
        await scheduler.stop()
    assert Outbox.select().where(Outbox.status == "sent", Outbox.kind == "job").count() == 3
    # Its going down and coming back told to the administrator, by mail and by alert.
    assert sorted(row.kind for row in Outbox.select().where(
        Outbox.idempotency_key.contains("destination-"))) == ["alert"] * 2 + ["email"] * 2


@postgres_only
@pytest.mark.gen_test(timeout=30)
async def test_a_prune_the_database_does_not_finish_opens_no_circuit(ctx, clock, db, caplog):
    """A delete past the statement timeout is maintenance cut short, not an outage: the
    circuit stays closed (calls are not spooled), the batch is halved, and the run ends
    once even the smallest batch does not finish, to go on at the next."""
    clock.set(2026, 11, 20, 9, 0)
    old = clock() - datetime.timedelta(days=ctx.settings.retention_days, minutes=1)
    stored_event(ctx, "FO-1", status="processed", processed_at=old)
    # A delete slow on purpose: each row a second, past the statement timeout.
    db.execute_sql("CREATE FUNCTION slow_delete() RETURNS trigger LANGUAGE plpgsql AS "
                   "$$ BEGIN PERFORM pg_sleep(1); RETURN OLD; END $$")
    db.execute_sql("CREATE TRIGGER slow_delete BEFORE DELETE ON webhook_events "
                   "FOR EACH ROW EXECUTE FUNCTION slow_delete()")
    circuit = Circuit(db)
    circuit.attach()
    try:
        through_the_door(db.execute_sql, "SET statement_timeout = 100")
        assert await retention.prune_all(ctx, limit=20) == (0, 0)
        assert not circuit.is_open
        assert "pruning stopped until its next run: a batch of 10 rows" in caplog.text
        assert await ctx.db(lambda: WebhookEvent.select().count()) == 1
    finally:
        through_the_door(db.execute_sql, "RESET statement_timeout")
        db.execute_sql("DROP TRIGGER slow_delete ON webhook_events")
        db.execute_sql("DROP FUNCTION slow_delete()")
        await circuit.detach()
