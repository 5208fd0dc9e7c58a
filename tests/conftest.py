"""Fixtures: a real database (SQLite, or PostgreSQL with TEST_DATABASE_URL), real peers
on loopback, a settable clock, and the application under test."""
import contextlib
import datetime
import json
import logging
import os
import shutil
import subprocess
import tempfile
import urllib.parse
import uuid

import peewee
import psycopg2
import pytest
from tornado.httpclient import AsyncHTTPClient

from engine import inbox, lograte
import migrations
from models import UTC
from engine.connection import open_database
from app.server import make_app
from app.context import Context
from settings import Settings
from tests.door import ThreadCheck, service_refusals
from tests.peers import HttpPeer, SmtpPeer

WEBHOOK_SECRET = "test-webhook-secret"
# Of a failed test's service logs, the last lines shown with its report, requests' lines
# left out: what the service did is often the only account of why (CI prints the report,
# not the files).
LOG_LINES_SHOWN = 120


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    tmp_path = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if not report.failed or tmp_path is None:
        return
    for log_path in sorted(tmp_path.glob("*.log")):
        lines = [line for line in log_path.read_text(encoding="utf-8", errors="replace")
                 .splitlines() if " receiver.access " not in line]
        report.sections.append((f"service log {log_path.name} (last {LOG_LINES_SHOWN} of "
                                f"{len(lines)} lines)", "\n".join(lines[-LOG_LINES_SHOWN:])))


