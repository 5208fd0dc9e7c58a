"""Backfill from Stripe's Events API: the events whose webhook delivery failed since a
given time, fed through the same inbox as the webhook (same dedup keys), so an event
that did arrive, or that an earlier backfill stored, is not stored or handled again.

Stripe keeps events for 30 days and lists them newest first; we handle them in the
order they happened."""
import asyncio
import dataclasses
import json

from clients.stripe_api import stripe_client
from domain import card_events
from engine import inbox

PAGE_SIZE = 100


@dataclasses.dataclass
class Counts:
    listed: int = 0
    stored: int = 0
    already: int = 0
    unreadable: int = 0


def undelivered_events(client, since):
    """Every event created at or after `since` not yet delivered to all our endpoints,
    as plain dicts, following Stripe's pagination to the end."""
    first = client.v1.events.list(params={
        "delivery_success": False, "created": {"gte": int(since.timestamp())},
        "limit": PAGE_SIZE})
    return [event.to_dict(for_json=True) for event in first.auto_paging_iter()]


async def backfill(ctx, since, client=None):
    client = client or stripe_client(ctx.settings)
    # The stripe library blocks; keep the loop free for the effects being sent.
    events = await asyncio.get_running_loop().run_in_executor(
        None, undelivered_events, client, since)
    counts = Counts(listed=len(events))
    for event in sorted(events, key=lambda e: e.get("created") or 0):
        if card_events.problem_with(event):
            counts.unreadable += 1
        elif inbox.find(ctx, card_events.SOURCE, card_events.dedup_key(event)):
            counts.already += 1
        else:
            await card_events.accept(ctx, event, json.dumps(event).encode())
            counts.stored += 1
    return counts
