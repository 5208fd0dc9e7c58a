"""The restore, rehearsed as deploy/DEPLOY.md writes it: deploy/receiver-backup backs up
the database of a running service while it takes webhooks; the backup is restored into a
new database, migrated and served; every call acknowledged before the backup began is
there, and a sender's re-send of one is recognised. SQLite (VACUUM INTO, sqlite3) or
PostgreSQL (pg_dump, pg_restore), as TEST_DATABASE_URL says."""
import asyncio
import glob
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import urllib.parse

import psycopg2
import pytest

from tests.conftest import WEBHOOK_SECRET, _postgres_scratch_database
from tests.ops_helpers import ROOT, Service
from tests.waits import eventually

BACKUP = os.path.join(ROOT, "deploy", "receiver-backup")
POSTGRES = os.environ.get("TEST_DATABASE_URL", "").startswith("postgres")
HEADERS = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
# Old events, so that the backup takes long enough for calls to come in while it runs.
FILLER_EVENTS, FILLER_BYTES = 3000, 8000

pytestmark = pytest.mark.skipif(
    shutil.which("pg_dump" if POSTGRES else "sqlite3") is None,
    reason="the backup needs sqlite3 or pg_dump (deploy/DEPLOY.md installs them)")


class Database:
    """A database of the test's own: a SQLite file, or a PostgreSQL scratch database."""

    def __init__(self, folder):
        if POSTGRES:
            self.url, self.drop = _postgres_scratch_database(os.environ["TEST_DATABASE_URL"])
        else:
            os.makedirs(folder, exist_ok=True)
            self.url, self.drop = f"sqlite:///{folder}/receiver.sqlite3", None

    def connect(self):
        if POSTGRES:
            parts = urllib.parse.urlsplit(self.url)
            return psycopg2.connect(host=parts.hostname, port=parts.port or 5432,
                                    user=parts.username, dbname=parts.path.lstrip("/"))
        return sqlite3.connect(self.url[len("sqlite:///"):], timeout=30)

    def query(self, sql):
        connection = self.connect()
        try:
            cursor = connection.cursor()
            cursor.execute(sql)
            return cursor.fetchall()
        finally:
            connection.close()

    def fill(self):
        """FILLER_EVENTS handled events of FILLER_BYTES each, written by another client."""
        mark = "%s" if POSTGRES else "?"
        connection = self.connect()
        try:
            cursor = connection.cursor()
            cursor.executemany(
                "INSERT INTO webhook_events (source, event_type, dedup_key, payload, status, "
                "attempts, received_at, created_at, updated_at) VALUES "
                f"('card', 'filler', {mark}, {mark}, 'processed', 1, {mark}, {mark}, {mark})",
                [(f"filler-{n}", json.dumps({"pad": "x" * FILLER_BYTES}),
                  "2026-11-01 00:00:00+00:00", "2026-11-01 00:00:00+00:00",
                  "2026-11-01 00:00:00+00:00") for n in range(FILLER_EVENTS)])
            connection.commit()
        finally:
            connection.close()


@pytest.fixture
def databases(tmp_path):
    live, restored = Database(tmp_path / "live"), Database(tmp_path / "restored")
    yield live, restored
    for database in (live, restored):
        if database.drop:
            database.drop()


def service_on(database, tmp_path, name):
    return Service(str(tmp_path / f"{name}.log"), {
        "DATABASE_URL": database.url, "SPOOL_DIR": str(tmp_path / f"{name}-spool"),
        "WEBHOOK_SECRET": WEBHOOK_SECRET})


def queued(n):
    return json.dumps({"order_name": f"DOC-{n}", "order_number": f"CO-{n}",
                       "modified": f"2026-11-25 19:05:{n % 60:02d}.{n:06d}"})


