"""Backfill from Stripe's Events API: the events whose webhook delivery failed since a
given time, fed through the same inbox as the webhook under the same keys (each type's
key of one fact, as its plugin declares it: domain.card_events.fact_key), so an event
that did arrive, or that an earlier backfill stored, is not stored or handled again.

Stripe keeps events for 30 days and lists them newest first; we handle them in the
order they happened."""
import asyncio
import dataclasses
import datetime
import functools
import json
from typing import Any, Callable, Optional

from clients.stripe_api import stripe_client
from domain import card_events
from engine import inbox
from engine.contracts import EngineContext

PAGE_SIZE = 100
# progress(done, total): told as the work goes (total None while it is not known).
Progress = Optional[Callable[[int, Optional[int]], None]]


@dataclasses.dataclass
class Counts:
    listed: int = 0
    stored: int = 0
    already: int = 0
    unreadable: int = 0


def undelivered_events(client: Any, since: datetime.datetime,
                       listing: Progress = None) -> list[dict[str, Any]]:
    """Every event created at or after `since` not yet delivered to all our endpoints,
    as plain dicts, following Stripe's pagination to the end; `listing(count, None)`
    after each."""
    first = client.v1.events.list(params={
        "delivery_success": False, "created": {"gte": int(since.timestamp())},
        "limit": PAGE_SIZE})
    events = []
    for event in first.auto_paging_iter():
        events.append(event.to_dict(for_json=True))
        if listing:
            listing(len(events), None)
    return events


async def backfill(ctx: EngineContext, since: datetime.datetime, client: Any = None,
                   listing: Progress = None, handling: Progress = None) -> Counts:
    """`listing(count, None)` as Stripe's pages come, `handling(done, total)` as the
    events are stored: the command line's progress."""
    client = client or stripe_client(ctx.settings)
    # The stripe library blocks; keep the loop free for the effects being sent.
    events = await asyncio.get_running_loop().run_in_executor(
        None, undelivered_events, client, since, listing)
    counts = Counts(listed=len(events))
    if handling:
        handling(0, counts.listed)
    for done, event in enumerate(sorted(events, key=lambda e: e.get("created") or 0), 1):
        if card_events.problem_with(event):
            counts.unreadable += 1
        elif await ctx.db(functools.partial(inbox.find, ctx, card_events.SOURCE,
                                            card_events.fact_key(ctx, event))):
            counts.already += 1
        else:
            await card_events.accept(ctx, event, json.dumps(event).encode())
            counts.stored += 1
        if handling:
            handling(done, counts.listed)
    return counts
