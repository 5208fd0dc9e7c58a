"""Statements and round trips per webhook: on PostgreSQL each round trip is a wait of the
one database thread, so their number bounds a receiver's rate there. Read from the
database's own counts (engine.connection.ServiceDatabase): every statement it is asked, BEGIN,
COMMIT and ROLLBACK included, held writes too; and the round trips those cost (fewer on
PostgreSQL, where held writes go with the next statement; the same on SQLite)."""
import contextlib

from models import database


class StatementCount:
    """While open, counts what the database is asked to run: `.total` statements in
    `.round_trips` round trips."""

    def __init__(self):
        self.total = 0
        self.round_trips = 0

    @contextlib.contextmanager
    def open(self):
        target = database.obj
        statements, round_trips = target.statements, target.round_trips
        try:
            yield self
        finally:
            self.total = target.statements - statements
            self.round_trips = target.round_trips - round_trips
