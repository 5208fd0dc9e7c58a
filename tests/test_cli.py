"""The operator's command line, run as the operator runs it: `receiver.py` in a
subprocess on the test database, talking to real peers on loopback."""
import asyncio
import datetime
import getpass
import json
import os
import re
import subprocess
import sys

import pytest

from models import UTC, ConsoleAction, CrtcOrder, Outbox, WebhookEvent
from engine import spool
from tests.checked_service import CHECKED, refusals_file, refusals_to
from tests.ops_helpers import ROOT
from tests.terminal import OnATerminal

SUBMITTED = {"order_name": "ORD-1", "order_number": "FO-1", "state_code": "WY",
             "entity_name": "Acme LLC"}


def cli_env(database_url, settings=None):
    env = {**os.environ, "DATABASE_URL": database_url, "RECEIVER_LOG_FORMAT": "text"}
    if settings is not None:
        env.update({
            "WORKER_URL": settings.worker_url, "WORKFLOW_URL": settings.workflow_url,
            "WORKFLOW_API_KEY": settings.workflow_api_key,
            "WORKFLOW_API_SECRET": settings.workflow_api_secret,
            "TELEGRAM_API_URL": settings.telegram_api_url,
            "TELEGRAM_BOT_TOKEN": settings.telegram_bot_token,
            "TELEGRAM_CHAT_ID": settings.telegram_chat_id,
            "SMTP_URL": settings.smtp_url, "ADMIN_EMAIL": settings.admin_email,
            "SPOOL_DIR": settings.spool_dir, "OUTBOUND_TIMEOUT_SECONDS": "3"})
    return env


def run(database_url, *args, env=None):
    """For commands that need no peer: a plain blocking subprocess."""
    return subprocess.run([*CHECKED, *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=60,
                          env={**cli_env(database_url), **refusals_to(refusals_file()),
                               **(env or {})})


class Ran:
    def __init__(self, code, stdout, stderr):
        self.returncode, self.stdout, self.stderr = code, stdout, stderr


async def run_async(env, *args):
    """For commands that reach peers served by this test's own event loop."""
    process = await asyncio.create_subprocess_exec(
        *CHECKED, *args, cwd=ROOT, env={**env, **refusals_to(refusals_file())},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    return Ran(process.returncode, stdout.decode(), stderr.decode())


def stored_event(source="workflow", event_type="formation/submitted", status="received",
                 payload=None, received=None, order_number="FO-1", external_id=None,
                 last_error=None):
    received = received or datetime.datetime.now(UTC)
    return WebhookEvent.create(
        source=source, event_type=event_type,
        dedup_key=f"{event_type}:{WebhookEvent.select().count()}:{received.isoformat()}",
        payload=json.dumps(SUBMITTED if payload is None else payload)
        if not isinstance(payload, str) else payload,
        status=status, received_at=received, order_number=order_number,
        external_id=external_id, last_error=last_error)


def outbox_row(status="pending", key="k-1", event=None, attempts=3):
    return Outbox.create(event=event, kind="job", order_number="FO-1",
                         payload=json.dumps({"action": "deliver", "payload": SUBMITTED}),
                         idempotency_key=key, status=status, attempts=attempts,
                         last_error="HTTP 400: bad job" if status == "dead" else None,
                         next_attempt_at=datetime.datetime(2026, 1, 1, tzinfo=UTC),
                         sent_at=datetime.datetime.now(UTC) if status == "sent" else None)


def at(*args):
    return datetime.datetime(*args, tzinfo=UTC)


# --- help and usage -------------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["events", "list"], ["events", "show"], ["events", "replay"], ["outbox", "list"],
    ["outbox", "retry"], ["settle"], ["backfill"], ["spool", "quarantined"]])
def test_every_command_explains_itself(database_url, command):
    result = run(database_url, *command, "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: receiver.py")


