"""deploy/: the systemd unit passes systemd's own checks, and the example environment file
and README name every setting the service reads."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from settings import Settings
from tests.ops_helpers import ROOT

DEPLOY = os.path.join(ROOT, "deploy")


def read(*path):
    with open(os.path.join(*path), encoding="utf-8") as f:
        return f.read()


class RecordingEnviron(dict):
    """An empty environment that notes every name the settings ask for."""

    def __init__(self):
        super().__init__()
        self.asked = set()

    def get(self, name, default=None):
        self.asked.add(name)
        return super().get(name, default)


def setting_names():
    environ = RecordingEnviron()
    Settings.from_env(environ)
    return environ.asked


def unit_settings():
    lines = read(DEPLOY, "receiver.service").splitlines()
    return [tuple(line.split("=", 1)) for line in lines if re.match(r"^[A-Z]\w*=", line)]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed on this machine")
def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart exists: point it at this checkout's interpreter.
    unit = read(DEPLOY, "receiver.service").replace(
        "/opt/receiver/.venv/bin/python", sys.executable).replace("/opt/receiver", ROOT)
    (tmp_path / "receiver.service").write_text(unit)
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", "receiver.service"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, "")


def test_the_unit_is_notify_restarting_and_hardened():
    settings = dict(unit_settings())
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert settings["Restart"] == "on-failure"
    assert settings["EnvironmentFile"] == "/etc/receiver/receiver.env"
    assert settings["User"] == "receiver" and settings["ExecStart"].endswith("receiver.py serve")
    assert settings["ProtectSystem"] == "strict"
    assert settings["ReadWritePaths"] == "/opt/receiver/var"
    for option in ("NoNewPrivileges", "PrivateTmp", "ProtectHome", "PrivateDevices"):
        assert settings[option] == "yes", option
    # Longer than the service's own grace for requests in flight, so it exits by itself.
    from receiver import SHUTDOWN_GRACE_SECONDS
    assert int(settings["TimeoutStopSec"]) > SHUTDOWN_GRACE_SECONDS


def test_the_example_environment_lists_every_setting_and_nothing_else():
    listed = set(re.findall(r"^#?([A-Z][A-Z0-9_]+)=", read(DEPLOY, "receiver.env.example"),
                            re.MULTILINE))
    assert listed == setting_names()


def test_the_example_environment_reads_alike_in_a_shell(tmp_path):
    """deploy/rcv sources the file with sh, systemd parses it itself: every line, once
    uncommented and with the secrets filled in, must mean the same to both."""
    example = read(DEPLOY, "receiver.env.example")
    filled = re.sub(r"^#([A-Z])", r"\1", example, flags=re.MULTILINE)
    filled = re.sub(r"^([A-Z_]+(SECRET|_KEY))=$", r"\1=s3cret", filled, flags=re.MULTILINE)
    filled = filled.replace("=sqlite:///var/", f"=sqlite:///{tmp_path}/")
    (tmp_path / "receiver.env").write_text(filled)
    script = (f"set -a; . {tmp_path}/receiver.env; set +a; exec {sys.executable} -c "
              "'from settings import Settings; s = Settings.from_env(); "
              "print(s.env, s.workflow_doctype, s.crtc_funds_action, sep=\"|\")'")
    result = subprocess.run(["sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "production|Formation Order|Confirm Funds"


def test_the_example_environment_sets_no_secret():
    example = read(DEPLOY, "receiver.env.example")
    for name in ("WEBHOOK_SECRET", "STRIPE_SECRET_KEY", "STRIPE_WEBHOOK_SECRET",
                 "CRYPTO_PROCESSOR_API_KEY", "LINK_SECRET", "WORKFLOW_API_SECRET"):
        assert re.search(rf"^{name}=$", example, re.MULTILINE), name


def test_readme_documents_every_setting():
    readme = read(ROOT, "README.md")
    missing = sorted(name for name in setting_names() if name not in readme)
    assert missing == []
