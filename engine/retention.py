"""Pruning: handled inbox events, sent (or only logged) outbox rows, the record of send
attempts and the console's record of operator actions are deleted after RETENTION_DAYS;
console sessions as soon as they are ended or expired.

Failed, dead and rejected events and pending, waiting or dead outbox rows are kept for the
operator whatever their age (their attempts older than RETENTION_DAYS go all the same). A pruned event's dedup key goes with it, so RETENTION_DAYS
must stay longer than any sender's retry window (Stripe retries for 3 days).
"""
import datetime
import logging

from models import Attempt, ConsoleAction, ConsoleSession, Outbox, WebhookEvent, database

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
        actions = ConsoleAction.delete().where(ConsoleAction.created_at < cutoff).execute()
        (ConsoleSession.delete()
         .where(ConsoleSession.ended_at.is_null(False)
                | (ConsoleSession.expires_at <= ctx.clock())).execute())
    if events or rows or attempts or actions:
        log.info("pruned %d event(s), %d sent effect(s), %d send attempt(s) and %d console "
                 "action(s) older than %s", events, rows, attempts, actions,
                 cutoff.isoformat())
    return events, rows
