"""deploy/: the systemd unit passes systemd's own checks, and the example environment file
and docs/SETTINGS.md name every setting the service reads."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from app.connections import connection_cap
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
@pytest.mark.parametrize("name,instance", [("receiver.service", "receiver.service"),
                                           ("receiver@.service", "receiver@8001.service")])
def test_the_unit_passes_systemd_analyze_verify(tmp_path, name, instance):
    # verify checks that ExecStart exists: point it at this checkout's interpreter.
    unit = read(DEPLOY, name).replace(
        "/opt/receiver/.venv/bin/python", sys.executable).replace("/opt/receiver", ROOT)
    (tmp_path / name).write_text(unit)
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", instance],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, "")


def test_the_unit_gives_room_for_the_connections_it_allows():
    settings = dict(unit_settings())
    limit = int(settings["LimitNOFILE"])
    assert connection_cap(Settings().max_connections, limit) == Settings().max_connections


def test_the_unit_is_notify_restarting_and_hardened():
    settings = dict(unit_settings())
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert settings["Restart"] == "on-failure"
    # Exit 2 is a settings error (see receiver.py): restarting cannot mend it.
    assert settings["RestartPreventExitStatus"] == "2"
    assert settings["EnvironmentFile"] == "/etc/receiver/receiver.env"
    assert settings["User"] == "receiver" and settings["ExecStart"].endswith("receiver.py serve")
    assert settings["ProtectSystem"] == "strict"
    assert settings["ReadWritePaths"] == "/opt/receiver/var"
    for option in ("NoNewPrivileges", "PrivateTmp", "ProtectHome", "PrivateDevices"):
        assert settings[option] == "yes", option
    # Longer than the service's own grace for requests in flight, so it exits by itself.
    from app.server import SHUTDOWN_GRACE_SECONDS
    assert int(settings["TimeoutStopSec"]) > SHUTDOWN_GRACE_SECONDS


def test_the_instance_template_is_the_unit_with_the_port_as_its_instance_name():
    # One unit to keep hardened: the template may differ only in these lines.
    template = read(DEPLOY, "receiver@.service").splitlines()
    unit = read(DEPLOY, "receiver.service").splitlines()
    only_in_template = [line for line in template if line not in unit]
    only_in_unit = [line for line in unit if line not in template]
    settings = [line for line in only_in_template if not line.startswith("#")]
    assert settings == ["Description=Order-fulfilment webhook receiver on port %i",
                        "EnvironmentFile=-/etc/receiver/receiver-%i.env",
                        "Environment=RECEIVER_PORT=%i"]
    assert [line for line in only_in_unit if not line.startswith("#")] == [
        "Description=Order-fulfilment webhook receiver"]


def test_the_example_environment_lists_every_setting_and_nothing_else():
    listed = set(re.findall(r"^#?([A-Z][A-Z0-9_]+)=", read(DEPLOY, "receiver.env.example"),
                            re.MULTILINE))
    assert listed == setting_names()


ENVEXEC = os.path.join(DEPLOY, "envexec.py")


def run_with_env_file(path, code):
    """deploy/envexec.py reading `path`, then a Python child printing what it was given."""
    return subprocess.run([sys.executable, ENVEXEC, str(path), sys.executable, "-c", code],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_the_example_environment_reads_as_systemd_reads_it(tmp_path):
    """deploy/rcv runs envexec.py on the file: every line of the example, once uncommented
    and with the secrets filled in, gives the settings the service gets."""
    example = read(DEPLOY, "receiver.env.example")
    filled = re.sub(r"^#([A-Z])", r"\1", example, flags=re.MULTILINE)
    filled = re.sub(r"^([A-Z_]+(SECRET|_KEY))=$", r"\1=s3cret", filled, flags=re.MULTILINE)
    filled = filled.replace("\nADMIN_EMAIL=\n", "\nADMIN_EMAIL=ops@example.com\n")
    filled = filled.replace("=sqlite:///var/", f"=sqlite:///{tmp_path}/")
    (tmp_path / "receiver.env").write_text(filled)
    result = run_with_env_file(
        tmp_path / "receiver.env", "from settings import Settings; s = Settings.from_env(); "
        "print(s.env, s.workflow_doctype, s.crtc_funds_action, sep='|')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "production|Formation Order|Confirm Funds"


def test_rcv_takes_dollar_backquote_and_backslash_as_systemd_does(tmp_path):
    """What systemd's EnvironmentFile= makes of each line (env-file.c); `sh` would expand
    $HOME and `id`, and eat the backslashes."""
    (tmp_path / "receiver.env").write_text(
        "# a comment\n"
        "; another\n"
        "SMTP_PASS='p\"ss\\w0rd$HOME`id`'\n"
        'DOUBLE="a \\"b\\" \\$x \\\\ \\q"\n'
        "BARE=x\\$y\\ z$HOME  \n"
        "  SPACED = keep inner  spaces\n"
        "CONTINUED=one\\\ntwo\n"
        "EMPTY=\n"
        "NO_EQUALS\n"
        "9BAD=ignored\n")
    names = ["SMTP_PASS", "DOUBLE", "BARE", "SPACED", "CONTINUED", "EMPTY", "NO_EQUALS",
             "9BAD"]
    result = run_with_env_file(
        tmp_path / "receiver.env",
        f"import json, os; print(json.dumps({{n: os.environ.get(n) for n in {names!r}}}))")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "SMTP_PASS": 'p"ss\\w0rd$HOME`id`', "DOUBLE": 'a "b" $x \\ \\q',
        "BARE": "x$y z$HOME", "SPACED": "keep inner  spaces", "CONTINUED": "onetwo",
        "EMPTY": "", "NO_EQUALS": None, "9BAD": None}


def test_rcv_reads_the_file_with_envexec_not_a_shell():
    rcv = read(DEPLOY, "rcv")
    assert "envexec.py /etc/receiver/receiver.env" in rcv and ". /etc/" not in rcv


def test_the_example_environment_sets_no_secret():
    example = read(DEPLOY, "receiver.env.example")
    for name in ("WEBHOOK_SECRET", "STRIPE_SECRET_KEY", "STRIPE_WEBHOOK_SECRET",
                 "CRYPTO_PROCESSOR_API_KEY", "LINK_SECRET", "WORKFLOW_API_SECRET"):
        assert re.search(rf"^{name}=$", example, re.MULTILINE), name


def test_the_settings_page_documents_every_setting():
    page = read(ROOT, "docs", "SETTINGS.md")
    missing = sorted(name for name in setting_names() if name not in page)
    assert missing == []
