"""POST /api/v1/webhooks/crypto-processor: SHKeeper's invoice callbacks (BEHAVIOUR.md 4.3).

SHKeeper re-sends a callback every 60 s, forever, until it gets exactly 202; so every
outcome but a refused key is 202, and the inbox, not the sender, retries our failures.
Without CRYPTO_PROCESSOR_API_KEY every callback is refused (401), in every environment.
"""
import datetime
import hashlib
import hmac
import logging
import re
from typing import Any, NoReturn

from engine import lograte
from handlers.base import ApiHandler, same_secret
from domain import treasury
from engine import inbox
from engine.db import UNAVAILABLE
from engine.transaction import Transaction
from models import Outbox, WebhookEvent

log = logging.getLogger("receiver.crypto")
REPEATS = lograte.Repeats(log)

SOURCE = "crypto"
KEY_HEADERS = ("X-Crypto-Processor-Api-Key", "X-Shkeeper-Api-Key")
SIGNATURE_HEADER = "X-Shkeeper-Signature"
TIMESTAMP_HEADER = "X-Shkeeper-Timestamp"
SIGNATURE_WINDOW_SECONDS = 300
RECEIVED = {"received": True}
INTERNAL_ERROR = {"received": True, "error": "internal"}


def signature_valid(api_key: str, raw: bytes, signature: str | None, timestamp: str | None,
                    now: datetime.datetime) -> bool:
    """SHKeeper's signature: hex HMAC-SHA256(api_key, "<timestamp>." + raw body), made
    within SIGNATURE_WINDOW_SECONDS of `now` either way."""
    if not signature or not timestamp or not re.fullmatch(r"[0-9]{1,12}", timestamp):
        return False
    if abs(now.timestamp() - int(timestamp)) > SIGNATURE_WINDOW_SECONDS:
        return False
    expected = hmac.new(api_key.encode("utf-8"), f"{timestamp}.".encode("ascii") + raw,
                        hashlib.sha256).hexdigest()
    return same_secret(signature.strip().lower(), expected)


