"""Stripe's API, asked by the backfill and when an event leaves a payment method open."""
import stripe


class NotConfigured(Exception):
    """A setting the call needs is missing; the message names it."""


def stripe_client(settings):
    if not settings.stripe_secret_key:
        raise NotConfigured("STRIPE_SECRET_KEY is not set")
    base = {"api": settings.stripe_api_base} if settings.stripe_api_base else None
    return stripe.StripeClient(
        settings.stripe_secret_key, base_addresses=base, max_network_retries=2,
        http_client=stripe.RequestsClient(timeout=settings.outbound_timeout_seconds))