def test_spool_quarantined_lists_each_call_the_database_refused_with_its_reason(
        database_url, tmp_path):
    spool_dir = str(tmp_path / "spool")
    assert run(database_url, "spool", "quarantined", env={"SPOOL_DIR": spool_dir}).stdout \
        .endswith(f"0 quarantined call(s) in {spool_dir}/unstorable.jsonl\n")
    refused = {"source": "workflow", "event_type": "formation/submitted",
               "dedup_key": "formation/submitted:key:k1", "order_number": "FO-" + "9" * 300,
               "received_at": "2026-11-20T09:00:00+00:00",
               "unstorable": "StatementRefused: index row size 2816 exceeds btree maximum"}
    spool.append(spool_dir, refused, name=spool.UNSTORABLE_NAME)
    spool.append(spool_dir, refused, name=spool.UNSTORABLE_NAME)  # quarantined again

    result = run(database_url, "spool", "quarantined", env={"SPOOL_DIR": spool_dir})
    assert result.returncode == 0
    header, row, total = result.stdout.splitlines()
    assert header.split() == ["RECEIVED", "(UTC)", "SOURCE", "TYPE", "ORDER", "DEDUP", "KEY",
                              "REASON"]
    assert row.split()[:4] == ["2026-11-20T09:00:00+00:00", "workflow",
                               "formation/submitted", "FO-" + "9" * 44 + "…"]
    assert row.endswith("StatementRefused: index row size 2816 exceeds b…")
    assert total == f"1 quarantined call(s) in {spool_dir}/unstorable.jsonl"


def test_a_bad_time_is_a_usage_error(database_url):
    result = run(database_url, "events", "list", "--since", "last tuesday")
    assert result.returncode == 2 and "not an ISO 8601 time" in result.stderr


@pytest.mark.parametrize("option,value,choices", [
    ("--source", "nonsense", "'workflow', 'card', 'crypto'"),
    ("--status", "done", "'received', 'held', 'processed', 'failed'"),
])
def test_an_unknown_source_or_status_is_bad_usage_naming_the_choices(database_url, option,
                                                                     value, choices):
    result = run(database_url, "events", "list", option, value)
    assert result.returncode == 2 and result.stdout == ""
    assert f"argument {option}: invalid choice: '{value}'" in result.stderr
    assert choices in result.stderr


def test_replay_needs_an_id_or_failed(database_url):
    result = run(database_url, "events", "replay")
    assert result.returncode == 2 and "one of the arguments id --failed" in result.stderr


# --- events list / show ---------------------------------------------------------------------

def test_events_list_is_a_table_newest_first_filtered(database_url):
    stored_event(received=at(2026, 11, 1, 9), status="processed")
    stored_event("card", "payment_intent.payment_failed", "failed", {"id": "evt_1"},
                 at(2026, 11, 2, 9), external_id="evt_1", last_error="OrderNotFound: FO-9")
    stored_event("crypto", "PAID", received=at(2026, 11, 3, 9))

    everything = run(database_url, "events", "list")
    lines = everything.stdout.splitlines()
    assert everything.returncode == 0
    assert lines[0].split()[:5] == ["ID", "RECEIVED", "(UTC)", "SOURCE", "TYPE"]
    assert [line.split()[3] for line in lines[1:]] == ["crypto", "card", "workflow"]
    assert "2026-11-02 09:00:00" in lines[2] and "OrderNotFound: FO-9" in lines[2]

    def sources(*filters):
        result = run(database_url, "events", "list", *filters)
        return [line.split()[3] for line in result.stdout.splitlines()[1:]]
    assert sources("--source", "card") == ["card"]
    assert sources("--status", "processed") == ["workflow"]
    assert sources("--since", "2026-11-02", "--until", "2026-11-03T00:00Z") == ["card"]
    assert sources("--since", "2026-11-02T10:00+01:00") == ["crypto", "card"]
    assert sources("--limit", "1") == ["crypto"]


def test_events_show_prints_the_payload_and_its_outbox_rows(database_url):
    event = stored_event(status="processed")
    outbox_row("dead", event=event)

    result = run(database_url, "events", "show", str(event.id))
    assert result.returncode == 0
    assert f"event:        #{event.id}" in result.stdout
    assert '  "entity_name": "Acme LLC",' in result.stdout  # pretty-printed
    dead = [line for line in result.stdout.splitlines() if " dead " in line]
    assert len(dead) == 1 and "HTTP 400: bad job" in dead[0]


def test_events_show_prints_a_payload_that_is_not_json_as_it_is(database_url):
    event = stored_event(status="rejected", payload="{not json", last_error="not JSON")
    result = run(database_url, "events", "show", str(event.id))
    assert result.returncode == 0
    assert "payload:\n{not json\n" in result.stdout and "last error:   not JSON" in result.stdout


