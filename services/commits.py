"""Group commit: the transactions of concurrent requests share one commit.

A commit waits for the disk (an fsync on SQLite with synchronous=full, a WAL flush on
PostgreSQL), and the IOLoop waits with it. Units of work asked for while the loop is busy
run together at its next turn, each in its own savepoint (one that raises is rolled back
alone), under one commit. Each caller resumes only after that commit: nothing is
acknowledged before it is durable.
"""
import asyncio

from models import database


class GroupCommit:
    def __init__(self):
        self._waiting = []

    async def run(self, unit):
        """Run `unit()` in a transaction shared with the other units of this turn; return
        what it returns, or raise what it raised, once the transaction is committed."""
        loop = asyncio.get_running_loop()
        if not self._waiting:
            loop.call_soon(self._commit)
        future = loop.create_future()
        self._waiting.append((unit, future))
        return await future

    def _commit(self):
        batch, self._waiting = self._waiting, []
        try:
            with database.atomic():
                outcomes = [_attempt(unit) for unit, _ in batch]
        except Exception as failure:  # the commit itself, or the connection, failed
            outcomes = [(None, failure)] * len(batch)
        for (_, future), (result, failure) in zip(batch, outcomes):
            if future.cancelled():
                continue
            if failure is None:
                future.set_result(result)
            else:
                future.set_exception(failure)


def _attempt(unit):
    try:
        with database.atomic():
            return unit(), None
    except Exception as failure:
        return None, failure