class Writer:
    """Sends service/queued webhooks one after another until stopped; `acknowledged`
    holds (number, when its 200 came) of each."""

    def __init__(self, client, service):
        self.client, self.service = client, service
        self.acknowledged = []
        self.stopped = False

    async def run(self):
        n = 0
        while not self.stopped:
            response = await self.client.fetch(
                self.service.url + "/api/v1/webhooks/service/queued", method="POST",
                body=queued(n), headers=HEADERS)
            assert response.code == 200, response.body
            self.acknowledged.append((n, time.monotonic()))
            n += 1

    def before(self, moment):
        return [n for n, at in self.acknowledged if at < moment]


def restore(backup, database):
    """As deploy/DEPLOY.md says: the file copied into place, or pg_restore into an empty
    database."""
    if POSTGRES:
        subprocess.run(["pg_restore", "--no-owner", "--exit-on-error",
                        f"--dbname={database.url}", backup], check=True, timeout=120)
    else:
        shutil.copyfile(backup, database.url[len("sqlite:///"):])


@pytest.mark.gen_test(timeout=300)
async def test_a_backup_taken_while_the_service_writes_restores_migrates_and_serves(
        tmp_path, databases, client):
    live, restored = databases
    service = service_on(live, tmp_path, "live")
    await service.start()
    try:
        await service.wait_ready(client)
        live.fill()
        writer = Writer(client, service)
        writing = asyncio.ensure_future(writer.run())
        await eventually(lambda: len(writer.acknowledged) >= 20, timeout=60, interval=0.05)
        folder = tmp_path / "backups"
        folder.mkdir()
        started = time.monotonic()
        backup = await asyncio.create_subprocess_exec(
            BACKUP, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={"PATH": os.environ["PATH"], "DATABASE_URL": live.url,
                 "BACKUP_DIR": str(folder)})
        out, err = await backup.communicate()
        ended = time.monotonic()
        # A call acknowledged after the backup: the service wrote on through it.
        await eventually(lambda: len(writer.acknowledged) > len(writer.before(ended)),
                         timeout=60, interval=0.05)
        writer.stopped = True
        await writing
    finally:
        service.process.terminate()
        await service.process.wait()
    assert backup.returncode == 0, err.decode()
    [made] = glob.glob(str(folder / "receiver-*"))
    assert out.decode() == f"receiver-backup: {made} ({os.path.getsize(made)} bytes)\n"
    assert made.endswith(".dump" if POSTGRES else ".sqlite3")
    assert os.stat(made).st_mode & 0o077 == 0  # customers' data: for its owner only
    acknowledged_before = writer.before(started)
    during = set(writer.before(ended)) - set(acknowledged_before)
    assert during, "no call came in while the backup ran"
    assert len(writer.acknowledged) > len(writer.before(ended))

    restore(made, restored)
    migrated = subprocess.run([sys.executable, "receiver.py", "migrate"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "DATABASE_URL": restored.url})
    assert (migrated.returncode, migrated.stdout) == (0, "schema is up to date\n"), \
        migrated.stderr
    found = {number for (number,) in restored.query(
        "SELECT order_number FROM webhook_events WHERE event_type = 'service/queued'")}
    assert {f"CO-{n}" for n in acknowledged_before} <= found
    assert restored.query("SELECT COUNT(*) FROM webhook_events "
                          "WHERE event_type = 'filler'") == [(FILLER_EVENTS,)]

    again = service_on(restored, tmp_path, "restored")
    await again.start()
    try:
        await again.wait_ready(client)
        ready = await client.fetch(again.url + "/readyz")
        assert ready.code == 200, ready.body
        # A sender's re-send of a call acknowledged before the backup is known.
        first = acknowledged_before[0]
        response = await client.fetch(again.url + "/api/v1/webhooks/service/queued",
                                      method="POST", body=queued(first), headers=HEADERS)
        assert response.code == 200
        assert restored.query("SELECT COUNT(*) FROM webhook_events WHERE order_number = "
                              f"'CO-{first}'") == [(1,)]
    finally:
        again.process.terminate()
        await again.process.wait()
