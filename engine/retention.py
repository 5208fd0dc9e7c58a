"""Pruning: handled inbox events, sent (or only logged) outbox rows and the record of send
attempts are deleted after RETENTION_DAYS.

Failed, dead and rejected events and pending, waiting or dead outbox rows are kept for the
operator whatever their age (their attempts older than RETENTION_DAYS go all the same). A pruned event's dedup key goes with it, so RETENTION_DAYS
must stay longer than any sender's retry window (Stripe retries for 3 days).
"""
import datetime
import logging

from models import Attempt, Outbox, WebhookEvent, database

log = logging.getLogger("receiver.retention")

PRUNED_EVENT_STATUSES = ("processed", "ignored")


def prune(ctx):
    """Delete what is past retention; returns (events, outbox rows) deleted."""
    cutoff = ctx.clock() - datetime.timedelta(days=ctx.settings.retention_days)
    with database.atomic():
        rows = (Outbox.delete()
                .where(((Outbox.status == "sent") & (Outbox.sent_at < cutoff))
                       | ((Outbox.status == "logged") & (Outbox.updated_at < cutoff)))
                .execute())
        # An event stored already settled (ignored on arrival, say) was never handled,
        # so it has no processed_at: its age is counted from its arrival.
        settled_before_cutoff = (
            (WebhookEvent.processed_at < cutoff)
            | (WebhookEvent.processed_at.is_null() & (WebhookEvent.received_at < cutoff)))
        events = (WebhookEvent.delete()
                  .where(WebhookEvent.status.in_(PRUNED_EVENT_STATUSES),
                         settled_before_cutoff).execute())
        attempts = Attempt.delete().where(Attempt.created_at < cutoff).execute()
    if events or rows or attempts:
        log.info("pruned %d event(s), %d sent effect(s) and %d send attempt(s) older than %s",
                 events, rows, attempts, cutoff.isoformat())
    return events, rows
