"""Card events about a payment after it was made: its dispute (opened, updated, closed,
funds withdrawn or reinstated) and its refunds (BEHAVIOUR.md 4.2, 3.3).

Each is a fact about the payment of one order (domain.payment_state), kept when it is
newer than what the order knew; the order's payment_status is then what its facts give.
So a dispute won returns the order to `paid`, one lost makes it `dispute_lost`, a refund in
full `refunded`, a partial one keeps its amount on a paid order; and an event that comes
late changes nothing a newer one said. A disputed, lost or refunded order is not settled
(settlement takes `paid` orders only) and its commission is not released (any dispute,
and a refund in full, forfeit it: domain.holdback).

The order: the one whose payment intent is the charge's (as the order recorded it), else
the one whose refunds are of the charge, else the one a renewal invoice of the charge was
recorded for, else the one the charge's metadata names; else Stripe is asked: the payment
intent's metadata, or the invoice it paid and that invoice's subscription (from API
2025-03-31.basil on, a charge no longer names its invoice: the invoice payments of the
intent do). Without STRIPE_SECRET_KEY nothing is asked.

A fact whose order is found by none of them is never finished as about no order: it
waits (engine.inbox, status `waiting`) with the ids that will find it (its payment
intent, charge, invoice, the subscription Stripe named, the order number named but not
stored yet), and is handled again when one of them is linked to an order (a checkout
completed, a renewal recorded: domain.card_events.linked; an order stored).

Every time kept and noted is the sender's: the event's `created`.

Where two facts conflict (domain.payment_state.Change.CONFLICT), Stripe is asked for the
dispute or the charge as it is now, and that is kept; without an answer (no key, or an
object Stripe does not know) the rule's choice is kept: a loss, a closed dispute, or the
larger refund.

The administrator is told once per fact, each time with the amount and its currency, once
its order is known: a dispute opened (whichever of its events came first), each outcome
it closed with, each refund. The mails are keyed by the dispute or charge, so a copy of
an event, or another event telling the same fact, adds none.
"""
import dataclasses
import datetime
import functools
import logging
from typing import Any, Callable

from domain import holdback, payment_state
from domain.card_events import (ask_stripe, ids_of, linked, metadata_of, object_of,
                                subscription_of_invoice)
from domain.orders import OrderNotFound, email_admin, settle_status
from domain.payment_state import Change, DisputeFact, RefundFact
from engine.contracts import EngineContext
from engine.transaction import Transaction
from models import ORDER_MODELS, ComplianceOrder, CrtcOrder, OrderBase

log = logging.getLogger("receiver.card")

# What each dispute event's note line calls it.
DISPUTE_NOTES = {
    "charge.dispute.created": "Dispute opened",
    "charge.dispute.updated": "Dispute updated",
    "charge.dispute.closed": "Dispute closed",
    "charge.dispute.funds_withdrawn": "Dispute funds withdrawn",
    "charge.dispute.funds_reinstated": "Dispute funds reinstated",
}
# The subject's word for each way a dispute closes.
OUTCOMES = {"won": "won", "lost": "lost", "warning_closed": "closed (inquiry)",
            "prevented": "prevented"}


# (kind, number) of an order.
Found = tuple[str, str]


# --- which order ------------------------------------------------------------------------

def _stored_order_of(tx: Transaction, payment_intent: str | None, invoice_id: str | None,
                     charge_id: str | None) -> Found | None:
    """(kind, number) of the order the stored references name, or None (a unit)."""
    order = tx.order_paid_by(payment_intent) if payment_intent else None
    if order is None and charge_id:
        order = tx.order_refunded_by(charge_id)
    if order is not None and order.kind is not None:  # every stored order has a kind
        return order.kind, order.order_number
    if invoice_id:
        cycle = tx.subscription_cycle(invoice_id)
        if cycle is not None:
            return "compliance", cycle.order_number
    return None


