"""The spool: calls accepted while the database is down are kept in an fsynced file and
stored and handled once when it is back (docs/ARCHITECTURE.md, "Durability")."""
import base64
import contextlib
import dataclasses
import glob
import json
import os
import subprocess
import sys

import pytest

from models import Outbox, WebhookEvent
from engine import inbox, spool
from engine.db import UNAVAILABLE
from tests.conftest import WEBHOOK_SECRET
from tests.door import through_the_door
from tests.service_process import ROOT, database_down, postgres_only

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
SUBMITTED = "/api/v1/webhooks/formation/submitted"


def submitted(number):
    return {"order_name": f"ORD-{number}", "order_number": f"FO-{number}",
            "state_code": "WY", "entity_name": f"Acme {number} LLC"}


def spool_files(ctx):
    return sorted(glob.glob(os.path.join(ctx.settings.spool_dir, "*")))


def spooled_lines(ctx):
    lines = []
    for path in spool_files(ctx):
        with open(path, encoding="utf-8") as handle:
            lines += [json.loads(line) for line in handle]
    return lines


@pytest.mark.gen_test
async def test_a_call_taken_while_the_database_is_down_is_acknowledged_then_handled_once(
        post, ctx, db, worker, frappe):
    with database_down(db):
        first = await post(SUBMITTED, submitted(1), AUTH)
        retried = await post(SUBMITTED, submitted(1), AUTH)  # the sender's own retry

    for status, reply, _ in (first, retried):
        assert (status, reply) == (200, {"received": True, "action": "queued"})
    assert worker.requests == [] and frappe.requests == []
    [line, _] = spooled_lines(ctx)
    assert (line["source"], line["event_type"], line["order_number"]) == (
        "workflow", "formation/submitted", "FO-1")
    assert json.loads(line["payload"]) == submitted(1)

    assert await inbox.drain_spool(ctx) == 2
    [event] = WebhookEvent.select()
    assert event.status == "processed"
    assert event.received_at.isoformat() == line["received_at"]
    assert [r.json["action"] for r in worker.requests] == ["name_search"]
    assert len(frappe.requests) == 1
    assert spool_files(ctx) == []

    assert await inbox.drain_spool(ctx) == 0
    status, _, _ = await post(SUBMITTED, submitted(1), AUTH)
    assert status == 200 and len(worker.requests) == 1 and WebhookEvent.select().count() == 1


@pytest.mark.gen_test
async def test_an_outage_is_one_spooled_line_and_one_not_drained_line_not_one_per_call(
        post, ctx, db, worker, caplog):
    with database_down(db):
        for number in range(5):
            await post(SUBMITTED, submitted(number), AUTH)
        for _ in range(3):
            assert await inbox.drain_spool(ctx) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len([w for w in warnings if "calls spooled" in w]) == 1
    assert len([w for w in warnings if "spool not drained" in w]) == 1
    assert len(spooled_lines(ctx)) == 5
    assert await inbox.drain_spool(ctx) == 5


