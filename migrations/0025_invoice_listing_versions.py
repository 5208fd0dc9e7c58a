"""An SHKeeper callback's place among its invoice's callbacks is its listing of the
invoice's transactions (domain.treasury.Callback.version: how many it lists, zero-padded,
then the newest one's date), no longer its arrival. Callbacks stored before are given
theirs, so that one handled then, placed by its arrival time, does not stand after every
callback to come; an `unconfirmed` notice, which lists nothing, leaves the invoice's
stream."""
import json

from models import WebhookEvent


def listing_version(payload: str) -> str | None:
    """The rule of domain.treasury.Callback.version as of this migration; None for a body
    it cannot read (placed as it was)."""
    try:
        body = json.loads(payload)
        transactions = body.get("transactions") or []
        listed = [t for t in transactions
                  if isinstance(t, dict) and str(t.get("txid") or "").strip()]
        newest = max((str(t.get("date") or "").strip() for t in listed), default="")
    except (ValueError, AttributeError, TypeError):
        return None
    return f"{len(listed):06d}|{newest}"


def apply(db, migrator):
    with db.bind_ctx([WebhookEvent]):
        in_streams = (WebhookEvent.source == "crypto") & WebhookEvent.stream.is_null(False)
        (WebhookEvent.update(stream=None, version=None)
         .where(in_streams, WebhookEvent.event_type == "unconfirmed").execute())
        rows = (WebhookEvent
                .select(WebhookEvent.id, WebhookEvent.payload, WebhookEvent.version)
                .where(in_streams).order_by(WebhookEvent.id).tuples())
        for event_id, payload, version in list(rows):
            listing = listing_version(payload)
            if listing is not None and listing != version:
                WebhookEvent.update(version=listing).where(WebhookEvent.id == event_id).execute()
