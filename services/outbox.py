"""The outbox: effects on other systems, written in the transaction of their cause and
sent after it commits. A send that fails stays pending with its error and is retried
with backoff; a refusal that no retry can change, or too many attempts, makes it dead.
"""
import asyncio
import datetime
import hashlib
import json
import logging
import random

from models import Outbox
from services.db import insert_once

log = logging.getLogger("receiver.outbox")

# While the cause's own request sends a row, the scheduler leaves it alone this long.
SEND_LEASE = datetime.timedelta(seconds=60)
MAX_ATTEMPTS = 12
BACKOFF_BASE_SECONDS = 30
BACKOFF_CAP_SECONDS = 6 * 3600


def backoff(attempts):
    """Exponential with full jitter: 30 s, 60 s, 2 min ... capped at 6 h."""
    ceiling = min(BACKOFF_CAP_SECONDS, BACKOFF_BASE_SECONDS * 2 ** max(attempts - 1, 0))
    return datetime.timedelta(seconds=random.uniform(ceiling / 2, ceiling))


def stable_key(*parts):
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:40]


class Effects:
    """What one event asks of other systems, collected inside the event's transaction.

    Every row has an idempotency key: by default derived from the event, so handling the
    same event again adds nothing; callers pass their own where the effect belongs to
    something wider than one event (one alert per paid order, say)."""

    def __init__(self, ctx, event=None):
        self.ctx = ctx
        self.event = event
        self.rows = []

    def add(self, kind, payload, key=None, order_number=None):
        if key is None:
            origin = (self.event.source, self.event.dedup_key) if self.event else ("direct",)
            key = f"{kind}-{stable_key(*origin, kind, len(self.rows))}"
        now = self.ctx.clock()
        row_id = insert_once(
            Outbox, event=self.event.id if self.event else None, kind=kind,
            order_number=order_number, payload=json.dumps(payload),
            idempotency_key=key, next_attempt_at=now + SEND_LEASE,
            created_at=now, updated_at=now)
        if row_id:
            self.rows.append(row_id)
        return row_id

    def job(self, action, payload, key=None):
        return self.add("job", {"action": action, "payload": payload}, key,
                        payload.get("order_number"))

    def workflow_action(self, doctype, name, action, order_number=None, key=None):
        return self.add("workflow_action",
                        {"doctype": doctype, "name": name, "action": action},
                        key, order_number)

    def email(self, to, subject, template, key=None, order_number=None, **variables):
        """Render `template`.txt and .html now, so what is sent is what was true then."""
        env = self.ctx.templates
        text = env.get_template(f"{template}.txt").render(**variables)
        html = env.get_template(f"{template}.html").render(**variables)
        return self.add("email", {"to": list(to), "subject": subject,
                                  "text": text, "html": html}, key, order_number)

    def alert(self, text, key=None, order_number=None):
        return self.add("alert", {"text": text}, key, order_number)


async def _send_job(ctx, payload, row):
    return await ctx.worker.dispatch(payload["action"], payload["payload"], row.idempotency_key)


async def _send_workflow_action(ctx, payload, row):
    return await ctx.workflow.apply_action(payload["doctype"], payload["name"], payload["action"])


async def _send_email(ctx, payload, row):
    return await ctx.mailer.send(payload["to"], payload["subject"], payload["text"],
                                 payload.get("html"))


async def _send_alert(ctx, payload, row):
    return await ctx.telegram.send(payload["text"])


SENDERS = {
    "job": _send_job,
    "workflow_action": _send_workflow_action,
    "email": _send_email,
    "alert": _send_alert,
}


async def send(ctx, row):
    """Send one outbox row and record the outcome; returns the Result."""
    result = await SENDERS[row.kind](ctx, json.loads(row.payload), row)
    record_outcome(ctx, row, result)
    return result


def record_outcome(ctx, row, result):
    now = ctx.clock()
    attempts = row.attempts + 1
    changes = {Outbox.attempts: attempts, Outbox.updated_at: now}
    if result.ok:
        changes.update({Outbox.status: "sent", Outbox.sent_at: now, Outbox.last_error: None})
    elif not result.retryable or attempts >= MAX_ATTEMPTS:
        changes.update({Outbox.status: "dead", Outbox.last_error: result.error})
        log.error("outbox %s %s dead after %d attempt(s): %s",
                  row.id, row.kind, attempts, result.error)
    else:
        changes.update({Outbox.last_error: result.error,
                        Outbox.next_attempt_at: now + backoff(attempts)})
        log.warning("outbox %s %s failed (attempt %d), will retry: %s",
                    row.id, row.kind, attempts, result.error)
    Outbox.update(changes).where(Outbox.id == row.id).execute()


async def deliver(ctx, row_ids):
    """Send the given rows concurrently; each outcome is recorded, none raises."""
    if not row_ids:
        return []
    rows = list(Outbox.select().where(Outbox.id.in_(row_ids), Outbox.status == "pending")
                .order_by(Outbox.id))
    return await asyncio.gather(*(send(ctx, row) for row in rows))


