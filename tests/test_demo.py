"""`receiver.py demo` as a newcomer runs it: the real command in a subprocess on free
ports, then the commands it prints, run by a shell as they are printed."""
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.checked_service import DEMO, refusals_to
from tests.service_process import ROOT, unused_port

READY_TIMEOUT_SECONDS = 30
LAST_LINE = "Stop the demo with Ctrl-C"


@pytest.fixture
def demo(tmp_path):
    """The demo running; yields (its printed instructions, its folder, its log path)."""
    folder, log_path = tmp_path / "demo", tmp_path / "demo.log"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RECEIVER_PORT": str(unused_port()),
           # Must not be touched: the demo keeps a database of its own.
           "DATABASE_URL": f"sqlite:///{tmp_path}/real.sqlite3",
           **refusals_to(tmp_path / "demo.log.refused")}
    with open(log_path, "wb") as log:
        # Under the suite's thread check (tests/checked_service.py).
        process = subprocess.Popen([*DEMO, "--folder", str(folder)],
                                   cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log)
    try:
        printed = _read_instructions(process, log_path)
        yield printed, folder, log_path
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
    assert not os.path.exists(tmp_path / "real.sqlite3")


def _read_instructions(process, log_path):
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    lines = []
    while not lines or not lines[-1].startswith(LAST_LINE):
        line = process.stdout.readline().decode()
        if not line or time.monotonic() > deadline:
            raise RuntimeError(f"the demo printed no instructions; log:\n{log_path.read_text()}")
        lines.append(line)
    return "".join(lines)


def step(printed, number):
    """The command lines of step `number`, as printed: after its `# N.` line, up to the
    blank line."""
    after = printed.split(f"\n# {number}. ", 1)[1]
    return after.split("\n\n", 1)[0].split("\n", 1)[1]


def shell(commands):
    result = subprocess.run(["bash", "-c", commands], cwd=ROOT, text=True,
                            capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def settings_lines(printed):
    """The lines of step 4 that give the terminal the demo's settings (not a command)."""
    return [line for line in step(printed, 4).splitlines() if "receiver.py" not in line]


def command(printed, line):
    """A command of step 4 as the newcomer runs it: after the settings lines."""
    return "\n".join([*settings_lines(printed), line])


def test_the_printed_put_creates_an_order_through_the_api_and_again_changes_nothing(demo):
    printed, folder, log_path = demo
    created = json.loads(shell(step(printed, 1)))
    assert (created["kind"], created["order_number"]) == ("canada_crtc", "CA-0003")
    assert created["shop"]["customer_name"] == "Hal Hertz Radio"
    assert created["service"]["payment_status"] == "pending_payment"
    put = step(printed, 1).replace("curl -s ", "curl -s -o /dev/null -w '%{http_code}' ", 1)
    assert shell(put) == "200"
    assert ca_payment(folder, "CA-0003") == "pending_payment"


def test_the_printed_crypto_callback_pays_the_order_made_and_the_cli_shows_it(demo):
    printed, folder, log_path = demo
    shell(step(printed, 1))
    assert shell(step(printed, 3)) == '{"received": true}'

    assert ca_payment(folder, "CA-0003") == "paid"
    [events_list] = [line for line in step(printed, 4).splitlines() if "events list" in line]
    listed = shell(command(printed, events_list)).splitlines()
    assert listed[0].split()[:5] == ["ID", "RECEIVED", "(UTC)", "SOURCE", "TYPE"]
    [row] = listed[1:]
    assert row.split()[3:6] == ["crypto", "PAID", "processed"] and "CA-0003" in row


def test_the_printed_webhook_reaches_the_worker_stand_in_and_the_link_works(demo):
    printed, folder, log_path = demo
    assert shell(step(printed, 2)) == '{"received": true, "action": "name_search_dispatched"}'
    link = step(printed, 5).strip()
    page = shell(f"curl -s '{link}'")
    assert "IFTA" in page and "could not find" not in page
    assert "Yes, I filed 2026-Q3 myself" in page
    console = step(printed, 6).strip()
    login = shell(f"curl -s -o /dev/null -w '%{{http_code}} %{{redirect_url}}' '{console}'")
    assert login.startswith("302 ") and "/console/login" in login
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while "stand-in worker: job name_search for FO-0001" not in log_path.read_text():
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)