@pytest.mark.gen_test
async def test_database_and_spool_both_unwritable_answers_503_so_the_sender_retries(
        post, ctx, db, worker, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    ctx.settings = dataclasses.replace(ctx.settings, spool_dir=str(blocker / "spool"))
    with database_down(db):
        status, reply, response = await post(SUBMITTED, submitted(1), AUTH)
    assert (status, reply) == (503, {"error": "temporarily unavailable"})
    assert response.headers["Retry-After"] == "30"
    assert worker.requests == []


@pytest.mark.gen_test
async def test_a_drain_that_died_midway_is_finished_by_the_next_without_duplicates(
        post, ctx, db, worker):
    with database_down(db):
        for number in (1, 2, 3):
            await post(SUBMITTED, submitted(number), AUTH)
    # A drain renamed the file and stored the first call, then the process died.
    spool._rotate(ctx.settings.spool_dir)
    [draining] = spool_files(ctx)
    assert draining.endswith(".draining")
    with open(draining, encoding="utf-8") as handle:
        first = spool._decode(json.loads(handle.readline()))
    through_the_door(inbox.store_spooled, ctx, first)

    assert await inbox.drain_spool(ctx) == 3

    assert sorted(e.order_number for e in WebhookEvent.select()) == ["FO-1", "FO-2", "FO-3"]
    assert sorted(r.json["order_number"] for r in worker.requests) == ["FO-2", "FO-3"]
    # The first was stored but never handled: the inbox retry job takes it once its
    # lease has passed, as it would after the crash.
    assert WebhookEvent.get(order_number="FO-1").status == "received"
    ctx.clock.set(2099, 1, 1)
    assert await inbox.retry_due(ctx) == 1
    assert sorted(r.json["order_number"] for r in worker.requests) == ["FO-1", "FO-2", "FO-3"]
    assert await inbox.retry_due(ctx) == 0 and len(worker.requests) == 3


@pytest.mark.gen_test
async def test_a_line_torn_by_a_crash_mid_append_is_skipped(post, ctx, db, worker, caplog):
    with database_down(db):
        await post(SUBMITTED, submitted(1), AUTH)
    [live] = spool_files(ctx)
    with open(live, "a", encoding="utf-8") as handle:
        handle.write('{"source": "workflow", "event_ty')  # never fsynced, never answered

    assert await inbox.drain_spool(ctx) == 1
    assert WebhookEvent.select().count() == 1 and len(worker.requests) == 1
    assert "line 2 torn by an interrupted append, dropped" in caplog.text
    assert spool.quarantined(ctx.settings.spool_dir) == []


@pytest.mark.gen_test
async def test_a_call_appended_after_a_torn_line_is_stored(post, ctx, db, worker):
    with database_down(db):
        await post(SUBMITTED, submitted(1), AUTH)
    [live] = spool_files(ctx)
    with open(live, "a", encoding="utf-8") as handle:
        handle.write('{"source": "workflow", "event_ty')  # never fsynced, never answered
    with database_down(db):
        status, _, _ = await post(SUBMITTED, submitted(2), AUTH)
    assert status == 200

    assert await inbox.drain_spool(ctx) == 2
    assert sorted(e.order_number for e in WebhookEvent.select()) == ["FO-1", "FO-2"]
    assert sorted(r.json["order_number"] for r in worker.requests) == ["FO-1", "FO-2"]


def test_an_append_that_fails_midway_leaves_nothing_of_itself(ctx):
    folder = ctx.settings.spool_dir
    spool.append(folder, unhandled_call("first"))
    path = os.path.join(folder, spool.LIVE_NAME)
    with open(path, "rb") as handle:
        before = handle.read()

    # The file may grow by 10 bytes only: the append writes those, then fails (EFBIG),
    # as it would on a full disk.
    writer = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED_APPENDER, folder,
                             str(len(before) + 10)], cwd=ROOT, capture_output=True, text=True)
    assert writer.returncode == 0, writer.stderr

    with open(path, "rb") as handle:
        assert handle.read() == before


@pytest.mark.gen_test
async def test_a_call_drained_after_a_long_outage_is_left_to_the_drain_for_a_lease(
        ctx, clock):
    clock.set(2026, 11, 20, 12, 0)  # three hours after the call was accepted
    event, created = through_the_door(inbox.store_spooled, ctx,
                                      spool._decode(unhandled_call("late")))
    assert created

    assert await inbox.retry_due(ctx) == 0  # the drain that stored it handles it
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)
    assert await inbox.retry_due(ctx) == 1  # that drain died: the retry takes it


@pytest.mark.gen_test
async def test_a_spooled_rejected_call_keeps_its_status_and_reason(ctx):
    reason = "amount is not a number"
    spool.append(ctx.settings.spool_dir, {
        **unhandled_call("rejected:abc"), "source": "crypto", "event_type": "malformed",
        "external_id": "CR-1", "order_number": "CR-1", "status": "rejected",
        "last_error": reason})

    assert await inbox.drain_spool(ctx) == 1
    [event] = WebhookEvent.select()
    assert (event.status, event.last_error, event.attempts) == ("rejected", reason, 0)


@pytest.mark.gen_test
async def test_a_call_the_inbox_cannot_store_is_set_aside_and_does_not_block_the_rest(
        post, ctx, db, worker):
    with database_down(db):
        await post(SUBMITTED, submitted(1), AUTH)
    [good] = spooled_lines(ctx)
    unknown_shape = {key: value for key, value in good.items() if key != "event_type"}
    spool.append(ctx.settings.spool_dir, unknown_shape)
    with database_down(db):
        await post(SUBMITTED, submitted(2), AUTH)

    assert await inbox.drain_spool(ctx) == 3
    assert sorted(e.order_number for e in WebhookEvent.select()) == ["FO-1", "FO-2"]
    assert len(worker.requests) == 2
    [aside] = spool_files(ctx)
    assert os.path.basename(aside) == spool.UNSTORABLE_NAME
    quarantined = {**unknown_shape, "unstorable": "KeyError: 'event_type'"}
    assert spooled_lines(ctx) == spool.quarantined(ctx.settings.spool_dir) == [quarantined]
    assert await inbox.drain_spool(ctx) == 0


