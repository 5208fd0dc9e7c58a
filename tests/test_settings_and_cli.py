"""Settings from the environment, the production guard, and the command line."""
import decimal
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import psycopg2
import pytest

from settings import ConfigurationError, Settings
from tests.checked_service import CHECKED, refusals_file, refusals_to
from tests.service_process import postgres_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRODUCTION = {
    "RECEIVER_ENV": "production", "WEBHOOK_SECRET": "workflow-secret-for-the-tests-0123456789", "LINK_SECRET": "link-secret-for-the-tests-0123456789abc",
    "ADMIN_EMAIL": "ops@example.com",
    "STRIPE_SECRET_KEY": "sk_live_a", "STRIPE_WEBHOOK_SECRET": "whsec_a",
    "CRYPTO_PROCESSOR_API_KEY": "k",
}


def test_defaults_are_those_documented():
    s = Settings.from_env({})
    assert (s.host, s.port, s.env) == ("127.0.0.1", 8000, "development")
    assert s.database_url == "sqlite:///var/receiver.sqlite3"
    assert (s.workflow_doctype, s.crtc_doctype, s.crtc_funds_action) == (
        "Formation Order", "CRTC Order", "Confirm Funds")
    assert (s.settlement_interval_minutes, s.max_body_bytes) == (60, 1024 * 1024)


def test_the_workflow_answer_budget_and_dedup_window_are_read():
    assert (Settings().workflow_answer_budget_seconds, Settings().workflow_dedup_hours) == (4, 36)
    s = Settings.from_env({"WORKFLOW_ANSWER_BUDGET_SECONDS": "2.5", "WORKFLOW_DEDUP_HOURS": "48"})
    assert (s.workflow_answer_budget_seconds, s.workflow_dedup_hours) == (2.5, 48)


@pytest.mark.parametrize("env,base", [
    ({}, "http://127.0.0.1:8000"),
    ({"RECEIVER_PORT": "8123"}, "http://127.0.0.1:8123"),
    ({"RECEIVER_HOST": "0.0.0.0", "RECEIVER_PORT": "9000"}, "http://127.0.0.1:9000"),
    ({"RECEIVER_HOST": "::", "RECEIVER_PORT": "9000"}, "http://[::1]:9000"),
    ({"RECEIVER_HOST": "10.0.0.5"}, "http://10.0.0.5:8000"),
    ({"RECEIVER_PORT": "8123", "PUBLIC_BASE_URL": "https://orders.example.com/"},
     "https://orders.example.com"),
], ids=["defaults", "port", "any-address", "any-ipv6", "host", "set"])
def test_the_public_base_url_defaults_to_the_address_served(env, base):
    assert Settings.from_env(env).public_base_url == base


def test_a_printed_link_points_at_the_port_served(database_url):
    from tests.public_helpers import compliance_order
    compliance_order("CO-20001")
    result = run("link", "ifta", "CO-20001", "2026-Q3", env={
        "RECEIVER_PORT": "8123", "PUBLIC_BASE_URL": "", "DATABASE_URL": database_url})
    assert result.returncode == 0
    assert result.stdout.startswith("http://127.0.0.1:8123/api/v1/ifta/filed?")


def test_settings_are_read_and_trimmed():
    s = Settings.from_env({"RECEIVER_PORT": " 9001 ", "WORKER_URL": "http://w:1/",
                           "STRIPE_WEBHOOK_SECRET": "whsec_old, whsec_new ,"})
    assert s.port == 9001 and s.worker_url == "http://w:1"
    assert s.stripe_webhook_secrets == ("whsec_old", "whsec_new")


def test_the_crypto_tolerance_is_a_percentage_kept_exactly():
    assert Settings.from_env({"CRYPTO_PAYMENT_TOLERANCE_PERCENT": " 2.5 "}) \
        .crypto_payment_tolerance_percent == decimal.Decimal("2.5")


def test_a_bad_number_is_named():
    with pytest.raises(ConfigurationError, match="RECEIVER_PORT"):
        Settings.from_env({"RECEIVER_PORT": "eighty"})


def test_production_starts_with_real_secrets():
    assert Settings.from_env(PRODUCTION).production


@pytest.mark.parametrize("name", ["WEBHOOK_SECRET", "LINK_SECRET", "STRIPE_SECRET_KEY",
                                  "STRIPE_WEBHOOK_SECRET", "CRYPTO_PROCESSOR_API_KEY"])
