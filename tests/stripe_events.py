"""Stripe Event envelopes (API version 2026-03-25.dahlia) as Stripe sends them, and a
signer written from Stripe's documentation, independent of the service's verifier:
Stripe-Signature: t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>."""
import dataclasses
import datetime
import hashlib
import hmac
import itertools
import json

import pytest

from models import WebhookEvent
from tests import shkeeper

API_VERSION = "2026-03-25.dahlia"
SECRET = "whsec_test_5f2b8c1e9a7d4630b1c2d3e4f5a6b7c8"
SECRET_KEY = "sk_test_51Receiver0000000000000000"

_serial = itertools.count(1)
# When the events built here happened at Stripe, unless a test says otherwise (`created`).
CREATED = 1795683600
CREATED_AT = datetime.datetime.fromtimestamp(CREATED, datetime.timezone.utc)


def _id(prefix):
    return f"{prefix}_test_{next(_serial):08d}Xk9"


def sign(raw, secret=SECRET, timestamp=0):
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + raw, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def event(event_type, obj, event_id=None, created=CREATED, api_version=API_VERSION):
    return {
        "id": event_id or _id("evt"),
        "object": "event",
        "api_version": api_version,
        "created": created,
        "data": {"object": obj},
        "livemode": False,
        "pending_webhooks": 1,
        "request": {"id": None, "idempotency_key": None},
        "type": event_type,
    }


def order_metadata(order_id, order_type):
    return {"order_id": order_id, "order_type": order_type} if order_id else {}


def checkout_session(order_id, order_type, payment_status="paid", mode="payment",
                     session_id=None, payment_intent="auto", subscription=None,
                     payment_method_types=("card",), amount_total=49900):
    session_id = session_id or _id("cs")
    return {
        "id": session_id,
        "object": "checkout.session",
        "amount_subtotal": amount_total,
        "amount_total": amount_total,
        "client_reference_id": None,
        "created": 1795683500,
        "currency": "usd",
        "customer": "cus_test_Q1w2E3r4",
        "customer_details": {"email": "buyer@example.test", "name": "Pat Buyer",
                             "address": None, "phone": None, "tax_exempt": "none"},
        "livemode": False,
        "metadata": order_metadata(order_id, order_type),
        "mode": mode,
        "payment_intent": (_id("pi") if payment_intent == "auto" and mode == "payment"
                           else None if payment_intent == "auto" else payment_intent),
        "payment_method_types": list(payment_method_types),
        "payment_status": payment_status,
        "status": "complete",
        "subscription": subscription,
        "success_url": "https://example.test/thanks",
        "url": None,
    }


def checkout_session_needing_no_payment(order_id, order_type, mode="payment",
                                        subscription=None, amount_subtotal=49900):
    """A session Stripe completes without a payment (API 2023-08-16 on, "no-cost orders"):
    a 100 % promotion code on a one-time payment (the subtotal discounted to 0), or a
    subscription whose first period is a trial (nothing due at checkout). payment_status
    is no_payment_required and there is no payment intent."""
    session = checkout_session(order_id, order_type, payment_status="no_payment_required",
                               mode=mode, payment_intent=None, subscription=subscription,
                               amount_total=0)
    discounted = amount_subtotal if mode == "payment" else 0
    return {**session, "amount_subtotal": discounted,
            "discounts": ([{"coupon": None, "promotion_code": _id("promo")}] if discounted
                          else []),
            "invoice": _id("in") if mode == "subscription" else None,
            "payment_method_collection": "if_required",
            "total_details": {"amount_discount": discounted, "amount_shipping": 0,
                              "amount_tax": 0}}


def payment_intent(order_id, order_type, intent_id=None, checkout_session_id=None,
                   payment_method_types=("card",), latest_charge=None,
                   last_payment_error=None, status="succeeded", amount=49900):
    metadata = order_metadata(order_id, order_type)
    if checkout_session_id:
        metadata["checkout_session_id"] = checkout_session_id
    return {
        "id": intent_id or _id("pi"),
        "object": "payment_intent",
        "amount": amount,
        "amount_received": amount if status == "succeeded" else 0,
        "capture_method": "automatic",
        "created": 1795683500,
        "currency": "usd",
        "customer": "cus_test_Q1w2E3r4",
        "last_payment_error": last_payment_error,
        "latest_charge": latest_charge or _id("ch"),
        "livemode": False,
        "metadata": metadata,
        "payment_method": _id("pm"),
        "payment_method_types": list(payment_method_types),
        "status": status,
    }