@pytest.mark.gen_test
async def test_a_quarantined_call_is_told_to_the_admin_once_and_listed_once(ctx, smtp):
    poison = {**unhandled_call("poison"), "event_type": None}  # NOT NULL in the inbox
    spool.append(ctx.settings.spool_dir, poison)
    assert await inbox.drain_spool(ctx) == 1
    # A drain that stopped mid-file finds the same line again on its next run.
    spool.append(ctx.settings.spool_dir, poison)
    assert await inbox.drain_spool(ctx) == 1

    [call] = spool.quarantined(ctx.settings.spool_dir)
    assert call["dedup_key"] == "poison" and call["unstorable"].startswith("IntegrityError")
    [mail] = Outbox.select().where(Outbox.kind == "email")
    letter = json.loads(mail.payload)
    assert letter["to"] == ["admin@example.test"]
    assert letter["subject"] == "Spooled workflow call quarantined"
    assert "IntegrityError" in letter["text"] and "spool quarantined" in letter["text"]
    assert WebhookEvent.select().count() == 0


@pytest.mark.gen_test
async def test_the_drain_leaves_the_spool_alone_while_the_database_is_still_down(
        post, ctx, db, worker):
    with database_down(db):
        await post(SUBMITTED, submitted(1), AUTH)
        assert await inbox.drain_spool(ctx) == 0
    assert len(spooled_lines(ctx)) == 1
    assert await inbox.drain_spool(ctx) == 1 and len(worker.requests) == 1


@pytest.mark.gen_test
async def test_a_retry_across_the_dedup_window_while_the_database_is_down_is_one_delivery(
        post, ctx, db, clock, worker):
    clock.set(2026, 11, 20, 9, 9, 59)
    await post(SUBMITTED, submitted(1), AUTH)
    clock.set(2026, 11, 20, 9, 10, 1)  # the next ten-minute window
    with database_down(db):
        status, _, _ = await post(SUBMITTED, submitted(1), AUTH)
    assert status == 200

    assert await inbox.drain_spool(ctx) == 1
    assert WebhookEvent.select().count() == 1 and len(worker.requests) == 1


# Four writer processes and the drains between them share two cores with the rest of
# the machine; the drain now gives the loop back between batches.
@pytest.mark.gen_test(timeout=60)
async def test_appends_from_several_processes_during_drains_are_stored_once_each(ctx):
    writers = [subprocess.Popen([sys.executable, "-c", APPENDER, ctx.settings.spool_dir,
                                 str(writer)], cwd=ROOT) for writer in range(4)]
    drained = 0
    while any(writer.poll() is None for writer in writers):
        drained += await inbox.drain_spool(ctx)
    drained += await inbox.drain_spool(ctx)

    assert [writer.returncode for writer in writers] == [0, 0, 0, 0]
    assert drained == 400
    assert WebhookEvent.select().count() == 400
    assert spool_files(ctx) == []


def unhandled_call(dedup_key):
    """A spooled call nobody handles (no plugin: it ends `ignored`), accepted at 09:00."""
    return {"source": "workflow", "event_type": "test/unhandled", "dedup_key": dedup_key,
            "also_known_as": [], "external_id": None, "order_number": None,
            "status": "received", "last_error": None, "payload": "{}",
            "received_at": "2026-11-20T09:00:00+00:00"}


# Appends one call to a spool whose file may not grow past argv[2] bytes; the append
# must fail (EFBIG, like a full disk) after writing part of its line.
FILE_SIZE_LIMITED_APPENDER = """
import errno, resource, signal, sys
from engine import spool
folder, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    spool.append(folder, {"source": "workflow", "event_type": "test/unhandled",
                          "dedup_key": "too-big", "payload": "x" * 10000})
except OSError as exc:
    assert exc.errno == errno.EFBIG, exc
else:
    sys.exit("the append should have failed")
"""

# Appends 100 calls nobody handles (no plugin: they end `ignored`), as fast as it can.
APPENDER = """
import sys
from engine import spool
folder, writer = sys.argv[1], sys.argv[2]
for n in range(100):
    spool.append(folder, {"source": "workflow", "event_type": "test/unhandled",
                          "dedup_key": f"{writer}-{n}", "also_known_as": [],
                          "external_id": None, "order_number": None, "status": "received",
                          "last_error": None, "payload": "{}",
                          "received_at": "2026-11-20T09:00:00+00:00"})
"""