def test_production_refuses_a_missing_or_placeholder_secret(name):
    env = {k: v for k, v in PRODUCTION.items() if k != name}
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_env(env)


@pytest.mark.parametrize("env,named", [
    ({"BUSINESS_TZ": "Mars/Olympus"}, "BUSINESS_TZ"),
    ({"DATABASE_URL": "mysql://root@localhost/db"}, "DATABASE_URL"),
    ({"SMTP_URL": "mail.example.test:25"}, "SMTP_URL"),
    ({"WORKER_URL": "worker.internal:9000"}, "WORKER_URL"),
    ({"TELEGRAM_API_URL": "api.telegram.org"}, "TELEGRAM_API_URL"),
    ({"WORKFLOW_URL": "https://"}, "WORKFLOW_URL"),
    ({"SETTLEMENT_INTERVAL_MINUTES": "0"}, "SETTLEMENT_INTERVAL_MINUTES"),
    ({"OUTBOUND_TIMEOUT_SECONDS": "-1"}, "OUTBOUND_TIMEOUT_SECONDS"),
    ({"PUBLIC_RATE_LIMIT": "-5"}, "PUBLIC_RATE_LIMIT"),
    ({"RECEIVER_LOG_FORMAT": "jsno"}, "RECEIVER_LOG_FORMAT"),
    ({"WORKFLOW_ANSWER_BUDGET_SECONDS": "0"}, "WORKFLOW_ANSWER_BUDGET_SECONDS"),
    ({"WORKFLOW_ANSWER_BUDGET_SECONDS": "nan"}, "WORKFLOW_ANSWER_BUDGET_SECONDS"),
    ({"WORKFLOW_ANSWER_BUDGET_SECONDS": "four"}, "WORKFLOW_ANSWER_BUDGET_SECONDS"),
    ({"WORKFLOW_DEDUP_HOURS": "0"}, "WORKFLOW_DEDUP_HOURS"),
    ({"WORKFLOW_DEDUP_HOURS": "1.5"}, "WORKFLOW_DEDUP_HOURS"),
    ({"CRYPTO_PAYMENT_TOLERANCE_PERCENT": "five"}, "CRYPTO_PAYMENT_TOLERANCE_PERCENT"),
    ({"CRYPTO_PAYMENT_TOLERANCE_PERCENT": "-1"}, "CRYPTO_PAYMENT_TOLERANCE_PERCENT"),
    ({"CRYPTO_PAYMENT_TOLERANCE_PERCENT": "NaN"}, "CRYPTO_PAYMENT_TOLERANCE_PERCENT"),
])
def test_a_setting_that_could_only_fail_later_is_refused_at_start_up(env, named):
    with pytest.raises(ConfigurationError, match=named):
        Settings.from_env(env)


def test_a_refused_url_is_named_without_its_password():
    with pytest.raises(ConfigurationError) as refused:
        Settings.from_env({"DATABASE_URL": "mysql://root:hunter2@db/x"})
    assert "hunter2" not in str(refused.value)


def test_the_settings_repr_shows_no_secret():
    settings = Settings.from_env({**PRODUCTION, "SMTP_URL": "smtp://u:mailpass@mx:25",
                                  "DATABASE_URL": "postgresql://u:dbpass@h/d",
                                  "TELEGRAM_BOT_TOKEN": "123:bot", "WORKFLOW_API_SECRET": "wfs"})
    shown = repr(settings)
    for secret in (PRODUCTION["WEBHOOK_SECRET"], PRODUCTION["LINK_SECRET"], "sk_live_a", "whsec_a", "mailpass", "dbpass", "123:bot", "wfs"):
        assert f"'{secret}" not in shown and f"{secret}'" not in shown, secret


def test_a_bad_setting_exits_2_with_one_line(tmp_path):
    result = run("serve", env={"BUSINESS_TZ": "Nowhere/Atall",
                               "DATABASE_URL": f"sqlite:///{tmp_path}/x.sqlite3"})
    assert result.returncode == 2
    assert result.stderr.strip().startswith("receiver: BUSINESS_TZ")


def run(*args, env=None):
    return subprocess.run([*CHECKED, *args], cwd=ROOT, text=True, capture_output=True,
                          timeout=60, env={**os.environ, **(env or {}),
                                           **refusals_to(refusals_file())})


def test_help_explains_the_commands():
    result = run("--help")
    assert result.returncode == 0
    assert "serve" in result.stdout and "migrate" in result.stdout


