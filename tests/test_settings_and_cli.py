"""Settings from the environment, the production guard, and the command line."""
import os
import subprocess
import sys

import pytest

from settings import ConfigurationError, Settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRODUCTION = {
    "RECEIVER_ENV": "production", "WEBHOOK_SECRET": "s1", "LINK_SECRET": "s2",
    "STRIPE_WEBHOOK_SECRET": "whsec_a", "CRYPTO_PROCESSOR_API_KEY": "k",
}


def test_defaults_are_those_documented():
    s = Settings.from_env({})
    assert (s.host, s.port, s.env) == ("127.0.0.1", 8000, "development")
    assert s.database_url == "sqlite:///var/receiver.sqlite3"
    assert (s.workflow_doctype, s.crtc_doctype, s.crtc_funds_action) == (
        "Formation Order", "CRTC Order", "Confirm Funds")
    assert (s.settlement_interval_minutes, s.max_body_bytes) == (60, 1024 * 1024)


def test_settings_are_read_and_trimmed():
    s = Settings.from_env({"RECEIVER_PORT": " 9001 ", "WORKER_URL": "http://w:1/",
                           "STRIPE_WEBHOOK_SECRET": "whsec_old, whsec_new ,"})
    assert s.port == 9001 and s.worker_url == "http://w:1"
    assert s.stripe_webhook_secrets == ("whsec_old", "whsec_new")


def test_a_bad_number_is_named():
    with pytest.raises(ConfigurationError, match="RECEIVER_PORT"):
        Settings.from_env({"RECEIVER_PORT": "eighty"})


def test_production_starts_with_real_secrets():
    assert Settings.from_env(PRODUCTION).production


@pytest.mark.parametrize("name", ["WEBHOOK_SECRET", "LINK_SECRET", "STRIPE_WEBHOOK_SECRET",
                                  "CRYPTO_PROCESSOR_API_KEY"])
def test_production_refuses_a_missing_or_placeholder_secret(name):
    env = {k: v for k, v in PRODUCTION.items() if k != name}
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_env(env)


def run(*args, env=None):
    return subprocess.run([sys.executable, "receiver.py", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=60,
                          env={**os.environ, **(env or {})})


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