class CryptoProcessorWebhookHandler(ApiHandler):
    # An invoice callback with its transactions is a few kilobytes; room for hundreds.
    body_limit = 256 * 1024

    def check_headers(self) -> bool:
        """The API key headers are checked before the body is read; SHKeeper's signature
        covers the body, so it is checked once the body is in (post)."""
        return self.authenticate_headers()

    async def post(self) -> None:
        raw = self.raw_body
        self.authenticate_signature(raw)
        try:
            outcome, rows = await self.store(raw)
        except UNAVAILABLE:
            raise
        except Exception as exc:
            # Kept in the log, the only place left for it: the body carries no secret.
            # The same failure for every callback (a broken table) is written once.
            REPEATS.exception(lograte.key_of(exc), "crypto callback could not be stored: %s",
                              raw[:4000].decode("utf-8", "replace"))
            self.answer(202, INTERNAL_ERROR)
            return
        await inbox.deliver_committed(self.ctx, rows)
        self.answer(202, INTERNAL_ERROR if outcome == "failed" else RECEIVED)

    def authenticate_headers(self) -> bool:
        """Every credential presented must be right, and at least one presented: the
        API key in either header, SHKeeper's signature when it sends one. True when the
        API key was presented (and right). Without CRYPTO_PROCESSOR_API_KEY nothing is
        right: no sender is open by default (a forged "paid" would mark an order paid)."""
        api_key = self.ctx.settings.crypto_processor_api_key
        if not api_key:
            self.refuse("CRYPTO_PROCESSOR_API_KEY is not set: every callback is refused")
        headers = self.request.headers
        keys = [headers[name] for name in KEY_HEADERS if name in headers]
        if not keys and not self.signed:
            self.refuse("no api key")
        if not all(same_secret(key, api_key) for key in keys):
            self.refuse("api key mismatch")
        return bool(keys)

    @property
    def signed(self) -> bool:
        return SIGNATURE_HEADER in self.request.headers or TIMESTAMP_HEADER in self.request.headers

    def authenticate_signature(self, raw: bytes) -> None:
        api_key = self.ctx.settings.crypto_processor_api_key
        headers = self.request.headers
        if self.signed and not signature_valid(
                api_key, raw, headers.get(SIGNATURE_HEADER), headers.get(TIMESTAMP_HEADER),
                self.ctx.clock()):
            self.refuse("bad or expired signature")

    def refuse(self, why: str) -> NoReturn:
        self.refuse_credentials(401, "invalid api key", f"crypto callback: {why}")

    async def store(self, raw: bytes) -> tuple[str | None, list[Outbox]]:
        """Keep the call in the inbox and handle it; returns (the handling's outcome or
        None, outbox rows still to send)."""
        body = None
        try:
            body = treasury.read(raw)
            if treasury.external_id_of(body) is None:
                await self.ignore(raw, body)
                return None, []
            callback = treasury.Callback.parse(body)
        except treasury.MalformedCallback as malformed:
            return None, await self.reject(raw, body, str(malformed))
        status = callback.status or "unknown"
        placed = self.ctx.plugins[SOURCE].placed(status, body)
        _, _, outcome = await inbox.accept(
            self.ctx, SOURCE, status, placed.same or callback.dedup_key(), raw,
            external_id=callback.external_id, order_number=callback.external_id,
            stream=placed.stream, version=placed.version,
            orders=self.ctx.plugins[SOURCE].orders_of(status, body))
        return outcome, []

    async def ignore(self, raw: bytes, body: dict[str, Any]) -> None:
        """No external_id: nothing to act on (BEHAVIOUR.md 4.3 rule 2). Kept as `ignored`, so
        an operator can see what arrived."""
        status = body.get("status")
        status = status if isinstance(status, str) and status.isprintable() else "unknown"
        log.info("crypto callback without external_id (status %r) ignored", status)
        await inbox.record(self.ctx, SOURCE, status or "unknown",
                           f"no-external-id:{_digest(raw)}", raw, status="ignored",
                           last_error="no external_id")

    async def reject(self, raw: bytes, body: dict[str, Any] | None,
                     reason: str) -> list[Outbox]:
        """Kept as `rejected` with the reason; the admin hears of it when it claimed to be
        paid, since an order may be waiting on this money. Returns the outbox rows to send."""
        external_id = _external_id_or_none(body)
        log.warning("crypto callback for %s rejected: %s", external_id or "unknown order",
                    reason)
        call = (self.ctx, SOURCE, "malformed", f"rejected:{_digest(raw)}", raw)
        kept_as: inbox.CallFields = {"external_id": external_id, "order_number": external_id,
                                     "status": "rejected", "last_error": reason}

        def keep_and_tell() -> list[Outbox]:
            event, created = inbox.store(*call, **kept_as)
            tx = Transaction(self.ctx, event, first_handling=created)
            if created and treasury.claims_paid(body):
                self.tell_admin(tx, event, external_id, reason, raw)
            # The list itself: on PostgreSQL it is filled at the turn's end (Effects).
            return tx.rows
        try:
            return await self.ctx.commits.run(keep_and_tell)
        except UNAVAILABLE:
            # No transaction to be had: the inbox alone can still keep it (in the spool),
            # and the admin's notice with it, written when the drain stores the call.
            notice = _notice(external_id, reason, raw) if treasury.claims_paid(body) else None
            spooled: inbox.CallFields = {**kept_as, "notice": notice}
            await inbox.record(*call, **spooled)
            return []

    def tell_admin(self, tx: Transaction, event: WebhookEvent, external_id: str | None,
                   reason: str, raw: bytes) -> None:
        admin = self.ctx.settings.admin_email
        if not admin:
            log.warning("ADMIN_EMAIL unset: nobody is told of rejected crypto callback #%s",
                        event.id)
            return
        notice = _notice(external_id, reason, raw)
        tx.email([admin], notice["subject"], f"email/{notice['template']}",
                 purpose="crypto_callback_rejected", order_number=external_id,
                 title=notice["subject"], event_id=event.id,
                 received_at=event.received_at.isoformat(timespec="seconds"),
                 **notice["variables"])


def _notice(external_id: str | None, reason: str, raw: bytes) -> inbox.Notice:
    """The admin's mail of a rejected callback that claimed to be paid (BEHAVIOUR.md 4.3
    rule 8), as `inbox.record` keeps it with a spooled call."""
    order = " ".join((external_id or "unknown order").split())[:80]
    return {"subject": f"Crypto payment callback rejected: {order}",
            "template": "crypto_callback_rejected",
            "variables": {"order": order, "reason": reason,
                          "body": raw.decode("utf-8", "replace")[:4000]}}


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _external_id_or_none(body: object) -> str | None:
    try:
        return treasury.external_id_of(body) if isinstance(body, dict) else None
    except treasury.MalformedCallback:
        return None