def _named_by(obj: dict[str, Any] | None) -> Found | None:
    """(kind, number) of the order an object's metadata names, or None (charges and
    disputes seldom carry any)."""
    metadata = metadata_of(obj or {})
    order_id, order_type = metadata.get("order_id"), metadata.get("order_type")
    if isinstance(order_id, str) and order_id and order_type in ORDER_MODELS:
        return order_type, order_id
    return None


def _order_of_subscription(tx: Transaction, subscription_id: str) -> Found | None:
    order = tx.order_with_subscription(subscription_id)
    return None if order is None else ("compliance", order.order_number)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


@dataclasses.dataclass
class Search:
    """Where a charge's or a dispute's order was looked for: the order found, or None;
    the ids that will find it once one of them is linked to an order (what the fact
    waits for)."""
    found: Found | None
    ids: dict[str, str]

    def waiting_for(self) -> list[str]:
        return ids_of(**self.ids)


async def order_of_charge(ctx: EngineContext, tx: Transaction,
                          obj: dict[str, Any]) -> Search:
    """The order a charge or a dispute (`obj`) is about, or the ids that will find it
    when neither what is stored nor Stripe tells (module docstring)."""
    payment_intent = _text(obj.get("payment_intent"))
    charge_id = _text(obj.get("charge")) if obj.get("object") == "dispute" else _text(
        obj.get("id"))
    # A charge rendered before 2025-03-31.basil names its invoice.
    invoice_id = _text(obj.get("invoice"))
    search = Search(None, {kind: value for kind, value in (
        ("payment_intent", payment_intent), ("charge", charge_id), ("invoice", invoice_id))
        if value})
    search.found = (await ctx.db(functools.partial(_stored_order_of, tx, payment_intent,
                                                   invoice_id, charge_id))
                    or _named_by(obj))
    if search.found is None and payment_intent:
        intent = await ask_stripe(ctx, f"payment intent {payment_intent}",
                                  lambda v1: v1.payment_intents.retrieve, payment_intent)
        search.found = _named_by(intent)
        if search.found is None and intent is not None and invoice_id is None:
            paid = await ask_stripe(
                ctx, f"invoice payments of {payment_intent}",
                lambda v1: v1.invoice_payments.list,
                payment={"type": "payment_intent", "payment_intent": payment_intent},
                expand=["data.invoice"])
            invoices = [item.get("invoice") for item in (paid or {}).get("data") or ()]
            search.found = await _order_of_invoice(ctx, tx, invoices[0] if invoices else None,
                                                   search)
    if search.found is None and invoice_id:
        invoice = await ask_stripe(ctx, f"invoice {invoice_id}",
                                   lambda v1: v1.invoices.retrieve, invoice_id)
        search.found = await _order_of_invoice(ctx, tx, invoice, search)
    return search


async def _order_of_invoice(ctx: EngineContext, tx: Transaction, invoice: Any,
                            search: Search) -> Found | None:
    """The order of the invoice's subscription; the invoice and its subscription kept
    among the ids that will find it."""
    if not isinstance(invoice, dict):
        return None
    if _text(invoice.get("id")):
        search.ids.setdefault("invoice", invoice["id"])
    subscription = subscription_of_invoice(invoice)
    if not subscription:
        return None
    search.ids["subscription"] = subscription
    return await ctx.db(functools.partial(_order_of_subscription, tx, subscription))


def _lock_order(tx: Transaction, found: Found) -> OrderBase:
    kind, number = found
    order = tx.lock_order(kind, number)
    if order is None:
        raise OrderNotFound(f"no {kind} order {number}")
    return order


def _stamp(when: datetime.datetime) -> str:
    return when.isoformat(timespec="seconds")


def _wait(tx: Transaction, what: str, search: Search) -> None:
    """The fact waits for its order, with the ids that will find it."""
    log.info("%s: its order is not known yet; waiting for %s", what,
             ", ".join(search.waiting_for()) or "nothing to find it by")
    tx.wait_for_order(f"{what}: its order is not known yet", search.waiting_for())


# --- disputes ---------------------------------------------------------------------------

