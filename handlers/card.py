"""POST /api/v1/webhooks/card-processor: signed Stripe events (BEHAVIOUR.md 4.2)."""
import json
import logging

import stripe

from handlers.base import ApiHandler
from domain import card_events

log = logging.getLogger("receiver.card")

SIGNATURE_HEADERS = ("Processor-Signature", "Stripe-Signature")
# Stripe's own default for the age of a signature; we refuse as far into the future too,
# so a signature made with a clock running ahead cannot be replayed for longer.
TOLERANCE_SECONDS = 300


def signature_valid(raw, header, secrets, now):
    """True when `header` (t=<unix>,v1=<hex>,...) signs `raw` with any of `secrets`
    (several during a rotation) and its time is within TOLERANCE_SECONDS of `now`."""
    try:
        payload = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    if not any(_verifies(payload, header, secret) for secret in secrets):
        return False
    return abs(now.timestamp() - _signed_at(header)) <= TOLERANCE_SECONDS


def _verifies(payload, header, secret):
    try:
        # The library's own time check uses the system clock and only looks back; ours
        # (in signature_valid) uses the service's clock and looks both ways.
        return stripe.WebhookSignature.verify_header(payload, header, secret, tolerance=None)
    except stripe.SignatureVerificationError:
        return False


def _signed_at(header):
    """The first t= value, as the library reads it; only called on a verified header."""
    items = (item.split("=", 2) for item in header.split(","))
    return int(next(parts[1] for parts in items if parts[0] == "t"))


class CardWebhookHandler(ApiHandler):
    async def post(self):
        settings = self.ctx.settings
        if not (settings.stripe_secret_key and settings.stripe_webhook_secrets):
            log.warning("card webhook ignored: STRIPE_SECRET_KEY or STRIPE_WEBHOOK_SECRET unset")
            self.answer(200, {"received": True})
            return
        header = self.signature_header()
        if not header:
            self.fail(400, "Missing signature header")
        raw = self.raw_body
        if not signature_valid(raw, header, settings.stripe_webhook_secrets, self.ctx.clock()):
            log.warning("card webhook: signature verification failed")
            self.fail(400, "Webhook signature verification failed")
        await self.accept(raw)
        self.answer(200, {"received": True})

    def signature_header(self):
        for name in SIGNATURE_HEADERS:
            value = self.request.headers.get(name, "").strip()
            if value:
                return value
        return None

    async def accept(self, raw):
        try:
            event = json.loads(raw)
        except ValueError:
            event = None
        problem = card_events.problem_with(event)
        if problem:
            card_events.reject(self.ctx, raw, problem)
        else:
            await card_events.accept(self.ctx, event, raw)
