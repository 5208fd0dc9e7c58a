"""Claiming due rows (inbox events, outbox effects) so that only one process works on each.

A claim is a unit of the group commit (engine.commits), run in the database thread: the
due rows are selected FOR UPDATE SKIP LOCKED on
PostgreSQL (a row another process is claiming right now is passed over, not waited
for) and their next_attempt_at is pushed one lease ahead, so after the commit no other
process finds them due until the lease runs out. The work itself happens after the
commit; if the process dies mid-work the lease expires and another run picks the row up.
On SQLite a single process is assumed and writers are serialised by the database.
"""
import datetime
import functools
from typing import TypeVar

import peewee

from models import Outbox, WebhookEvent, is_postgres
from engine.contracts import EngineContext

# What can be claimed: rows with a lease (next_attempt_at).
Claimable = TypeVar("Claimable", WebhookEvent, Outbox)

CLAIM_BATCH = 100


def lease(ctx: EngineContext) -> datetime.timedelta:
    return datetime.timedelta(seconds=ctx.settings.claim_lease_seconds)


async def claim(ctx: EngineContext, model: type[Claimable], due: peewee.Expression,
                limit: int = CLAIM_BATCH) -> list[Claimable]:
    """Claim up to `limit` rows of `model` matching `due`, oldest first; return them."""
    return await ctx.commits.run(functools.partial(_claim, ctx, model, due, limit))


def _claim(ctx: EngineContext, model: type[Claimable], due: peewee.Expression,
           limit: int) -> list[Claimable]:
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
