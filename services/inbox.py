"""The inbox: every accepted call is stored raw before it is handled, once per dedup key.

Handling runs the event's plugin. A plain function runs inside one transaction with the
status change, so its database changes and outbox rows happen once or not at all; an
async plugin (one that must wait on another system between steps) runs outside it and
is written to be safe to run again. Outbox rows are sent after the commit.
"""
import datetime
import inspect
import json
import logging

import peewee

from models import WebhookEvent, database
from services import outbox
from services.db import insert_once, locked

log = logging.getLogger("receiver.events")

RETRY_BASE_SECONDS = 60
RETRY_CAP_SECONDS = 6 * 3600


def record(ctx, source, event_type, dedup_key, payload, external_id=None,
           order_number=None, status="received", last_error=None):
    """Store the call; return (event, created). A known dedup key returns the first copy."""
    now = ctx.clock()
    event_id = insert_once(
        WebhookEvent, source=source, event_type=event_type, dedup_key=dedup_key,
        external_id=external_id, order_number=order_number,
        payload=payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload,
        status=status, last_error=last_error, received_at=now,
        created_at=now, updated_at=now)
    if event_id:
        return WebhookEvent.get_by_id(event_id), True
    existing = WebhookEvent.get(WebhookEvent.source == source,
                                WebhookEvent.dedup_key == dedup_key)
    log.info("duplicate %s event %s (%s) ignored; first stored as #%s",
             source, event_type, external_id or dedup_key, existing.id)
    return existing, False


def find(ctx, source, dedup_key):
    return WebhookEvent.get_or_none(WebhookEvent.source == source,
                                    WebhookEvent.dedup_key == dedup_key)


def _registry(source):
    from plugins import registries
    return registries()[source]


async def process(ctx, event):
    """Handle a stored event once. Never raises: a failure is logged and recorded on the
    event, which the scheduler retries with backoff."""
    plugin = _registry(event.source).get(event.event_type)
    effects = outbox.Effects(ctx, event)
    try:
        payload = json.loads(event.payload)
        if plugin is None:
            _finish(ctx, event.id, "ignored")
            return "ignored"
        if inspect.iscoroutinefunction(plugin) or inspect.iscoroutinefunction(
                getattr(plugin, "__call__", None)):
            await plugin(ctx, payload, effects)
            _finish(ctx, event.id, "processed")
        else:
            with database.atomic():
                current = locked(WebhookEvent.select(WebhookEvent.status)
                                 .where(WebhookEvent.id == event.id)).get()
                if current.status in ("processed", "ignored", "rejected"):
                    return current.status
                plugin(ctx, payload, effects)
                _finish(ctx, event.id, "processed")
    except Exception as exc:
        log.exception("%s event #%s (%s) failed", event.source, event.id, event.event_type)
        _fail(ctx, event, exc)
        return "failed"
    await outbox.deliver(ctx, effects.rows)
    return "processed"


def _finish(ctx, event_id, status):
    now = ctx.clock()
    (WebhookEvent.update(status=status, processed_at=now, updated_at=now, last_error=None,
                         attempts=WebhookEvent.attempts + 1, next_attempt_at=None)
     .where(WebhookEvent.id == event_id).execute())


def _fail(ctx, event, exc):
    now = ctx.clock()
    attempts = event.attempts + 1
    delay = min(RETRY_CAP_SECONDS, RETRY_BASE_SECONDS * 2 ** (attempts - 1))
    try:
        (WebhookEvent.update(status="failed", attempts=attempts, updated_at=now,
                             last_error=f"{type(exc).__name__}: {exc}"[:2000],
                             next_attempt_at=now + datetime.timedelta(seconds=delay))
         .where(WebhookEvent.id == event.id).execute())
    except peewee.PeeweeException:
        log.exception("could not record the failure of event #%s; it stays %s",
                      event.id, event.status)
