"""A poison call never blocks the others (issue 20, point 1): what counts as "the database
is down" (only unavailability, by SQLSTATE or SQLite result code), the bounds on every
value that goes into an indexed column, and the quarantine of a spooled call the
database refuses anyway. The outage itself, on PostgreSQL through a cut proxy, is in
test_faults.py."""
import random
import string
import subprocess
import sys

import peewee
import pytest

from models import WebhookEvent, is_postgres
from engine.errors import DatabaseDown, StatementRefused
from engine import inbox, spool
from engine.db import UNAVAILABLE
from tests.conftest import WEBHOOK_SECRET
from tests.service_process import ON_POSTGRES, ROOT, database_down, postgres_only

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
SUBMITTED = "/api/v1/webhooks/formation/submitted"


def random_text(length):
    """Random letters do not compress: PostgreSQL cannot squeeze them under its index
    row limit the way it squeezes a run of one letter."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=length))


def submitted(number, order_number=None):
    return {"order_name": f"ORD-{number}", "order_number": order_number or f"FO-{number}",
            "state_code": "WY", "entity_name": f"Acme {number} LLC"}


def poison_row():
    return dict(source="workflow", event_type="formation/submitted", dedup_key="poison",
                order_number=random_text(2800), payload="{}")


@postgres_only
def test_a_value_past_the_index_row_limit_is_refused_not_taken_for_an_outage(db):
    with pytest.raises(StatementRefused) as refused:
        WebhookEvent.create(**poison_row())
    assert refused.value.orig.pgcode == "54000"  # psycopg2 raises it as OperationalError
    assert not isinstance(refused.value, UNAVAILABLE)


@postgres_only
def test_a_read_only_database_is_down(db):
    # What a primary demoted to a standby answers (psycopg2 raises it as InternalError).
    with pytest.raises(DatabaseDown) as down:
        with db.atomic():
            db.execute_sql("SET TRANSACTION READ ONLY")
            WebhookEvent.create(**{**poison_row(), "order_number": "FO-1"})
    assert down.value.orig.pgcode == "25006" and isinstance(down.value, UNAVAILABLE)


def test_a_statement_the_database_refuses_is_not_an_outage(db):
    with pytest.raises(peewee.DatabaseError) as refused:
        db.execute_sql("SELECT no_such_column FROM webhook_events")
    assert not isinstance(refused.value, UNAVAILABLE)  # SQLite says OperationalError


def test_an_unreachable_database_is_down(db):
    with database_down(db), pytest.raises(UNAVAILABLE):
        WebhookEvent.select().count()


@pytest.mark.skipif(ON_POSTGRES, reason="SQLite's file lock")
def test_a_sqlite_file_locked_by_another_process_is_down_once_the_busy_timeout_runs_out(
        db, database_url):
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, database_url[len("sqlite:///"):]], cwd=ROOT,
        stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"locked\n"
        db.execute_sql("PRAGMA busy_timeout = 50")
        with pytest.raises(UNAVAILABLE) as down:
            with db.atomic("IMMEDIATE"):
                pass
        assert down.value.orig.sqlite_errorcode == 5  # SQLITE_BUSY
    finally:
        holder.kill()
        holder.wait()
        db.execute_sql("PRAGMA busy_timeout = 5000")


LOCK_HOLDER = """
import sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(60)  # holds the lock until the test kills it
"""


@pytest.mark.gen_test
async def test_an_order_number_or_idempotency_key_too_long_to_index_is_400(post):
    status, reply, _ = await post(SUBMITTED, submitted(1, random_text(2800)), AUTH)
    assert (status, reply) == (400, {"error": "field too long: order_number "
                                              "(at most 255 characters)"})
    status, reply, _ = await post(SUBMITTED, submitted(2),
                                  {**AUTH, "Idempotency-Key": random_text(12 * 1024)})
    assert (status, reply) == (400, {"error": "Idempotency-Key too long "
                                              "(at most 255 characters)"})
    # The longest accepted value is stored (and indexed) as it came.
    status, _, _ = await post(SUBMITTED, submitted(3, random_text(inbox.MAX_KEY_LENGTH)),
                              {**AUTH, "Idempotency-Key": random_text(inbox.MAX_KEY_LENGTH)})
    assert status == 200 and WebhookEvent.select().count() == 1


@pytest.mark.gen_test
async def test_a_poison_line_in_the_spool_is_quarantined_and_the_calls_after_it_are_stored(
        post, ctx, db, worker):
    with database_down(db):
        assert (await post(SUBMITTED, submitted(1), AUTH))[0] == 200
    poison = {**poison_row(), "also_known_as": [], "external_id": None,
              "status": "received", "last_error": None,
              "received_at": "2026-11-20T09:00:00+00:00",
              # Past the index limit on PostgreSQL; NOT NULL refuses it on SQLite.
              "event_type": "formation/submitted" if is_postgres() else None}
    spool.append(ctx.settings.spool_dir, poison)
    with database_down(db):
        assert (await post(SUBMITTED, submitted(2), AUTH))[0] == 200

    assert await inbox.drain_spool(ctx) == 3
    assert sorted(e.order_number for e in WebhookEvent.select()) == ["FO-1", "FO-2"]
    assert len(worker.requests) == 2
    [kept] = spool.quarantined(ctx.settings.spool_dir)
    assert kept["order_number"] == poison["order_number"]
    assert kept["unstorable"].startswith("StatementRefused" if is_postgres() else
                                         "IntegrityError")
    assert await inbox.drain_spool(ctx) == 0
