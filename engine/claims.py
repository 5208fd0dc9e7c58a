"""Claiming due rows (inbox events, outbox effects) so that only one process works on each.

A claim is a unit of the group commit (engine.commits), run in the database thread: the
due rows are selected FOR UPDATE SKIP LOCKED on
PostgreSQL (a row another process is claiming right now is passed over, not waited
for) and their next_attempt_at is pushed one lease ahead, so after the commit no other
process finds them due until the lease runs out. The work itself happens after the
commit; if the process dies mid-work the lease expires and another run picks the row up.
On SQLite a single process is assumed and writers are serialised by the database.

Work that may outlast a lease (an async plugin waiting on Stripe, a drained call waiting
its turn) keeps its rows' leases while it lasts (`Kept`).
"""
import asyncio
import datetime
import functools
import logging
from typing import Any, Callable, Iterable, TypeVar

import peewee

from models import Outbox, WebhookEvent, is_postgres
from engine.commits import without_budget
from engine.contracts import EngineContext
from engine.db import UNAVAILABLE, why_unavailable

log = logging.getLogger("receiver.claims")

# What can be claimed: rows with a lease (next_attempt_at).
Claimable = TypeVar("Claimable", WebhookEvent, Outbox)

CLAIM_BATCH = 100
# A kept lease is re-taken once half of it is left. The clock is looked at this often
# rather than slept on for half a lease: asyncio sleeps on the monotonic clock, which
# stands still while the machine is suspended, and leases are on the wall clock.
LOOK_EVERY_SECONDS = 1.0


def lease(ctx: EngineContext) -> datetime.timedelta:
    return datetime.timedelta(seconds=ctx.settings.claim_lease_seconds)


async def claim(ctx: EngineContext, model: type[Claimable], due: peewee.Expression,
                limit: int = CLAIM_BATCH,
                making_due: Callable[[], None] | None = None) -> list[Claimable]:
    """Claim up to `limit` rows of `model` matching `due`, oldest first; return them.
    `making_due`: a write run first in the claim's unit (one that makes rows due), so
    that what it makes due is claimed with it."""
    return await ctx.commits.run(functools.partial(_claim, ctx, model, due, limit,
                                                   making_due))


def _claim(ctx: EngineContext, model: type[Claimable], due: peewee.Expression,
           limit: int, making_due: Callable[[], None] | None = None) -> list[Claimable]:
    if making_due is not None:
        making_due()
    now = ctx.clock()
    query = model.select().where(due).order_by(model.id).limit(limit)
    if is_postgres():
        query = query.for_update(skip_locked=True)
    rows = list(query)
    if rows:
        held_until = now + lease(ctx)
        (model.update(next_attempt_at=held_until, updated_at=now)
         .where(model.id.in_([row.id for row in rows])).execute())
        # The rows say which lease they hold: a sender re-takes the row only if its
        # lease is still this one (engine.outbox.send).
        for row in rows:
            row.next_attempt_at = held_until
    return rows


class Kept:
    """Inbox events' leases, kept while the events are worked on (`async with`): each
    lease is re-taken, a whole lease ahead and through the database door, once half of
    it is left; only while the row still holds the lease taken here and matches
    `working` (still awaiting its handling), so a row another process has claimed since,
    or its handling has settled, is let go, never taken back.

    An event stored and handled at once holds no claim (next_attempt_at empty): it is
    left alone for a lease from its arrival (engine.inbox.retry_due), and kept from
    then on like the others."""

    def __init__(self, ctx: EngineContext, working: peewee.Expression,
                 rows: Iterable[WebhookEvent] = ()) -> None:
        self.ctx, self.working = ctx, working
        self.rows = {row.id: row for row in rows}
        self.first_look: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None

    def hold(self, row: WebhookEvent) -> None:
        self.rows[row.id] = row

    def let_go(self, row: WebhookEvent) -> None:
        self.rows.pop(row.id, None)

    async def __aenter__(self) -> "Kept":
        # The keeping task is started at the first look: most handlings are over before
        # it, and a task started and cancelled around each one costs the loop more than
        # the timer.
        self.first_look = asyncio.get_running_loop().call_later(LOOK_EVERY_SECONDS,
                                                                self._start)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self.first_look is not None
        self.first_look.cancel()
        if self.task is None:
            return
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass

    def _start(self) -> None:
        # Not part of the call that started it: the re-takes spend no call's budget.
        self.task = asyncio.get_running_loop().create_task(self._keep(),
                                                           context=without_budget())

    async def _keep(self) -> None:
        while True:
            await self._look()
            await asyncio.sleep(LOOK_EVERY_SECONDS)

    async def _look(self) -> None:
        now = self.ctx.clock()
        due = [row for row in self.rows.values()
               if self._ends(row) - now <= lease(self.ctx) / 2]
        if not due:
            return
        held = [(row.id, row.next_attempt_at) for row in due]
        try:
            held_until, kept = await self.ctx.db(
                functools.partial(_retake, self.ctx, self.working, held))
        except Exception as exc:  # tried again at the next look
            # An outage says why in a line; anything else is a bug, with its trace.
            log.warning("%d lease(s) could not be re-taken: %s", len(due),
                        why_unavailable(exc), exc_info=not isinstance(exc, UNAVAILABLE))
            return
        for row in due:
            if row.id in kept:
                row.next_attempt_at = held_until
            elif row.id in self.rows:
                log.warning("event #%s: its lease is no longer held here (another "
                            "process claimed it, or its handling ended)", row.id)
                self.let_go(row)

    def _ends(self, row: WebhookEvent) -> datetime.datetime:
        return row.next_attempt_at or row.received_at + lease(self.ctx)


def _retake(ctx: EngineContext, working: peewee.Expression,
            held: list[tuple[int, datetime.datetime | None]]
            ) -> tuple[datetime.datetime, set[int]]:
    """Push each row's lease one lease ahead if it still holds the lease it was given
    (compare-and-set): the new lease's end and the rows re-taken. Run again (its turn
    undone), it finds the rows as they were."""
    now = ctx.clock()
    held_until = now + lease(ctx)
    kept = {row_id for row_id, until in held
            if WebhookEvent.update(next_attempt_at=held_until, updated_at=now)
            .where(WebhookEvent.id == row_id, WebhookEvent.next_attempt_at == until,
                   working).execute()}
    return held_until, kept
