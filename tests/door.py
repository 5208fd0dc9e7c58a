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
"""
import functools
import os
import sys
import threading
import traceback

import models
from engine.commits import DATABASE_THREAD, _run_batch, in_a_turn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREADS_ALLOWED = ("job-locks", "db-probe")
CALLERS_ALLOWED = (os.path.join(ROOT, "tests") + os.sep, os.path.join(ROOT, "migrations") + os.sep)
# The database's own layers, between the code that asked and the statement.
PASSED_THROUGH = (os.path.join(ROOT, "models.py"), os.sep + "peewee.py",
                  os.sep + "playhouse" + os.sep, os.sep + "contextlib.py", __file__)


class OutsideTheDoor(RuntimeError):
    """A statement run neither in a turn of the group commit nor by an allowed caller."""


class ThreadCheck:
    def __init__(self):
        self.refused = []

    def __call__(self, sql):
        if in_a_turn() or threading.current_thread().name.startswith(THREADS_ALLOWED):
            return
        caller = _caller()
        if caller is not None and caller.f_code.co_filename.startswith(CALLERS_ALLOWED):
            return
        where = "".join(traceback.format_stack(caller, limit=6)) if caller else "(no caller)"
        self.refused.append(f"{sql[:80]!r} in thread {threading.current_thread().name}:\n{where}")
        raise OutsideTheDoor(f"a statement outside the door (engine.commits): {sql[:80]!r}")

    def install(self):
        models.ClassifiedErrors.before_statement = staticmethod(self)

    def remove(self):
        models.ClassifiedErrors.before_statement = None


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
        _run_batch, [functools.partial(unit, *args, **kwargs)]).result()
    if failure is not None:
        raise failure
    return result