def test_events_show_of_an_unknown_id_fails_with_1(database_url):
    result = run(database_url, "events", "show", "999")
    assert result.returncode == 1 and "no event #999" in result.stderr


# --- replay ---------------------------------------------------------------------------------

@pytest.mark.gen_test(timeout=60)
async def test_replay_handles_a_failed_event_and_force_sends_nothing_twice(
        database_url, settings, worker, frappe):
    event = stored_event(status="failed", last_error="OperationalError: database locked")
    env = cli_env(database_url, settings)

    first = await run_async(env, "events", "replay", str(event.id))
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"event #{event.id}: processed"
    assert [r.json["action"] for r in worker.requests] == ["name_search"]
    assert WebhookEvent.get_by_id(event.id).status == "processed"

    refused = await run_async(env, "events", "replay", str(event.id))
    assert refused.returncode == 1 and "add --force" in refused.stderr

    forced = await run_async(env, "events", "replay", str(event.id), "--force")
    assert forced.returncode == 0 and "processed" in forced.stdout
    assert len(worker.requests) == 1 and len(frappe.requests) == 1
    assert Outbox.select().count() == 2


@pytest.mark.gen_test(timeout=60)
async def test_replay_failed_handles_each_and_reports_those_still_failing(
        database_url, settings, worker):
    good = stored_event(status="failed")
    broken = stored_event(status="failed", payload="{not json", order_number="FO-2")
    stored_event(status="processed", order_number="FO-3")

    result = await run_async(cli_env(database_url, settings), "events", "replay", "--failed")
    assert result.returncode == 1
    # Not a terminal (cron, journald): no progress, the events still failing and a summary.
    assert result.stdout.splitlines() == [
        f"event #{broken.id} workflow formation/submitted: failed",
        "replayed 2 failed event(s); 1 still failing"]
    assert "%|" not in result.stderr  # no progress bar
    assert WebhookEvent.get_by_id(good.id).status == "processed"
    assert len(worker.requests) == 1
    assert WebhookEvent.get_by_id(broken.id).attempts == 1


@pytest.mark.gen_test(timeout=60)
async def test_replay_failed_shows_its_progress_on_a_terminal(database_url, settings, worker):
    for number in range(3):
        stored_event(status="failed", order_number=f"FO-{number}")
    async with OnATerminal("events", "replay", "--failed",
                           env=cli_env(database_url, settings)) as terminal:
        await terminal.finish()
    assert terminal.returncode == 0, terminal.shown
    # tqdm's bar: the count out of the total, the rate, the time left.
    assert re.search(r"replaying: +100%\|.*\| 3/3 \[\d\d:\d\d<[^,]+, +[\d.?]+event/s\]",
                     terminal.shown), terminal.shown
    assert terminal.stdout == "replayed 3 failed event(s); 0 still failing\n"
    assert len(worker.requests) == 3


@pytest.mark.gen_test(timeout=60)
async def test_a_dead_event_replays_without_force_with_its_attempts_afresh(
        database_url, settings, worker):
    dead = stored_event(status="dead", last_error="OrderNotFound: FO-1")
    WebhookEvent.update(attempts=10).where(WebhookEvent.id == dead.id).execute()
    result = await run_async(cli_env(database_url, settings), "events", "replay", "--failed")
    assert result.returncode == 0, result.stderr
    assert "replayed 1 failed event(s); 0 still failing" in result.stdout
    again = WebhookEvent.get_by_id(dead.id)
    assert (again.status, again.attempts) == ("processed", 1)
    assert len(worker.requests) == 1


def test_replay_of_an_unknown_event_fails_with_1(database_url):
    result = run(database_url, "events", "replay", "42")
    assert result.returncode == 1 and "no event #42" in result.stderr


# --- outbox ---------------------------------------------------------------------------------

def test_outbox_list_filters_by_status(database_url):
    outbox_row("dead", "k-dead")
    outbox_row("sent", "k-sent")
    result = run(database_url, "outbox", "list", "--status", "dead")
    rows = result.stdout.splitlines()[1:]
    assert result.returncode == 0 and len(rows) == 1 and "HTTP 400: bad job" in rows[0]