async def dispute_event(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    """A charge.dispute.* event: its dispute, as of the event's `created`, is a fact about
    the order's payment; one whose order is not known yet waits for it."""
    dispute = object_of(event)
    fact = DisputeFact.of(dispute, payment_state.as_of(event.get("created"), ctx.clock()))
    search = await order_of_charge(ctx, tx, dispute)
    what = f"dispute {fact.dispute_id}"
    if search.found is None:
        _wait(tx, what, search)
        return
    record = functools.partial(record_dispute, ctx, tx, search.found,
                               DISPUTE_NOTES[event["type"]])
    await _keep(ctx, tx, record, fact, what, search,
                lambda v1: v1.disputes.retrieve, fact.dispute_id)


async def _keep(ctx: EngineContext, tx: Transaction, record: Callable[..., Change],
                fact: DisputeFact | RefundFact, what: str, search: Search,
                retrieve: Callable[[Any], Any], object_id: str) -> None:
    """`record(fact)` in a transaction; on a conflict, `record` again with Stripe's object
    as it is now (`retrieve` of `object_id`), or, without an answer, with the fact as the
    rule settles it. An order named (by metadata, or Stripe) and not stored yet is waited
    for, by its number too."""
    try:
        if await tx.transaction(functools.partial(record, fact)) is not Change.CONFLICT:
            return
        current = await ask_stripe(ctx, what, retrieve, object_id)
        if current is None:
            log.warning("%s: %s conflicts with what its order knew and Stripe gave no "
                        "answer; the rule decides", what, fact)
            await tx.transaction(functools.partial(record, fact, by_rule=True))
            return
        answer = type(fact).of(current, ctx.clock())
        log.warning("%s: %s conflicts with what its order knew; Stripe has %s", what, fact,
                    answer)
        await tx.transaction(functools.partial(record, answer, asked=True))
    except OrderNotFound:
        assert search.found is not None
        search.ids["order"] = search.found[1]
        _wait(tx, what, search)


def record_dispute(ctx: EngineContext, tx: Transaction, found: Found, note: str,
                   fact: DisputeFact, asked: bool = False, by_rule: bool = False) -> Change:
    """In a transaction: the dispute fact kept on its order (when newer), a note line, the
    order's status settled, the CRTC commission forfeited, the administrator told.
    Returns the Change; on a CONFLICT nothing is written."""
    order = _lock_order(tx, found)
    change = payment_state.merge_dispute(order, fact, asked=asked, by_rule=by_rule)
    if change is Change.CONFLICT:
        return change
    if fact.payment_intent and not order.stripe_payment_intent_id and order.kind != "compliance":
        # Found through Stripe before its payment's own events: later ones find it here.
        order.stripe_payment_intent_id = fact.payment_intent
        linked(ctx, tx, payment_intent=fact.payment_intent)
    if asked:
        note = "Dispute as Stripe has it"
    shown = note if fact.status in payment_state.OPEN_DISPUTE else f"{note} ({fact.status})"
    order.append_note(f"{shown}: {fact.reason}, amount {fact.amount} ({_stamp(fact.as_of)})")
    settle_status(ctx, tx, order)
    commission = None
    if isinstance(order, CrtcOrder):
        commission = holdback.forfeit(ctx, tx, order,
                                      f"dispute {fact.dispute_id}: {fact.reason}")
    _tell_dispute_opened(ctx, tx, order, fact, commission)
    if fact.closed:
        _tell_dispute_closed(ctx, tx, order, fact, commission)
    return change


def _tell_dispute_opened(ctx: EngineContext, tx: Transaction, order: OrderBase,
                         fact: DisputeFact, commission: str | None) -> None:
    email_admin(ctx, tx, f"Dispute opened on order {order.order_number}", "dispute_created",
                order.order_number, key=f"email-dispute-opened-{fact.dispute_id}",
                reason=fact.reason, amount=str(fact.amount), status=fact.status,
                payment_intent=fact.payment_intent, dispute=fact.dispute_id,
                customer_name=order.customer_name, customer_email=order.customer_email,
                service_name=order.service_name, commission=commission)


def _tell_dispute_closed(ctx: EngineContext, tx: Transaction, order: OrderBase,
                         fact: DisputeFact, commission: str | None) -> None:
    outcome = OUTCOMES.get(fact.status, fact.status)
    email_admin(ctx, tx, f"Dispute {outcome} on order {order.order_number}",
                "dispute_closed", order.order_number,
                key=f"email-dispute-{fact.dispute_id}-{fact.status}", outcome=outcome,
                lost=fact.lost, amount=str(fact.amount), dispute=fact.dispute_id,
                reason=fact.reason, payment_intent=fact.payment_intent,
                payment_status=order.payment_status, commission=commission,
                subscription=_renewing_subscription(order) if fact.lost else None,
                **settled_before(ctx, order))


def settled_before(ctx: EngineContext, order: OrderBase) -> dict[str, Any]:
    """For a mail of money taken back: whether the settlement had advanced the order
    already (a CRTC order's funds marked available, its workflow action asked of Frappe),
    when, and the action; the mail then says what the operator must undo in Frappe
    instead of that the order "will not be settled or advanced"."""
    if not (isinstance(order, CrtcOrder) and order.funds_available):
        return {"settled_at": None, "funds_action": None}
    return {"settled_at": order.funds_available_at and order.funds_available_at.isoformat(
        timespec="seconds"), "funds_action": ctx.settings.crtc_funds_action}


def _renewing_subscription(order: OrderBase) -> str | None:
    """The subscription of a compliance order that still renews, or None."""
    if (isinstance(order, ComplianceOrder) and order.stripe_subscription_id
            and order.subscription_status != "cancelled"):
        return order.stripe_subscription_id
    return None


# --- refunds ----------------------------------------------------------------------------

async def refund_event(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    """charge.refunded: the charge's amount refunded so far, as of the event's `created`,
    is a fact about the order's payment; one whose order is not known yet waits for it."""
    charge = object_of(event)
    fact = RefundFact.of(charge, payment_state.as_of(event.get("created"), ctx.clock()))
    search = await order_of_charge(ctx, tx, charge)
    what = f"charge {fact.charge_id} refunded {fact.refunded} of {fact.charged}"
    if search.found is None:
        _wait(tx, what, search)
        return
    await _keep(ctx, tx, functools.partial(record_refund, ctx, tx, search.found), fact,
                f"charge {fact.charge_id}", search, lambda v1: v1.charges.retrieve,
                fact.charge_id)


def record_refund(ctx: EngineContext, tx: Transaction, found: Found, fact: RefundFact,
                  asked: bool = False, by_rule: bool = False) -> Change:
    """In a transaction: the refund fact kept on its order (when newer), a note line, the
    order's status settled, a CRTC commission forfeited by a refund in full, the
    administrator told. Returns the Change; on a CONFLICT nothing is written."""
    order = _lock_order(tx, found)
    change = payment_state.merge_refund(order, fact, asked=asked, by_rule=by_rule)
    if change is Change.CONFLICT:
        return change
    how = "in full" if fact.complete else "in part"
    order.append_note(f"Refunded {how}: {fact.refunded} of {fact.charged}, charge "
                      f"{fact.charge_id} ({_stamp(fact.as_of)})")
    if change is Change.NEWER:
        # The charge now names this order: a dispute of it waiting finds it here.
        linked(ctx, tx, charge=fact.charge_id)
    settle_status(ctx, tx, order)
    commission = None
    if fact.complete and isinstance(order, CrtcOrder):
        commission = holdback.forfeit(ctx, tx, order,
                                      f"charge {fact.charge_id} refunded in full")
    email_admin(ctx, tx, f"Refund {how} on order {order.order_number}: {fact.refunded}",
                "refunded", order.order_number,
                key=f"email-refund-{fact.charge_id}-{fact.refunded.minor}",
                refunded=str(fact.refunded), charged=str(fact.charged), complete=fact.complete,
                charge=fact.charge_id, payment_status=order.payment_status,
                commission=commission, customer_name=order.customer_name,
                customer_email=order.customer_email, **settled_before(ctx, order))
    return change