def card_declined(message="Your card was declined."):
    return {"code": "card_declined", "decline_code": "generic_decline", "message": message,
            "type": "card_error"}


def dispute(payment_intent_id, amount=12345, reason="fraudulent", status="needs_response",
            dispute_id=None, charge_id=None, currency="usd", withdrawn=False,
            reinstated=False):
    """A Dispute as its events carry it: `status` one of needs_response, under_review,
    won, lost, warning_needs_response, warning_under_review, warning_closed, prevented;
    the balance transactions of its funds withdrawn (and reinstated), in the account's
    settlement currency, as funds_withdrawn (funds_reinstated) shows them."""
    moves = []
    if withdrawn:
        moves.append({"id": _id("txn"), "object": "balance_transaction", "amount": -amount,
                      "currency": currency, "fee": 1500, "net": -amount - 1500,
                      "reporting_category": "dispute", "type": "adjustment"})
    if reinstated:
        moves.append({"id": _id("txn"), "object": "balance_transaction", "amount": amount,
                      "currency": currency, "fee": -1500, "net": amount + 1500,
                      "reporting_category": "dispute_reversal", "type": "adjustment"})
    return {
        "id": dispute_id or _id("dp"),
        "object": "dispute",
        "amount": amount,
        "balance_transactions": moves,
        "charge": charge_id or _id("ch"),
        "created": 1795683500,
        "currency": currency,
        "enhanced_eligibility_types": [],
        "evidence_details": {"due_by": 1796547600, "has_evidence": False,
                             "past_due": False, "submission_count": 0},
        "is_charge_refundable": False,
        "livemode": False,
        "metadata": {},
        "payment_intent": payment_intent_id,
        "payment_method_details": {"card": {"brand": "visa", "network_reason_code": "10.4"},
                                   "type": "card"},
        "reason": reason,
        "status": status,
    }


def charge(payment_intent_id, amount=49900, amount_refunded=0, charge_id=None,
           currency="usd", metadata=None):
    """A Charge as charge.refunded carries it (API 2022-11-15 on: its refunds are not
    listed unless expanded; from 2025-03-31.basil on it names no invoice): `refunded` is
    Stripe's own "refunded in full"."""
    return {
        "id": charge_id or _id("ch"),
        "object": "charge",
        "amount": amount,
        "amount_captured": amount,
        "amount_refunded": amount_refunded,
        "balance_transaction": _id("txn"),
        "captured": True,
        "created": 1795683500,
        "currency": currency,
        "customer": "cus_test_Q1w2E3r4",
        "disputed": False,
        "livemode": False,
        "metadata": metadata or {},
        "paid": True,
        "payment_intent": payment_intent_id,
        "payment_method": _id("pm"),
        "payment_method_details": {"card": {"brand": "visa", "last4": "4242"}, "type": "card"},
        "receipt_url": "https://pay.stripe.com/receipts/payment/test",
        "refunded": amount_refunded >= amount,
        "status": "succeeded",
    }


def charge_before_basil(payment_intent_id, invoice=None, **fields):
    """The same charge rendered before 2025-03-31.basil: it names the invoice it paid
    (null for a payment outside invoicing)."""
    return {**charge(payment_intent_id, **fields), "invoice": invoice}


def upcoming_invoice(subscription_id, amount_due=19900, next_payment_attempt=1796288400):
    """The invoice of invoice.upcoming: not created yet, so it has no id."""
    rendered = invoice(subscription_id, amount_due=amount_due, status="draft")
    del rendered["id"]
    return {**rendered, "amount_paid": 0, "amount_remaining": amount_due,
            "hosted_invoice_url": None, "next_payment_attempt": next_payment_attempt,
            "period_end": next_payment_attempt - 3600}


