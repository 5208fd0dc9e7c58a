"""`receiver.py` with the test suite's thread check (tests/door.py) installed: how the
suite starts a service as a subprocess (tests/service_process.py), so that a statement
the service runs outside the door fails the test that started it, as it does in-process.

    python -m tests.checked_service serve    (or demo --folder ...)

Each refusal is appended to the file named by DOOR_REFUSALS_FILE as it happens (so a
SIGKILL loses none); the suite's fixture reads it (tests/door.py `service_refusals`).
DOOR_TEST_PLUGIN, when set, names a module imported before the service starts: the
suite's way to add a path to the service (tests/off_door_plugin.py)."""
import importlib
import os
import sys
import tempfile
import threading

from tests.door import ROOT, SERVICE_REFUSAL_FILES, ThreadCheck

CHECKED = [sys.executable, "-m", "tests.checked_service"]
SERVE = [*CHECKED, "serve"]
DEMO = [*CHECKED, "demo"]

# Allowed callers in a service process, by name. Narrower than the suite's own: the
# process runs no test code, so tests/ is not allowed (a test plugin that talks to the
# database on the loop is refused, as the service's own code would be).
# - migrations/, and app.server.run_migrations around them (on PostgreSQL it lifts the
#   statement timeout for them): run at start-up, before the server listens, or by the
#   circuit's probe once the database is back (a thread allowed already). Nothing else
#   waits on the loop then, and a long migration must not be cut short by the timeout.
# - app.demo.fresh_database (`receiver.py demo`): makes the demo's database and seeds its
#   sample orders before the demo's service starts, in a process that serves nobody yet.
CALLERS_ALLOWED = (os.path.join(ROOT, "migrations") + os.sep,
                   os.path.join(ROOT, "app", "server.py") + ":run_migrations",
                   os.path.join(ROOT, "app", "demo.py") + ":fresh_database")

_report_lock = threading.Lock()


def refusals_to(path):
    """The environment that sends a service's refusals to `path`, which the suite's
    fixture then reads after the test (tests/door.py `service_refusals`)."""
    path = str(path)
    if path not in SERVICE_REFUSAL_FILES:
        SERVICE_REFUSAL_FILES.append(path)
    return {"DOOR_REFUSALS_FILE": path}


def refusals_file():
    """A new file for one command's refusals (`refusals_to`)."""
    handle, path = tempfile.mkstemp(prefix="receiver-", suffix=".refused")
    os.close(handle)
    return path


def report_to(path):
    def report(refusal):
        with _report_lock, open(path, "a", encoding="utf-8") as handle:
            handle.write(refusal + "\n")
    return report


def main():
    check = ThreadCheck(CALLERS_ALLOWED, report_to(os.environ["DOOR_REFUSALS_FILE"]))
    check.install()
    if plugin := os.environ.get("DOOR_TEST_PLUGIN"):
        importlib.import_module(plugin)
    from app.cli import main as receiver
    return receiver(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
