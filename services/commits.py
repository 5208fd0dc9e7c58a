"""Group commit: the transactions of concurrent requests share one commit.

A commit waits for the disk (an fsync on SQLite with synchronous=full, a WAL flush on
PostgreSQL), and the IOLoop waits with it. Units of work asked for while the loop is busy
run together at its next turn, each in its own savepoint (one that raises is rolled back
alone), under one commit. On SQLite the transaction takes the write lock at its start
(BEGIN IMMEDIATE): a deferred one that read before another connection (a mail thread's)
committed could not write at all. Each caller resumes only after that commit: nothing is
acknowledged before it is durable.

On PostgreSQL two processes' turns can deadlock (each inserted a key the other is now
inserting); the server rolls one statement back, and its unit is run again at the next
turn, after this turn's commit has released what the other process waits for. A unit
must therefore be safe to run again from its start, and code inside one that catches
database errors lets a conflict through (`raise_if_conflict`).
"""
import asyncio

from models import database, is_postgres

# SQLSTATE class 40, transaction rollback: a deadlock or a serialization failure.
CONFLICT_CLASS = "40"
MAX_CONFLICTS = 5


class GroupCommit:
    def __init__(self):
        self._waiting = []

    async def run(self, unit):
        """Run `unit()` in a transaction shared with the other units of this turn; return
        what it returns, or raise what it raised, once the transaction is committed."""
        future = asyncio.get_running_loop().create_future()
        self._enqueue(unit, future, conflicts=0)
        return await future

    def _enqueue(self, unit, future, conflicts):
        if not self._waiting:
            asyncio.get_running_loop().call_soon(self._commit)
        self._waiting.append((unit, future, conflicts))

    def _commit(self):
        batch, self._waiting = self._waiting, []
        try:
            with database.atomic() if is_postgres() else database.atomic("IMMEDIATE"):
                outcomes = [_attempt(unit) for unit, _, _ in batch]
        except Exception as failure:  # the commit itself, or the connection, failed
            outcomes = [(None, failure)] * len(batch)
        for (unit, future, conflicts), (result, failure) in zip(batch, outcomes):
            if future.cancelled():
                continue
            if failure is None:
                future.set_result(result)
            elif is_conflict(failure) and conflicts < MAX_CONFLICTS:
                self._enqueue(unit, future, conflicts + 1)
            else:
                future.set_exception(failure)


def _attempt(unit):
    try:
        with database.atomic():
            return unit(), None
    except Exception as failure:
        return None, failure


def is_conflict(failure):
    """peewee keeps the driver's error as `orig`; psycopg2's carries the SQLSTATE."""
    driver_error = getattr(failure, "orig", None)
    return str(getattr(driver_error, "pgcode", "") or "").startswith(CONFLICT_CLASS)


def raise_if_conflict(failure):
    """For code that handles a database error itself: a conflict is not its to handle,
    the unit it runs in is run again."""
    if is_conflict(failure):
        raise failure
