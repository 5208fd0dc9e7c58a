"""Stripe's API, asked by the backfill and when an event leaves a payment method open."""
import stripe
from stripe._base_address import BaseAddresses

from settings import Settings

# The API version every request is made in, and the one the webhook endpoint is set to.
# Named here rather than left to the package's default, which moves with its upgrades.
API_VERSION = "2026-03-25.dahlia"


class NotConfigured(Exception):
    """A setting the call needs is missing; the message names it."""


def stripe_client(settings: Settings) -> stripe.StripeClient:
    if not settings.stripe_secret_key:
        raise NotConfigured("STRIPE_SECRET_KEY is not set")
    base: BaseAddresses | None = (
        {"api": settings.stripe_api_base} if settings.stripe_api_base else None)
    return stripe.StripeClient(
        settings.stripe_secret_key, base_addresses=base, max_network_retries=2,
        stripe_version=API_VERSION,
        http_client=stripe.RequestsClient(timeout=settings.outbound_timeout_seconds))
