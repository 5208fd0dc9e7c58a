"""The thread check: in the test suite the database refuses a statement the service
runs anywhere but through the door (engine.commits: a turn of the group commit, in the
database thread). A new path that talks to the database on the loop, or from any other
thread, fails every test that takes it.

Allowed besides, by name:
- THREADS_ALLOWED: the scheduler's advisory locks (a session-level lock belongs to the
  connection that took it, so they have a thread and connection of their own) and the
  circuit's probe (a fresh connection of its own, which must work while the database
  thread is stuck);
- CALLERS_ALLOWED: a statement written in the test suite itself (set-up that seeds rows,
  checks that read them; the fixtures) or in a migration (run before the service serves).
  What counts is the code that asked for the statement: a test calling a service
  function that runs a statement on its thread is refused like the service would be.
  A test that calls the service's synchronous database code (to seed rows with
  Effects, say, or to see what a query finds) runs it `through_the_door(...)`, in the
  database thread.

The services the suite starts as subprocesses run the same check (tests/checked_service.py,
with its own allow-list), each writing what it refused to a file; `service_refusals()`
reads those, and the suite's fixture fails the test that started the service.
"""
import functools
import os
import sys
import threading
import traceback

from engine.connection import ServiceDatabase
from engine.commits import DATABASE_THREAD, _run_batch, in_a_turn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREADS_ALLOWED = ("job-locks", "db-probe")
CALLERS_ALLOWED = (os.path.join(ROOT, "tests") + os.sep, os.path.join(ROOT, "migrations") + os.sep)
# The database's own layers, between the code that asked and the statement.
PASSED_THROUGH = (os.path.join(ROOT, "models.py"), os.path.join(ROOT, "engine", "connection.py"),
                  os.path.join(ROOT, "engine", "joined.py"), os.sep + "peewee.py",
                  os.sep + "playhouse" + os.sep, os.sep + "contextlib.py", __file__)


class OutsideTheDoor(RuntimeError):
    """A statement run neither in a turn of the group commit nor by an allowed caller."""


class ThreadCheck:
    def __init__(self, callers_allowed=CALLERS_ALLOWED, report=None):
        """`report(text)`, when given, is told of each refusal as it happens."""
        self.refused = []
        self.callers_allowed = callers_allowed
        self.report = report

    def __call__(self, sql):
        if in_a_turn() or threading.current_thread().name.startswith(THREADS_ALLOWED):
            return
        caller = _caller()
        if caller is not None and _named(caller).startswith(self.callers_allowed):
            return
        where = "".join(traceback.format_stack(caller, limit=6)) if caller else "(no caller)"
        refusal = f"{sql[:80]!r} in thread {threading.current_thread().name}:\n{where}"
        self.refused.append(refusal)
        if self.report is not None:
            self.report(refusal)
        raise OutsideTheDoor(f"a statement outside the door (engine.commits): {sql[:80]!r}")

    def install(self):
        ServiceDatabase.before_statement = staticmethod(self)

    def remove(self):
        ServiceDatabase.before_statement = None


def _named(frame):
    """`path:function`: an allowed caller is a folder (path/), a file or a function."""
    return f"{frame.f_code.co_filename}:{frame.f_code.co_name}"


def _caller():
    """The innermost frame that is not the database's own layers."""
    frame = sys._getframe(1)
    while frame is not None and any(part in frame.f_code.co_filename
                                    for part in PASSED_THROUGH):
        frame = frame.f_back
    return frame


def through_the_door(unit, *args, **kwargs):
    """For a test's own set-up and checks that call the service's synchronous database
    code: run it in a turn of its own in the database thread, and wait for it."""
    [(result, failure)] = DATABASE_THREAD.submit(
        _run_batch, [(functools.partial(unit, *args, **kwargs), ())]).result()
    if failure is not None:
        raise failure
    return result


def name_search_jobs(effects, numbers):
    """A worker job (name_search) for each order FO-<number> of `numbers`, each written
    in a turn of its own as the request that asks for it would write it: a backlog for
    the sender to claim."""
    for number in numbers:
        through_the_door(effects.job, "name_search", {"order_number": f"FO-{number}"},
                         key=f"job-FO-{number}")


def new_row_id(ask, *args, **kwargs):
    """`through_the_door` for an Effects method (`effects.job`, say): the id of the row it
    wrote, or None when its key was stored already."""
    effects = ask.__self__
    written = len(effects.rows)
    through_the_door(ask, *args, **kwargs)
    return effects.rows[-1].id if len(effects.rows) > written else None


# The refusal files of the services started as subprocesses since the last check.
SERVICE_REFUSAL_FILES = []


def service_refusals():
    """What the services started since the last call refused (tests/checked_service.py),
    and forget them: each refusal once, for the test that started the service."""
    files, SERVICE_REFUSAL_FILES[:] = list(SERVICE_REFUSAL_FILES), []
    refused = []
    for path in files:
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as handle:
                if text := handle.read():
                    refused.append(f"in the service process that wrote {path}:\n{text}")
    return refused
