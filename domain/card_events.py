"""Card-processor (Stripe) events: how a verified event is recognised, stored and handled,
and the small vocabulary the card plugins share.

The webhook handler and the event backfill both feed events through `accept`.
"""
import asyncio
import functools
import hashlib
import logging
from typing import Any, Callable

import stripe

from clients.stripe_api import API_VERSION, stripe_client
from models import ORDER_MODELS
from engine import inbox
from engine.contracts import EngineContext
from engine.transaction import Transaction, wait_key
# The plugins' vocabulary includes the admin e-mail, which the shared order steps use too.
from domain.orders import email_admin, payment_method_of  # noqa: F401

log = logging.getLogger("receiver.card")

SOURCE = "card"


def fact_key(ctx: EngineContext, event: dict[str, Any]) -> str:
    """The key under which deliveries of `event` are one fact, as its type's plugin
    declares it (plugins.card); its Stripe id for a type with no plugin."""
    return ctx.plugins[SOURCE].placed(event["type"], event).same or event["id"]


def problem_with(event: Any) -> str | None:
    """Why a verified body is not a Stripe event we can store, or None."""
    if not isinstance(event, dict):
        return "not a JSON object"
    for field in ("id", "type"):
        if not isinstance(event.get(field), str) or not event[field]:
            return f"no {field}"
    if not isinstance(event.get("data"), dict) or not isinstance(
            event["data"].get("object"), dict):
        return "no data.object"
    obj = object_of(event)
    # Each goes into an indexed column: the event id, its type, the object's id (in the
    # key of a fact that happens once per object), the order id of its metadata.
    for name, value in (("id", event["id"]), ("type", event["type"]),
                        ("data.object.id", obj.get("id")),
                        ("metadata.order_id", metadata_of(obj).get("order_id"))):
        if isinstance(value, str) and len(value) > inbox.MAX_KEY_LENGTH:
            return f"{name} too long"
    return None


class VersionWatch:
    """Warns once per process for each API version, other than ours, that events come in:
    an endpoint (or `stripe listen`, which uses the account's default version) set to
    another version renders objects in shapes that may have moved."""

    def __init__(self) -> None:
        self.seen: set[Any] = set()

    def __call__(self, event: dict[str, Any]) -> None:
        version = event.get("api_version")
        if version == API_VERSION or version in self.seen:
            return
        self.seen.add(version)
        log.warning("card event %s is in API version %r, not %s: set the webhook endpoint "
                    "to %s (the service reads the older invoice shape as well)",
                    event.get("id"), version, API_VERSION, API_VERSION)


check_version = VersionWatch()


async def accept(ctx: EngineContext, event: dict[str, Any], raw: bytes) -> None:
    """Store a verified event in the inbox and handle it: in the background for the types
    whose plugin declares so (BEHAVIOUR.md 4.2), before returning for the others. A
    handling error is logged and left on the inbox row for retry; it never raises."""
    check_version(event)
    registry = ctx.plugins[SOURCE]
    in_background = registry.in_background(event["type"])
    placed = registry.placed(event["type"], event)
    await inbox.accept(
        ctx, SOURCE, event["type"], placed.same or event["id"], raw,
        external_id=event["id"], stream=placed.stream, version=placed.version,
        order_number=metadata_of(object_of(event)).get("order_id"),
        in_background=in_background,
        orders=() if in_background else registry.orders_of(event["type"], event))


async def reject(ctx: EngineContext, raw: bytes, reason: str) -> None:
    """Keep a signed body that is not a Stripe event, with the reason, for an operator."""
    log.error("card webhook: signed body is not a Stripe event (%s); kept as rejected",
              reason)
    await inbox.record(ctx, SOURCE, "unreadable", "raw:" + hashlib.sha256(raw).hexdigest(),
                       raw, status="rejected", last_error=reason)


# --- what the plugins share ---------------------------------------------------------------

def object_of(event: dict[str, Any]) -> dict[str, Any]:
    return event["data"]["object"]


def metadata_of(obj: dict[str, Any]) -> dict[str, Any]:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def order_of_metadata(obj: dict[str, Any]) -> tuple[str, str] | None:
    """(order_id, order_type) from the object's metadata, or None (logged) when either is
    missing or the type is not one of ours: no retry would change that."""
    metadata = metadata_of(obj)
    order_id, order_type = metadata.get("order_id"), metadata.get("order_type")
    if not order_id or not order_type:
        log.warning("%s %s has no metadata.order_id/order_type; nothing to do",
                    obj.get("object"), obj.get("id"))
        return None
    if order_type not in ORDER_MODELS:
        log.error("%s %s names an unknown order_type %r; nothing to do",
                  obj.get("object"), obj.get("id"), order_type)
        return None
    return order_id, order_type