@pytest.mark.gen_test
async def test_an_unusable_spool_directory_is_one_line_every_ten_minutes_not_a_traceback(
        ctx, clock, tmp_path, caplog):
    """SPOOL_DIR under a plain file: /readyz says so; the drain at every tick must not
    fill the log with tracebacks."""
    (tmp_path / "a-file").write_text("")
    ctx.settings = dataclasses.replace(ctx.settings, spool_dir=str(tmp_path / "a-file/spool"))
    inbox.SPOOL_UNUSABLE.said = None
    clock.set(2026, 11, 23, 9, 0, 0)
    for _ in range(5):
        assert await inbox.drain_spool(ctx) == 0
        clock.advance(seconds=10)
    clock.advance(minutes=10)
    assert await inbox.drain_spool(ctx) == 0

    lines = [r for r in caplog.records if r.name == "receiver.spool"]
    assert [r.getMessage() for r in lines] == 2 * [
        f"spool directory {tmp_path}/a-file/spool cannot be used: Not a directory; fix "
        "SPOOL_DIR or its permissions (/readyz reports it too)"]
    assert all(r.levelname == "WARNING" and not r.exc_info for r in lines)
    assert "Traceback" not in caplog.text


@pytest.mark.gen_test
async def test_an_unreadable_line_mid_file_is_quarantined_with_its_bytes_and_reason(
        post, ctx, db, worker, smtp):
    with database_down(db):
        await post(SUBMITTED, submitted(1), AUTH)
    [live] = spool_files(ctx)
    # Acknowledged calls whose lines went bad on disk: a flipped byte, a bad date.
    flipped = b'{"source": "workflow", "event_type": "formation/sub\xffmitted", "dedup'
    with open(live, "ab") as handle:
        handle.write(flipped + b"\n")
        handle.write(json.dumps({**unhandled_call("bad-date"),
                                 "received_at": "yesterday"}).encode() + b"\n")
    with database_down(db):
        await post(SUBMITTED, submitted(2), AUTH)

    assert await inbox.drain_spool(ctx) == 4
    assert sorted(e.order_number for e in WebhookEvent.select()) == ["FO-1", "FO-2"]
    kept = spool.quarantined(ctx.settings.spool_dir)
    assert [base64.b64decode(call["raw_base64"]) for call in kept] == [
        flipped, json.dumps({**unhandled_call("bad-date"), "received_at": "yesterday"}).encode()]
    assert kept[0]["unstorable"].startswith("unreadable line 2: ")
    assert kept[1]["unstorable"].startswith("unreadable line 3: ValueError")
    letters = [json.loads(row.payload) for row in Outbox.select().where(Outbox.kind == "email")]
    assert [letter["subject"] for letter in letters] == 2 * ["Spooled unknown call quarantined"]
    assert "formation/sub" in letters[0]["text"]


@postgres_only
@pytest.mark.gen_test
async def test_a_quarantine_notice_the_database_could_not_take_is_not_lost_with_the_spool(
        ctx, db, smtp):
    """The database refuses a spooled call, then cannot take the administrator's notice
    (disk full, SQLSTATE 53100): the spool file, the call's only copy, is kept until a
    drain has both quarantined the call and committed the notice."""
    poison = {**unhandled_call("poison"), "event_type": None}  # NOT NULL in the inbox
    spool.append(ctx.settings.spool_dir, poison)
    db.execute_sql("CREATE FUNCTION disk_full() RETURNS trigger AS $$ BEGIN "
                   "RAISE EXCEPTION 'could not extend file' USING ERRCODE = '53100'; "
                   "END $$ LANGUAGE plpgsql")
    db.execute_sql("CREATE TRIGGER disk_full BEFORE INSERT ON outbox "
                   "FOR EACH ROW EXECUTE FUNCTION disk_full()")
    try:
        with contextlib.suppress(*UNAVAILABLE):
            await inbox.drain_spool(ctx)
    finally:
        db.execute_sql("DROP TRIGGER disk_full ON outbox")
        db.execute_sql("DROP FUNCTION disk_full()")
    assert Outbox.select().count() == 0

    await inbox.drain_spool(ctx)
    [mail] = Outbox.select().where(Outbox.kind == "email")
    assert json.loads(mail.payload)["subject"] == "Spooled workflow call quarantined"
    [call] = spool.quarantined(ctx.settings.spool_dir)
    assert call["dedup_key"] == "poison"
    assert [os.path.basename(path) for path in spool_files(ctx)] == [spool.UNSTORABLE_NAME]