def balance():
    return {
        "object": "balance",
        "available": [{"amount": 250000, "currency": "usd",
                       "source_types": {"card": 250000}}],
        "livemode": False,
        "pending": [{"amount": 0, "currency": "usd", "source_types": {"card": 0}}],
    }


def invoice(subscription_id, billing_reason="subscription_cycle", invoice_id=None,
            attempt_count=1, amount_due=19900, customer_email="buyer@example.test",
            customer_name="Pat Buyer", status="paid"):
    invoice_id = invoice_id or _id("in")
    return {
        "id": invoice_id,
        "object": "invoice",
        "amount_due": amount_due,
        "amount_paid": amount_due if status == "paid" else 0,
        "amount_remaining": 0 if status == "paid" else amount_due,
        "attempt_count": attempt_count,
        "attempted": True,
        "billing_reason": billing_reason,
        "collection_method": "charge_automatically",
        "currency": "usd",
        "customer": "cus_test_Q1w2E3r4",
        "customer_email": customer_email,
        "customer_name": customer_name,
        "hosted_invoice_url": f"https://invoice.stripe.com/i/acct_test/{invoice_id}",
        "livemode": False,
        "metadata": {},
        "parent": {
            "quote_details": None,
            "subscription_details": {"metadata": {}, "subscription": subscription_id},
            "type": "subscription_details",
        },
        "status": status,
    }


def invoice_before_basil(subscription_id, **fields):
    """The same invoice rendered in an API version before 2025-03-31.basil (an endpoint or
    `stripe listen` on an older account default): the subscription at the top level,
    with subscription_details, paid, charge and payment_intent; no parent."""
    rendered = invoice(subscription_id, **fields)
    del rendered["parent"]
    return {**rendered, "subscription": subscription_id,
            "subscription_details": {"metadata": {}}, "paid": rendered["status"] == "paid",
            "paid_out_of_band": False, "charge": _id("ch"), "payment_intent": _id("pi"),
            "quote": None}


def subscription(subscription_id, ended_at=1795683600):
    return {
        "id": subscription_id,
        "object": "subscription",
        "cancel_at_period_end": False,
        "canceled_at": ended_at,
        "customer": "cus_test_Q1w2E3r4",
        "ended_at": ended_at,
        "livemode": False,
        "metadata": {},
        "status": "canceled",
    }


def raw_of(evt):
    """The bytes Stripe sends: pretty-printed JSON, two-space indent, like its payloads."""
    return json.dumps(evt, indent=2).encode("utf-8")


# --- delivering them to the service under test ----------------------------------------------

CARD_URL = "/api/v1/webhooks/card-processor"


def with_payment_processors(settings, **changes):
    """`settings` with the card processor configured and the crypto processor's key, and
    `changes`."""
    return dataclasses.replace(settings, stripe_secret_key=SECRET_KEY,
                               stripe_webhook_secrets=(SECRET,),
                               crypto_processor_api_key=shkeeper.API_KEY, **changes)


@pytest.fixture
def settings(settings):
    """The suite's settings with the card processor configured."""
    return dataclasses.replace(settings, stripe_secret_key=SECRET_KEY,
                               stripe_webhook_secrets=(SECRET,))


async def deliver(post, clock, evt=None, raw=None, secret=SECRET, age=0,
                  header="Stripe-Signature"):
    """POST an event signed `age` seconds before the service's clock; returns
    (status, json, response)."""
    raw = raw_of(evt) if raw is None else raw
    signature = sign(raw, secret, int(clock().timestamp()) - age)
    return await post(CARD_URL, raw, {header: signature, "Content-Type": "application/json"})


RECEIVED = (200, {"received": True})


@pytest.fixture
def send(post, ctx, clock):
    """Deliver a signed event and wait for any background handling to finish; returns
    the event's inbox row."""
    async def send_event(event_type, obj, api_version=API_VERSION, created=CREATED):
        evt = event(event_type, obj, api_version=api_version, created=created)
        assert (await deliver(post, clock, evt))[:2] == RECEIVED
        await ctx.drain_background()
        return WebhookEvent.get(WebhookEvent.external_id == evt["id"])
    return send_event