def payment_method_used(obj: dict[str, Any]) -> str | None:
    """Our word for how a session or payment intent was paid, when the object tells it:
    the only allowed method type. Webhook events never expand latest_charge (it is a
    "ch_..." id), so with several allowed types the method is unknown (None)."""
    types = obj.get("payment_method_types") or []
    return payment_method_of(types[0]) if len(types) == 1 else None


async def method_of_payment(ctx: EngineContext, obj: dict[str, Any], order_type: str,
                            intent_id: str | None) -> str | None:
    """The payment method of a session or intent. A CRTC order's settlement depends on it,
    so when the event leaves it open (several methods allowed) Stripe is asked."""
    method = payment_method_used(obj)
    if method is None and order_type == "canada_crtc":
        method = await charged_method(ctx, intent_id)
    return method


async def charged_method(ctx: EngineContext, intent_id: str | None) -> str | None:
    """The method of the intent's charge, asked of Stripe with the charge expanded (an
    event only names it, "ch_..."). None when Stripe cannot be asked or does not say: the
    order is then paid without a method, and the administrator told."""
    if not intent_id or not ctx.settings.stripe_secret_key:
        return None
    retrieve = functools.partial(stripe_client(ctx.settings).v1.payment_intents.retrieve,
                                 intent_id, params={"expand": ["latest_charge"]})
    try:
        # The stripe library blocks; the loop stays free for other requests meanwhile.
        retrieved = await asyncio.get_running_loop().run_in_executor(None, retrieve)
    except stripe.StripeError as exc:
        log.warning("payment intent %s: could not ask Stripe which method paid: %s",
                    intent_id, exc)
        return None
    charge = retrieved.to_dict().get("latest_charge")
    details = charge.get("payment_method_details") if isinstance(charge, dict) else None
    return payment_method_of((details or {}).get("type"))


async def ask_stripe(ctx: EngineContext, what: str, call: Callable[[Any], Any], *args: Any,
                     **params: Any) -> dict[str, Any] | None:
    """Stripe's object as it is now (`call(*args, params=params)` of the stripe client's
    v1 services, `what` naming it for the log), as a plain dict; None when STRIPE_SECRET_KEY
    is unset or Stripe does not know the object. Any other failure (Stripe unreachable,
    a 5xx, a rate limit) raises: the event is handled again later."""
    if not ctx.settings.stripe_secret_key:
        log.warning("%s not asked of Stripe: STRIPE_SECRET_KEY is not set", what)
        return None
    method = call(stripe_client(ctx.settings).v1)
    try:
        # The stripe library blocks; the loop stays free for other requests meanwhile.
        answer = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(method, *args, params=params or None))
    except stripe.InvalidRequestError as unknown:
        log.warning("%s: Stripe does not know it: %s", what, unknown)
        return None
    return answer.to_dict()


def subscription_of_invoice(invoice: dict[str, Any]) -> str | None:
    """The invoice's subscription id. From API 2025-03-31.basil on (ours is
    2026-03-25.dahlia) it is under the invoice's parent; an invoice rendered in an older
    version (an endpoint or `stripe listen` on an older version) has it at the top."""
    details = (invoice.get("parent") or {}).get("subscription_details") or {}
    return details.get("subscription") or invoice.get("subscription")


# --- facts waiting for their order ----------------------------------------------------------

def ids_of(**ids: Any) -> list[str]:
    """The ids that will find a fact's order (`payment_intent="pi_1"`, ...), as the inbox
    keeps them (engine.store.intake.wait_key); those not given or not text left out."""
    return [wait_key(kind, value) for kind, value in ids.items()
            if isinstance(value, str) and value]


def linked(ctx: EngineContext, tx: Transaction, **ids: Any) -> None:
    """In a transaction: the ids now linked to an order (its payment intent, its
    subscription, a renewal's invoice, a refunded charge, its number): the facts waiting
    for one of them are due, and handled once this handling is committed (in the
    background, after the answer: the payment's own round trips stay as they were)."""
    keys = ids_of(**ids)
    tx.wake_facts_later(keys, ctx.clock())
    tx.woken.extend(keys)