def test_outbox_retry_puts_a_dead_row_back_in_line_due_now(database_url):
    row = outbox_row("dead")
    before = datetime.datetime.now(UTC)
    result = run(database_url, "outbox", "retry", str(row.id))
    assert result.returncode == 0 and "back to pending" in result.stdout
    again = Outbox.get_by_id(row.id)
    assert (again.status, again.attempts) == ("pending", 0)
    assert before <= again.next_attempt_at <= datetime.datetime.now(UTC)
    # Kept where the console's timeline shows who retried the effect.
    (action,) = ConsoleAction.select()
    assert (action.operator, action.action, action.target) == (
        f"{getpass.getuser()} (command line)", "retry effect", str(row.id))


def test_outbox_retry_dead_requeues_every_dead_row_only(database_url):
    dead = [outbox_row("dead", f"k-{n}") for n in range(3)]
    sent = outbox_row("sent", "k-sent")
    result = run(database_url, "outbox", "retry", "--dead")
    assert result.returncode == 0 and result.stdout.startswith("3 dead row(s)")
    assert {Outbox.get_by_id(row.id).status for row in dead} == {"pending"}
    assert Outbox.get_by_id(sent.id).status == "sent"
    # Each retried row's timeline shows the retry, and who made it.
    assert sorted((a.target, a.operator, a.action) for a in ConsoleAction.select()) == sorted(
        (str(row.id), f"{getpass.getuser()} (command line)", "retry effect") for row in dead)


def test_outbox_list_shows_the_rows_waiting_for_their_destination(database_url):
    waiting = outbox_row("waiting", "k-waiting", attempts=0)
    Outbox.update(last_error="WORKER_URL is not set").where(Outbox.id == waiting.id).execute()
    outbox_row("pending", "k-pending")
    result = run(database_url, "outbox", "list", "--status", "waiting")
    [row] = result.stdout.splitlines()[1:]
    assert result.returncode == 0 and "waiting" in row and "WORKER_URL is not set" in row


@pytest.mark.parametrize("flag", ["--waiting", "--pending"])
def test_outbox_retry_waiting_or_pending_makes_those_rows_due_now(database_url, flag):
    status = flag[2:]
    chosen = [outbox_row(status, f"k-{n}") for n in range(2)]
    other = outbox_row("waiting" if status == "pending" else "pending", "k-other")
    before = datetime.datetime.now(UTC)
    result = run(database_url, "outbox", "retry", flag)
    assert result.returncode == 0
    assert result.stdout.startswith(f"2 {status} row(s) back to pending, due now")
    for row in chosen:
        again = Outbox.get_by_id(row.id)
        assert again.status == "pending" and again.next_attempt_at >= before
    untouched = Outbox.get_by_id(other.id)
    assert (untouched.status, untouched.next_attempt_at) == (other.status, other.next_attempt_at)


def test_outbox_retry_refuses_a_logged_row(database_url):
    logged = outbox_row("logged")
    refused = run(database_url, "outbox", "retry", str(logged.id))
    assert refused.returncode == 1 and "logged, not sent" in refused.stderr
    assert Outbox.get_by_id(logged.id).status == "logged"


def test_outbox_retry_refuses_a_sent_row_and_an_unknown_one(database_url):
    sent = outbox_row("sent")
    refused = run(database_url, "outbox", "retry", str(sent.id))
    assert refused.returncode == 1 and "not sent twice" in refused.stderr
    assert Outbox.get_by_id(sent.id).status == "sent"
    unknown = run(database_url, "outbox", "retry", "777")
    assert unknown.returncode == 1 and "no outbox row #777" in unknown.stderr


# --- settle ---------------------------------------------------------------------------------

def crtc_order(number, days_ago):
    return CrtcOrder.create(order_number=number, payment_status="paid", payment_method="card",
                            paid_at=datetime.datetime.now(UTC) - datetime.timedelta(days_ago))


@pytest.mark.gen_test(timeout=60)
async def test_settle_advances_a_settled_order_once(database_url, settings, frappe):
    crtc_order("CRTC-1", days_ago=8)
    crtc_order("CRTC-2", days_ago=0)
    result = await run_async(cli_env(database_url, settings), "settle")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "examined: 2, settled: 1, not due: 1, failed: 0"
    assert [json.loads(r.json["doc"])["name"] for r in frappe.requests] == ["CRTC-1"]
    assert CrtcOrder.get(CrtcOrder.order_number == "CRTC-1").funds_available


