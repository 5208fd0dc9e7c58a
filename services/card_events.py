"""Card-processor (Stripe) events: how a verified event is recognised, stored and handled,
and the small vocabulary the card plugins share.

The webhook handler and the event backfill both feed events through `accept`.
"""
import decimal
import hashlib
import logging

from models import ORDER_MODELS, ComplianceOrder, SubscriptionCycle
from services import inbox
from services.orders import payment_method_of

log = logging.getLogger("receiver.card")

SOURCE = "card"

# SPEC.md 4.2 handles these "in the background": after the answer is sent.
BACKGROUND_TYPES = frozenset({
    "payment_intent.payment_failed", "charge.dispute.created", "balance.available"})


def dedup_key(event):
    """One key per thing that happened, not per delivery: Stripe may redeliver an event id,
    and may send a second Event object for the same (object, type).

    An invoice fails once per collection attempt, and each attempt matters (the customer
    is nudged on the first only), so the attempt number is part of that key."""
    obj = event.get("data", {}).get("object", {})
    if not obj.get("id"):
        return event["id"]
    key = f"{event['type']}:{obj['id']}"
    if event["type"] == "invoice.payment_failed":
        key += f":{obj.get('attempt_count')}"
    return key


def problem_with(event):
    """Why a verified body is not a Stripe event we can store, or None."""
    if not isinstance(event, dict):
        return "not a JSON object"
    for field in ("id", "type"):
        if not isinstance(event.get(field), str) or not event[field]:
            return f"no {field}"
    if not isinstance(event.get("data"), dict) or not isinstance(
            event["data"].get("object"), dict):
        return "no data.object"
    return None


async def accept(ctx, event, raw):
    """Store a verified event in the inbox and handle it: in the background for the types
    SPEC.md handles so, before returning for the others. A handling error is logged and
    left on the inbox row for retry; it never raises."""
    stored, created = inbox.record(
        ctx, SOURCE, event["type"], dedup_key(event), raw, external_id=event["id"],
        order_number=metadata_of(object_of(event)).get("order_id"))
    if stored is None or not created:
        return
    if event["type"] in BACKGROUND_TYPES:
        ctx.background(inbox.process(ctx, stored))
    else:
        await inbox.process(ctx, stored)


def reject(ctx, raw, reason):
    """Keep a signed body that is not a Stripe event, with the reason, for an operator."""
    log.error("card webhook: signed body is not a Stripe event (%s); kept as rejected",
              reason)
    inbox.record(ctx, SOURCE, "unreadable", "raw:" + hashlib.sha256(raw).hexdigest(), raw,
                 status="rejected", last_error=reason)


# --- what the plugins share ---------------------------------------------------------------

def object_of(event):
    return event["data"]["object"]


def metadata_of(obj):
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def order_of_metadata(obj):
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


def payment_method_used(obj):
    """Our word for how a session or payment intent was paid, when the object tells it:
    an expanded charge's payment_method_details, else the only allowed method type."""
    charge = obj.get("latest_charge")
    if isinstance(charge, dict) and (charge.get("payment_method_details") or {}).get("type"):
        return payment_method_of(charge["payment_method_details"]["type"])
    types = obj.get("payment_method_types") or []
    return payment_method_of(types[0]) if len(types) == 1 else None


def subscription_of_invoice(invoice):
    """API 2026-03-25.dahlia keeps an invoice's subscription under its parent."""
    details = (invoice.get("parent") or {}).get("subscription_details") or {}
    return details.get("subscription")


def order_with_subscription(subscription_id):
    if not subscription_id:
        return None
    return (ComplianceOrder.select()
            .where(ComplianceOrder.stripe_subscription_id == subscription_id).first())


def dollars(cents):
    """Integer cents as dollars with two decimals, exactly: 123456 -> '1234.56'."""
    amount = decimal.Decimal(int(cents or 0)) / 100
    return str(amount.quantize(decimal.Decimal("0.01")))


def email_admin(ctx, effects, subject, template, order, **variables):
    """An e-mail to ADMIN_EMAIL about order number `order` (templates see it as `order`);
    logged instead when no administrator is configured."""
    if not ctx.settings.admin_email:
        log.warning("ADMIN_EMAIL unset; not e-mailed: %s", subject)
        return None
    return effects.email([ctx.settings.admin_email], subject, f"email/{template}",
                         order_number=order, title=subject, order=order, **variables)


def record_cycle(ctx, order, subscription_id, invoice_id):
    """The renewal number of a paid invoice: 1 + the renewals recorded before it. The same
    invoice keeps its number; two invoices racing for one number cannot both have it (a
    unique index), so the loser fails and is retried with the next number."""
    known = SubscriptionCycle.get_or_none(SubscriptionCycle.invoice_id == invoice_id)
    if known:
        return known.cycle
    cycle = 1 + (SubscriptionCycle.select()
                 .where(SubscriptionCycle.subscription_id == subscription_id).count())
    now = ctx.clock()
    SubscriptionCycle.create(subscription_id=subscription_id, invoice_id=invoice_id,
                             order_number=order.order_number, cycle=cycle,
                             created_at=now, updated_at=now)
    return cycle
