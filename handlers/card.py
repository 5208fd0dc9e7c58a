"""POST /api/v1/webhooks/card-processor: signed Stripe events (BEHAVIOUR.md 4.2)."""
import datetime
import logging
from typing import Any, Sequence

import stripe

from handlers.base import ApiHandler
from domain import card_events
from engine.payload import read_json

log = logging.getLogger("receiver.card")

SIGNATURE_HEADERS = ("Processor-Signature", "Stripe-Signature")
# Stripe's own default for the age of a signature; we refuse as far into the future too,
# so a signature made with a clock running ahead cannot be replayed for longer.
TOLERANCE_SECONDS = 300


def signature_problem(raw: bytes, header: str, secrets: Sequence[str],
                      now: datetime.datetime) -> str | None:
    """None when `header` (t=<unix>,v1=<hex>,...) signs `raw` with any of `secrets`
    (several during a rotation) and its time is within TOLERANCE_SECONDS of `now`; else
    what is wrong, for the log (the sender is only told that verification failed)."""
    try:
        payload = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "the body is not UTF-8"
    if not any(_verifies(payload, header, secret) for secret in secrets):
        return ("no secret in STRIPE_WEBHOOK_SECRET signs this body (another endpoint's "
                "or `stripe listen`'s secret, or a changed body)")
    age = now.timestamp() - _signed_at(header)
    if abs(age) > TOLERANCE_SECONDS:
        return (f"signed with the right secret, but {abs(age):.0f} s "
                f"{'ago' if age > 0 else 'ahead of our clock'}, beyond {TOLERANCE_SECONDS} s "
                "(a replayed event, or a clock that is off)")
    return None


def _verifies(payload: str, header: str, secret: str) -> bool:
    try:
        # The library's own time check uses the system clock and only looks back; ours
        # (in signature_problem) uses the service's clock and looks both ways.
        return stripe.WebhookSignature.verify_header(payload, header, secret, tolerance=None)
    except stripe.SignatureVerificationError:
        return False


def _signed_at(header: str) -> int:
    """The first t= value, as the library reads it; only called on a verified header."""
    items = (item.split("=", 2) for item in header.split(","))
    return int(next(parts[1] for parts in items if parts[0] == "t"))


class CardWebhookHandler(ApiHandler):
    @property
    def configured(self) -> bool:
        settings = self.ctx.settings
        return bool(settings.stripe_secret_key and settings.stripe_webhook_secrets)

    def check_headers(self) -> bool:
        """A call without a signature is refused before its body is read; the signature
        itself covers the body, so it is checked once the body is in."""
        if self.configured and not self.signature_header():
            self.fail(400, "Missing signature header")
        return False

    async def post(self) -> None:
        if not self.configured:
            log.warning("card webhook ignored: STRIPE_SECRET_KEY or STRIPE_WEBHOOK_SECRET unset")
            self.answer(200, {"received": True})
            return
        raw = self.raw_body
        header = self.signature_header()
        assert header is not None  # check_headers refused a call without one
        problem = signature_problem(raw, header,
                                    self.ctx.settings.stripe_webhook_secrets, self.ctx.clock())
        if problem:
            self.refuse_credentials(400, "Webhook signature verification failed",
                                    f"card webhook: signature verification failed: {problem}")
        await self.accept(raw)
        self.answer(200, {"received": True})

    def signature_header(self) -> str | None:
        for name in SIGNATURE_HEADERS:
            value = self.request.headers.get(name, "").strip()
            if value:
                return value
        return None

    async def accept(self, raw: bytes) -> None:
        try:
            event: Any = read_json(raw)
        except ValueError:
            event = None
        problem = card_events.problem_with(event)
        if problem:
            await card_events.reject(self.ctx, raw, problem)
        else:
            await card_events.accept(self.ctx, event, raw)