def test_migrate_applies_once(tmp_path):
    env = {"DATABASE_URL": f"sqlite:///{tmp_path}/cli.sqlite3"}
    first, second = run("migrate", env=env), run("migrate", env=env)
    assert first.returncode == 0 and "0001_initial" in first.stdout
    assert second.returncode == 0 and "up to date" in second.stdout


def test_production_without_secrets_refuses_to_start_and_says_why(tmp_path):
    result = run("serve", env={"RECEIVER_ENV": "production", "WEBHOOK_SECRET": "",
                               "DATABASE_URL": f"sqlite:///{tmp_path}/x.sqlite3"})
    assert result.returncode == 2
    assert "WEBHOOK_SECRET" in result.stderr


def test_the_scheduler_library_does_not_log_every_tick():
    import logging

    from app.logs import configure_logging
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configure_logging(Settings())
    try:
        assert not logging.getLogger("apscheduler").isEnabledFor(logging.INFO)
        assert logging.getLogger("receiver.scheduler").isEnabledFor(logging.INFO)
    finally:
        logging.getLogger("apscheduler").setLevel(logging.NOTSET)
        root.handlers[:] = handlers
        root.setLevel(level)


# --- start-up failures: one line saying what and what to do, no traceback -------------------

def serve_env(tmp_path, **env):
    return {"DATABASE_URL": f"sqlite:///{tmp_path}/x.sqlite3",
            "SPOOL_DIR": str(tmp_path / "spool"), **env}


def test_serve_with_its_port_taken_says_so_in_one_line_and_exits_1(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("serve", env=serve_env(tmp_path, RECEIVER_PORT=str(port)))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"receiver: cannot listen on 127.0.0.1:{port}: the port is in use (is the service "
        "already running?); stop that process or set RECEIVER_PORT to a free port")