@pytest.mark.gen_test(timeout=60)
async def test_settle_exits_1_when_frappe_refuses(database_url, settings, frappe):
    crtc_order("CRTC-1", days_ago=8)
    frappe.fail_with(500)
    result = await run_async(cli_env(database_url, settings), "settle")
    assert result.returncode == 1 and "failed: 1" in result.stdout
    assert not CrtcOrder.get(CrtcOrder.order_number == "CRTC-1").funds_available


# --- the database is down -------------------------------------------------------------------

def test_an_unreachable_database_exits_1_without_its_password(database_url):
    result = run(database_url, "events", "list", env={
        "DATABASE_URL": "postgresql://operator:pg-password-zz@127.0.0.1:1/receiver"})
    assert result.returncode == 1
    assert result.stderr.startswith("receiver: database unavailable")
    assert "pg-password-zz" not in result.stderr + result.stdout


def test_migrate_with_the_database_down_says_so_in_one_line_and_exits_1(database_url):
    result = run(database_url, "migrate", env={
        "DATABASE_URL": "postgresql://operator:pg-password-zz@127.0.0.1:1/receiver"})
    assert result.returncode == 1
    assert result.stderr.startswith("receiver: database unavailable: ")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert "pg-password-zz" not in result.stderr + result.stdout


# --- a mistyped or unmigrated database: one line, an exit code, nothing created -------------

def run_in(folder, *args, database_url):
    """`receiver.py` run from `folder`, so that a relative SQLite path lands there."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "receiver.py"), *args],
                          cwd=folder, text=True, capture_output=True, timeout=60,
                          env={**os.environ, "DATABASE_URL": database_url})


@pytest.mark.parametrize("url", ["sqlite:///typo/receiver.sqlite3",
                                 "sqlite:///{tmp}/nonexistent/dir/receiver.sqlite3"],
                         ids=["relative", "absolute"])
@pytest.mark.parametrize("command", [("events", "list"), ("outbox", "retry", "--dead"),
                                     ("link", "ifta", "CO-1", "2026-Q3")])
def test_a_command_on_a_sqlite_path_with_no_database_creates_nothing(tmp_path, url, command):
    url = url.format(tmp=tmp_path)
    result = run_in(tmp_path, *command, database_url=url)
    path = url.removeprefix("sqlite:///")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"receiver: no database at {os.path.join(tmp_path, path)}: check "
                             "DATABASE_URL (`receiver.py migrate` creates one there)\n")
    assert os.listdir(tmp_path) == []


def test_a_command_on_an_unmigrated_database_says_to_migrate(tmp_path):
    (tmp_path / "empty.sqlite3").write_bytes(b"")
    result = run_in(tmp_path, "events", "list", database_url="sqlite:///empty.sqlite3")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith("receiver: the database is not up to date (")
    assert result.stderr.endswith("migration(s) not applied, from 0001_initial): check "
                                  "DATABASE_URL, then run `receiver.py migrate` (starting "
                                  "the service applies them too)\n")


@pytest.mark.parametrize("command", [("events", "list"), ("serve",), ("migrate",)])
def test_a_sqlite_url_with_two_slashes_is_refused_not_read_as_a_host(tmp_path, command):
    """sqlite://var/x.sqlite3 would open x.sqlite3 in the working folder, without var/."""
    result = run_in(tmp_path, *command, database_url="sqlite://var/x.sqlite3")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "receiver: DATABASE_URL: a SQLite path follows three slashes "
        "(sqlite:///var/receiver.sqlite3, relative to the working folder) or four "
        "(sqlite:////srv/receiver.sqlite3)\n")
    assert os.listdir(tmp_path) == []


def test_the_version_is_the_changelogs_latest():
    result = subprocess.run([sys.executable, "receiver.py", "--version"], cwd=ROOT, text=True,
                            capture_output=True)
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as changelog:
        latest = re.search(r"^## (\S+) \(\d{4}-\d{2}-\d{2}\)$", changelog.read(), re.M)
    assert result.returncode == 0 and latest is not None
    assert result.stdout.strip() == f"receiver.py {latest.group(1)}"
