"""Statements per webhook: each one is a round trip to PostgreSQL, where the loop waits
on it, so their number bounds a receiver's rate there. Counted through the Peewee
database the service uses: every statement it executes, and every BEGIN, COMMIT and
ROLLBACK."""
import contextlib

from models import database

COUNTED = ("execute_sql", "begin", "commit", "rollback")


class StatementCount:
    """While open, counts what the database is asked to run; `.total` is the count."""

    def __init__(self):
        self.total = 0

    def _counting(self, run):
        def counted(*args, **kwargs):
            self.total += 1
            return run(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def open(self):
        target = database.obj
        for name in COUNTED:
            setattr(target, name, self._counting(getattr(target, name)))
        try:
            yield self
        finally:
            for name in COUNTED:
                delattr(target, name)
