"""Pruning: handled inbox events, sent (or only logged) outbox rows, the record of send
attempts and the console's record of operator actions are deleted after RETENTION_DAYS;
console sessions as soon as they are ended or expired.

Failed, dead and rejected events and pending, waiting or dead outbox rows are kept for the
operator whatever their age (their attempts older than RETENTION_DAYS go all the same). A pruned event's dedup key goes with it, so RETENTION_DAYS
must stay longer than any sender's retry window (Stripe retries for 3 days).

A prune deletes PRUNE_BATCH rows of each table at most per transaction, so however much
has piled up each statement stays short: under the service's statement timeout, and
never holding the database thread long from the calls that wait for it. Should one not
finish all the same, it is maintenance cut short, never taken for an outage
(`prune_all`).
"""
import datetime
import functools
import logging

import peewee

from models import Attempt, BaseModel, ConsoleAction, ConsoleSession, Outbox, WebhookEvent, database
from engine.errors import MaintenanceCutShort, maintenance
from engine.contracts import EngineContext

log = logging.getLogger("receiver.retention")

PRUNED_EVENT_STATUSES = ("processed", "ignored")
PRUNE_BATCH = 1000
SMALLEST_BATCH = 10


async def prune_all(ctx: EngineContext, limit: int = PRUNE_BATCH) -> tuple[int, int]:
    """Prune batch after batch, each in a unit of its own, until nothing is left past
    retention; returns (events, outbox rows) deleted.

    A batch the database does not finish (its statement timed out, or met the database
    down) is maintenance cut short, not an outage (engine.errors.maintenance): the batch is
    halved and tried again, and below SMALLEST_BATCH the run ends, to go on at the next."""
    events = rows = 0
    while True:
        try:
            batch = await ctx.db(functools.partial(_prune_batch, ctx, limit))
        except MaintenanceCutShort as cut_short:
            if limit // 2 < SMALLEST_BATCH:
                log.warning("pruning stopped until its next run: a batch of %d rows did "
                            "not finish (%s)", limit, " ".join(str(cut_short).split()))
                return events, rows
            limit //= 2
            continue
        events, rows = events + batch[0], rows + batch[1]
        if max(batch) < limit:
            return events, rows


def prune(ctx: EngineContext, limit: int = PRUNE_BATCH) -> tuple[int, int]:
    """Delete at most `limit` rows of each table past retention; returns (events, outbox
    rows) deleted."""
    return _prune_batch(ctx, limit)[:2]


def _prune_batch(ctx: EngineContext, limit: int) -> tuple[int, int, int, int, int]:
    """(events, outbox rows, attempts, console actions, console sessions) deleted."""
    now = ctx.clock()
    cutoff = now - datetime.timedelta(days=ctx.settings.retention_days)
    # An event stored already settled (ignored on arrival, say) was never handled, so it
    # has no processed_at: its age is counted from its arrival.
    settled_before_cutoff = (
        (WebhookEvent.processed_at < cutoff)
        | (WebhookEvent.processed_at.is_null() & (WebhookEvent.received_at < cutoff)))
    with database.atomic(), maintenance():
        rows = _delete_some(Outbox, ((Outbox.status == "sent") & (Outbox.sent_at < cutoff))
                            | ((Outbox.status == "logged") & (Outbox.updated_at < cutoff)),
                            limit)
        events = _delete_some(WebhookEvent, WebhookEvent.status.in_(PRUNED_EVENT_STATUSES)
                              & settled_before_cutoff, limit)
        attempts = _delete_some(Attempt, Attempt.created_at < cutoff, limit)
        actions = _delete_some(ConsoleAction, ConsoleAction.created_at < cutoff, limit)
        sessions = _delete_some(ConsoleSession, ConsoleSession.ended_at.is_null(False)
                                | (ConsoleSession.expires_at <= now), limit)
    if events or rows or attempts or actions:
        log.info("pruned %d event(s), %d sent effect(s), %d send attempt(s) and %d console "
                 "action(s) older than %s", events, rows, attempts, actions,
                 cutoff.isoformat())
    return events, rows, attempts, actions, sessions


def _delete_some(model: type[BaseModel], condition: peewee.Expression, limit: int) -> int:
    oldest = model.select(model.id).where(condition).order_by(model.id).limit(limit)
    return model.delete().where(model.id.in_(oldest)).execute()