def test_the_printed_settings_give_the_commands_the_demos_secret_and_spool(demo):
    """`link` signs with the demo's LINK_SECRET (the demo's page takes its link), and
    `spool quarantined` reads the demo's spool, not var/spool."""
    printed, folder, log_path = demo
    result = subprocess.run(
        ["bash", "-c", command(printed, ".venv/bin/python receiver.py link ifta CO-20001 2026-Q3")],
        cwd=ROOT, text=True, capture_output=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.strip() == step(printed, 5).strip()
    [quarantined] = [line for line in step(printed, 4).splitlines() if "spool quarantined" in line]
    last = shell(command(printed, quarantined)).splitlines()[-1]
    assert last == f"0 quarantined call(s) in {folder}/spool/unstorable.jsonl"


def demo_port(printed):
    return int(re.search(r"The demo listens on http://127\.0\.0\.1:(\d+)\.", printed)[1])


def second_demo(folder, port):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RECEIVER_PORT": str(port)}
    return subprocess.run([sys.executable, "receiver.py", "demo", "--folder", str(folder)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def ca_payment(folder, number):
    with sqlite3.connect(folder / "receiver.sqlite3") as db:
        return db.execute("SELECT payment_status FROM crtc_orders WHERE order_number = ?",
                          (number,)).fetchone()[0]


def test_a_second_demo_on_the_same_folder_leaves_the_running_one_alone(demo):
    printed, folder, log_path = demo
    shell(step(printed, 1))
    shell(step(printed, 3))
    assert ca_payment(folder, "CA-0003") == "paid"

    second = second_demo(folder, demo_port(printed))
    assert second.returncode == 1 and "Traceback" not in second.stderr
    assert second.stderr.splitlines()[-1] == (
        f"receiver: another demo is running on {folder}: stop it first (Ctrl-C in its "
        "terminal), or give this one --folder DIR")
    assert ca_payment(folder, "CA-0003") == "paid"


def test_a_second_demo_on_the_same_port_stops_before_making_its_database(demo, tmp_path):
    printed, folder, log_path = demo
    other = tmp_path / "other"
    port = demo_port(printed)
    second = second_demo(other, port)
    assert second.returncode == 1 and "Traceback" not in second.stderr
    assert second.stderr.splitlines()[-1].startswith(
        f"receiver: cannot listen on 127.0.0.1:{port}: the port is in use")
    assert not (other / "receiver.sqlite3").exists()


def test_the_demo_logs_no_error_while_its_printed_steps_run(demo):
    """Its stand-ins answer what the service asks (who we are, Frappe's lists, a document):
    the service's check of Frappe passes, the reconciliation runs, and nothing in the
    log is an ERROR or a traceback."""
    printed, folder, log_path = demo
    for number in (1, 2, 3):
        shell(step(printed, number))
    shell(step(printed, 5).strip().join(("curl -s -o /dev/null '", "'")))
    base = f"http://127.0.0.1:{demo_port(printed)}"
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while True:
        ready = json.loads(shell(f"curl -s {base}/readyz"))
        log = log_path.read_text()
        if (len(ready.get("reconciled", {})) == 2 and "stand-in Telegram" in log
                and "stand-in worker: job name_search for FO-0001" in log):
            break
        assert time.monotonic() < deadline, log
        time.sleep(0.2)
    assert ready["destinations"]["workflow"] == "up" and "destination_problems" not in ready
    assert "its configuration check passed" in log
    runs = shell(f"curl -s {base}/metrics")
    assert 'receiver_job_runs_total{job="reconcile",result="failed"} 0.0' in runs
    assert [line for line in (printed + log).splitlines()
            if " ERROR " in line or "Traceback" in line or "WARNING" in line] == []