def test_serve_on_an_address_not_of_this_machine_is_a_settings_error(tmp_path):
    # 192.0.2.0/24 is reserved for documentation: no machine has it.
    result = run("serve", env=serve_env(tmp_path, RECEIVER_HOST="192.0.2.1"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith("receiver: cannot listen on 192.0.2.1:8000: ")
    assert result.stderr.splitlines()[-1].endswith("; check RECEIVER_HOST and RECEIVER_PORT")


@pytest.mark.parametrize("database", ["refusing connections", "silent"])
def test_serve_with_the_database_unreachable_serves_and_says_so_without_the_password(
        tmp_path, database):
    """A restart during an outage: it serves (calls go to the spool, /readyz says why) and
    stops cleanly; the log names the outage once and never the password. Nothing listens
    on port 1; a socket that listens and never answers is a server that says nothing."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        database_port = 1 if database == "refusing connections" else silent.getsockname()[1]
        service = subprocess.Popen(
            [sys.executable, "receiver.py", "serve"], cwd=ROOT, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **serve_env(
                tmp_path, RECEIVER_PORT=str(port), DATABASE_URL=(
                    f"postgresql://operator:pg-password-zz@127.0.0.1:{database_port}/receiver"))})
        _serves_through_the_outage(service, port)
    assert service.returncode == 0
    output = service.stdout.read()
    assert output.count("database unavailable at start") == 1 and "Traceback" not in output
    assert "pg-password-zz" not in output


def _serves_through_the_outage(service, port):
    try:
        ready = None
        for _ in range(300):
            try:
                ready = urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
            except urllib.error.HTTPError as answered:
                ready = answered
                break
            except OSError:
                time.sleep(0.1)
        assert ready is not None and ready.code == 503
        assert json.loads(ready.read())["checks"]["database"] == \
            "unreachable; migrations wait for it"
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=60)
    finally:
        service.kill()


# A role every PostgreSQL has and lets no one log in as (NOLOGIN): no role of our own to
# create, which the suite's own role may not do.
NOT_LET_IN = "pg_monitor"


def server_refusal(url):
    """What the server says when refusing `url`: its own words, as libpq gives them."""
    with pytest.raises(psycopg2.OperationalError) as refused:
        psycopg2.connect(url, connect_timeout=10).close()
    return str(refused.value).split("FATAL:", 1)[-1].strip().splitlines()[0]


@postgres_only
@pytest.mark.parametrize("wrong,reason", [
    ("database", 'database "receiver_no_such_database" does not exist'),
    ("role", 'role "receiver_no_such_role" does not exist'),
    ("login", f'role "{NOT_LET_IN}" is not permitted to log in'),
])
def test_serve_and_the_commands_on_a_database_refusing_our_settings_exit_1_with_one_line(
        tmp_path, database_url, wrong, reason):
    """A database that does not exist, or a role it refuses, is a setting to fix, not an
    outage: `serve` does not listen and spool, it says why on one line (the server's
    reason, never the password) and exits 1; so do `migrate` and the operator's commands.
    A server that asks for passwords says of a role it refuses only that the password
    failed (it does not tell which roles exist): the same refusal, in its words."""
    parts = urllib.parse.urlsplit(database_url)
    user, name = {"database": (parts.username, "receiver_no_such_database"),
                  "role": ("receiver_no_such_role", parts.path.lstrip("/")),
                  "login": (NOT_LET_IN, parts.path.lstrip("/"))}[wrong]
    # The suite's own password where the role is ours, so the server gets to the database.
    password = parts.password if wrong == "database" else "pg-password-zz"
    login = f"{user}:{password}" if password else user
    url = urllib.parse.urlunsplit(parts._replace(
        netloc=f"{login}@{parts.hostname}:{parts.port or 5432}", path=f"/{name}"))
    said = server_refusal(url)
    assert said in (reason, f'password authentication failed for user "{user}"'), said
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    expected = (f"receiver: the database refuses our settings: {said}; check DATABASE_URL "
                "(the database's name, the user and its password)\n")
    for command in ("serve", "migrate", "events"):
        result = run(command, *(("list",) if command == "events" else ()),
                     env=serve_env(tmp_path, RECEIVER_PORT=str(port), DATABASE_URL=url))
        assert (result.returncode, result.stderr) == (1, expected), command
        assert not password or password not in result.stderr
    assert not os.path.exists(tmp_path / "spool")


def test_run_without_the_venv_says_how_to_run_it():
    # -S: no site-packages, as a Python without the service's packages installed.
    result = subprocess.run([sys.executable, "-S", "receiver.py", "events", "list"], cwd=ROOT,
                            text=True, capture_output=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("receiver: No module named ")
    assert "run `make run` once (it installs them into .venv), then `.venv/bin/python " \
           "receiver.py ...`" in result.stderr


def test_production_without_admin_email_refuses_to_start_and_says_why(tmp_path):
    """Dead effects and rejected payments would otherwise reach only the log."""
    env = {name: value for name, value in PRODUCTION.items() if name != "ADMIN_EMAIL"}
    with pytest.raises(ConfigurationError, match="ADMIN_EMAIL"):
        Settings.from_env(env)
    result = run("serve", env={**env, "ADMIN_EMAIL": "",
                               "DATABASE_URL": f"sqlite:///{tmp_path}/x.sqlite3"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == ("receiver: RECEIVER_ENV=production needs ADMIN_EMAIL: dead "
                             "effects, rejected payments and quarantined calls are mailed "
                             "there\n")
    assert not (tmp_path / "x.sqlite3").exists()


@pytest.mark.parametrize("said,refused", [
    ('connection to server at "db", port 5432 failed: FATAL:  password authentication '
     'failed for user "receiver"\n', 'password authentication failed for user "receiver"'),
    ('connection to server at "db", port 5432 failed: FATAL:  no pg_hba.conf entry for host '
     '"10.0.0.7", user "receiver", database "receiver", no encryption\n',
     'no pg_hba.conf entry for host "10.0.0.7", user "receiver", database "receiver", no '
     'encryption'),
    ('connection to server at "db", port 5432 failed: fe_sendauth: no password supplied\n',
     'connection to server at "db", port 5432 failed: fe_sendauth: no password supplied'),
    ('connection to server at "db", port 5432 failed: Connection refused\n\tIs the server '
     'running on that host and accepting TCP/IP connections?\n', None),
    ('connection to server at "db", port 5432 failed: timeout expired\n', None),
    ("the database did not answer within 1 s", None),
    ("server closed the connection unexpectedly", None),
    ('connection to server at "db", port 5432 failed: FATAL:  the database system is '
     'starting up\n', None),
    ('connection to server at "db", port 5432 failed: FATAL:  sorry, too many clients '
     'already\n', None),
])
def test_a_refusal_of_our_settings_is_told_from_an_outage(said, refused):
    """The refusals a server gives while the connection is made, which psycopg2 passes on
    as text alone; the outages stay outages."""
    from engine.db import refused_settings
    from engine.errors import DatabaseDown
    assert refused_settings(DatabaseDown(said)) == refused