@contextlib.contextmanager
def table_away(db, table):
    """`table` renamed away for the code inside: every statement on it fails, as on a
    database whose table is broken or gone."""
    db.execute_sql(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        yield
    finally:
        db.execute_sql(f"ALTER TABLE {table}_away RENAME TO {table}")


def _postgres_scratch_database(url):
    """A database of our own beside the one TEST_DATABASE_URL names, so that parallel
    runs never share tables. Returns (url, drop)."""
    parts = urllib.parse.urlsplit(url)
    name = f"receiver_test_{uuid.uuid4().hex[:12]}"
    admin = peewee.PostgresqlDatabase(parts.path.lstrip("/"), host=parts.hostname,
                                      port=parts.port or 5432, user=parts.username,
                                      password=parts.password)
    admin.execute_sql(f'CREATE DATABASE "{name}"')

    def drop():
        admin.execute_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
    return urllib.parse.urlunsplit(parts._replace(path=f"/{name}")), drop


@pytest.fixture(scope="session")
def database_url():
    url = os.environ.get("TEST_DATABASE_URL", "")
    if url.startswith("postgres"):
        scratch, drop = _postgres_scratch_database(url)
        yield scratch
        from models import database
        if database.obj is not None:
            database.close()
        drop()
    else:
        with tempfile.TemporaryDirectory() as folder:
            yield f"sqlite:///{folder}/test.sqlite3"


@pytest.fixture
def other_connection(database_url):
    """A second PostgreSQL session, as another service process would have."""
    parts = urllib.parse.urlsplit(database_url)
    connection = psycopg2.connect(host=parts.hostname, port=parts.port or 5432,
                                  user=parts.username, dbname=parts.path.lstrip("/"))
    yield connection
    connection.close()


@pytest.fixture(scope="session")
def migrated_db(database_url):
    db = open_database(database_url)
    migrations.migrate(db)
    return db


@pytest.fixture(scope="session", autouse=True)
def thread_check():
    """On for the whole suite: see tests/door.py."""
    check = ThreadCheck()
    check.install()
    yield check
    check.remove()


@pytest.fixture(autouse=True)
def statements_through_the_door(thread_check):
    """A test during which the service ran a statement outside the door fails, even when
    the service caught the refusal; in this process or in a service it started."""
    thread_check.refused.clear()
    yield
    refused, thread_check.refused[:] = list(thread_check.refused), []
    refused += service_refusals()
    assert not refused, "statements outside the door:\n" + "\n".join(refused)


@pytest.fixture
def statements(caplog):
    """The SQL statements run, as peewee logs them (a statement prepared on the server
    by its own text, not its EXECUTE)."""
    caplog.set_level(logging.DEBUG, logger="peewee")
    return lambda: [record.msg[0] for record in caplog.records
                    if record.name == "peewee" and isinstance(record.msg, tuple)]


def empty_tables(db):
    """Every table but the migrations' emptied."""
    tables = [t for t in db.get_tables() if t != "schema_migrations"]
    if db.__class__.__name__.startswith("Reconnecting"):
        db.execute_sql(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")
    else:
        with db.atomic():
            for table in tables:
                db.execute_sql(f"DELETE FROM {table}")


def start_afresh(ctx, db):
    """Between a property test's examples: empty tables, an empty spool, and nothing the
    inbox remembers in the process (calls parked, claims cut short)."""
    empty_tables(db)
    shutil.rmtree(ctx.settings.spool_dir, ignore_errors=True)
    os.makedirs(ctx.settings.spool_dir)
    inbox._PARKED.clear()
    inbox._CLAIMS_CUT_SHORT.clear()


@pytest.fixture(autouse=True)
def db(migrated_db):
    """Every test starts with empty tables."""
    empty_tables(migrated_db)
    yield migrated_db
    if not migrated_db.is_closed() and migrated_db.in_transaction():
        migrated_db.rollback()


class Clock:
    """A clock the test sets; it runs in real time until told otherwise."""

    def __init__(self):
        self.fixed = None

    def __call__(self):
        return self.fixed or datetime.datetime.now(UTC)

    def set(self, *args):
        self.fixed = datetime.datetime(*args, tzinfo=UTC) if args else None

    def advance(self, **delta):
        self.fixed = self() + datetime.timedelta(**delta)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def worker(io_loop):
    peer = HttpPeer("worker", body={"ok": True, "job_id": "job-1"})
    yield peer
    peer.stop()


@pytest.fixture
def frappe(io_loop):
    peer = HttpPeer("frappe", body={"message": {"name": "FO-0001", "workflow_state": "Name Check"}})
    yield peer
    peer.stop()


@pytest.fixture
def telegram(io_loop):
    peer = HttpPeer("telegram", body={"ok": True, "result": {"message_id": 1}})
    yield peer
    peer.stop()


@pytest.fixture(scope="session")
def smtp_server():
    peer = SmtpPeer()
    yield peer
    peer.stop()


@pytest.fixture
def smtp(smtp_server):
    smtp_server.clear()
    return smtp_server


@pytest.fixture
def settings(worker, frappe, telegram, smtp, tmp_path):
    return Settings(
        spool_dir=str(tmp_path / "spool"),
        webhook_secret=WEBHOOK_SECRET,
        workflow_url=frappe.url, workflow_api_key="wf-key", workflow_api_secret="wf-secret",
        workflow_site_name="erp.example.test",
        worker_url=worker.url,
        telegram_api_url=telegram.url, telegram_bot_token="123:bot-token",
        telegram_chat_id="-1001",
        smtp_url=smtp.url, admin_email="admin@example.test",
        mail_from="receiver@example.test",
        outbound_timeout_seconds=3,
    )


@pytest.fixture(autouse=True)
def fresh_repeats():
    """Each test sees its own first failure logged: nothing counted from an earlier one."""
    for repeats in list(lograte._ALL):
        repeats.seen.clear()


@pytest.fixture
def ctx(settings, clock, io_loop):
    ctx = Context.create(settings, clock=clock)
    yield ctx
    io_loop.run_sync(ctx.http.close)


@pytest.fixture
def app(ctx):
    return make_app(ctx)


class Client:
    """An HTTP client with room for many requests at once (the default allows ten),
    made on first use so it belongs to the running loop."""

    def __init__(self):
        self.http = None

    async def fetch(self, url, **kwargs):
        if self.http is None:
            self.http = AsyncHTTPClient(force_instance=True, max_clients=100)
        return await self.http.fetch(url, raise_error=False, **kwargs)

    def close(self):
        if self.http is not None:
            self.http.close()


@pytest.fixture
def client(io_loop):
    http = Client()
    yield http
    http.close()


@pytest.fixture
def post(http_server, base_url, client):
    """POST (or `method`) to the service under test; returns (status, parsed JSON body,
    response)."""
    async def send(path, body, headers=None, method="POST"):
        raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
        response = await client.fetch(base_url + path, method=method,
                                      body=None if method in ("GET", "HEAD") else raw,
                                      headers=headers or {})
        try:
            parsed = json.loads(response.body) if response.body else None
        except ValueError:
            parsed = None
        return response.code, parsed, response
    return send


@pytest.fixture
def small_filesystem(tmp_path):
    """A 4 MiB tmpfs of its own (the spool's disk, to fill); skipped where mounting is
    not allowed."""
    folder = tmp_path / "fs"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here: " + mounted.stderr.decode().strip())
    yield folder
    subprocess.run(["umount", str(folder)], check=True)
