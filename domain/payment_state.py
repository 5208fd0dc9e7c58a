"""An order's payment status, worked out of facts (BEHAVIOUR.md 3.3), never the status the
last event to arrive set: Stripe promises no order for its events.

Each event tells a fact about the payment, kept on the order (models.OrderBase):

- received: the payment was completed (a paid checkout, a succeeded intent, a paid
  invoice, a crypto invoice). Nothing undoes it: a failure can only be of an earlier or
  another attempt, as a PaymentIntent that succeeded cannot fail after.
- failed: an attempt failed; it counts only while nothing was received.
- the dispute: its id, status and amount, as of when Stripe said so (the order keeps
  one: a second dispute of its payment replaces the first unless that one was lost).
- the refund: the charge refunded, the amount refunded so far, whether in full, as of
  when Stripe said so.

`status_of` gives the status for any set of facts, and each `merge_*` keeps a fact only
when it is newer than the one kept (an older fact never undoes a newer one), so the same
facts told in any order give the same status, amounts and settlement decision. Two facts
that cannot both be true (one dispute closed as won and as lost, or told open after it
closed; a charge's refunded amount going down) are a CONFLICT, whatever event types
told them: the caller asks Stripe for the object as it is now (domain.payment_events)
and merges that; when Stripe cannot be asked, the fact the rule prefers (`by_rule`) is
kept: a loss, a closed dispute, or the larger amount refunded.

These functions only read and set an order's columns; the caller holds the order locked
and saves it.
"""
import dataclasses
import datetime
import enum
from typing import Any

from models import UTC, OrderBase
from domain.money import Money

PENDING = "pending_payment"
PAID = "paid"
FAILED = "failed"
DISPUTED = "disputed"
DISPUTE_LOST = "dispute_lost"
REFUNDED = "refunded"
STATUSES = (PENDING, PAID, FAILED, DISPUTED, DISPUTE_LOST, REFUNDED)
# Statuses a stored order had only once its payment was received.
RECEIVED_STATUSES = (PAID, DISPUTED, DISPUTE_LOST, REFUNDED)

# Stripe's dispute statuses. An inquiry (warning_*) or a chargeback still open holds the
# order; a dispute closed with the money kept (won, an inquiry closed, one prevented)
# gives it back; a lost one does not. A status Stripe adds later counts as open.
OPEN_DISPUTE = frozenset({"warning_needs_response", "warning_under_review",
                          "needs_response", "under_review"})
KEPT = frozenset({"won", "warning_closed", "prevented"})
LOST = "lost"
CLOSED = KEPT | {LOST}


class Change(enum.Enum):
    """What merging a fact did."""
    NEWER = "newer"          # kept: it is newer than what the order knew
    OLDER = "older"          # not kept: the order knows a newer fact
    SAME = "same"            # the order knew it already
    CONFLICT = "conflict"    # it contradicts the fact kept: ask Stripe


def as_of(unix_time: int | float | None, otherwise: datetime.datetime) -> datetime.datetime:
    """An event's `created` (Unix seconds) as an aware UTC time; `otherwise` without one."""
    if not isinstance(unix_time, (int, float)) or isinstance(unix_time, bool):
        return otherwise
    return datetime.datetime.fromtimestamp(unix_time, UTC)


@dataclasses.dataclass(frozen=True)
class DisputeFact:
    """A dispute as an event (or Stripe, asked) showed it at `as_of`; its reason and
    payment intent, for the note and the administrator."""

    dispute_id: str
    status: str
    amount: Money
    as_of: datetime.datetime
    reason: str = "unknown"
    payment_intent: str = ""

    @classmethod
    def of(cls, dispute: dict[str, Any], when: datetime.datetime) -> "DisputeFact":
        intent = dispute.get("payment_intent")
        return cls(dispute["id"], str(dispute.get("status") or "needs_response"),
                   Money.of_stripe(dispute.get("amount"), dispute.get("currency")), when,
                   str(dispute.get("reason") or "unknown"),
                   intent if isinstance(intent, str) else "")

    @property
    def closed(self) -> bool:
        return self.status in CLOSED

    @property
    def lost(self) -> bool:
        return self.status == LOST

    def rank(self) -> tuple[bool, datetime.datetime, bool]:
        """Of two facts about the order's disputes, the one with the higher rank is kept:
        a lost dispute whatever came after (the money is gone), else the newer fact, a
        closed one before an open one told in the same second."""
        return (self.lost, self.as_of, self.closed)


@dataclasses.dataclass(frozen=True)
class RefundFact:
    """A charge's refunds as an event (or Stripe, asked) showed them at `as_of`:
    `refunded` so far of the `charged` amount; `complete` when Stripe says the charge is
    refunded in full."""

    charge_id: str
    refunded: Money
    charged: Money
    complete: bool
    as_of: datetime.datetime

    @classmethod
    def of(cls, charge: dict[str, Any], when: datetime.datetime) -> "RefundFact":
        currency = charge.get("currency")
        return cls(charge["id"], Money.of_stripe(charge.get("amount_refunded"), currency),
                   Money.of_stripe(charge.get("amount"), currency),
                   charge.get("refunded") is True, when)

    def rank(self) -> tuple[datetime.datetime, int]:
        return (self.as_of, self.refunded.minor)


def known(order: OrderBase) -> None:
    """Turn what the stored status alone says into facts, once (before the first fact is
    kept): an order paid, disputed or refunded before facts were kept, or so written by
    another system, was received; one stored failed had an attempt fail."""
    if order.payment_received is not None:
        return
    status = order.payment_status
    order.payment_received = order.paid_at is not None or status in RECEIVED_STATUSES
    if status == FAILED and order.payment_failed_at is None:
        order.payment_failed_at = order.updated_at or order.created_at
    if status in (DISPUTED, DISPUTE_LOST) and order.dispute_status is None:
        # A dispute of unknown id: the next event about the order's dispute replaces it.
        order.dispute_status = LOST if status == DISPUTE_LOST else "needs_response"
        order.dispute_as_of = order.updated_at or order.created_at
    if status == REFUNDED and not order.refund_complete:
        order.refund_complete = True
        order.refunded_as_of = order.updated_at or order.created_at


def received(order: OrderBase) -> bool:
    """Whether the order's payment was received: a fact, or its stored status before
    facts were kept."""
    if order.payment_received is None:
        return order.paid_at is not None or order.payment_status in RECEIVED_STATUSES
    return bool(order.payment_received)


def status_of(order: OrderBase) -> str:
    """The payment status the order's facts give (BEHAVIOUR.md 3.3's table)."""
    if order.payment_received is None:
        return order.payment_status  # no fact kept yet: the stored status is all we know
    dispute = order.dispute_status
    if dispute == LOST:
        return DISPUTE_LOST
    if dispute is not None and dispute not in KEPT:
        return DISPUTED
    if order.refund_complete:
        return REFUNDED
    if order.payment_received:
        return PAID
    if order.payment_failed_at is not None:
        return FAILED
    return PENDING


def merge_received(order: OrderBase, amount: Money | None) -> Change:
    """The payment was received. SAME when it was known already."""
    known(order)
    if order.payment_received:
        return Change.SAME
    order.payment_received = True
    if amount is not None and amount.currency:
        order.payment_amount, order.payment_currency = amount.minor, amount.currency
    return Change.NEWER


def merge_failure(order: OrderBase, failed_at: datetime.datetime) -> Change:
    """An attempt failed at `failed_at`; the latest failure is kept."""
    known(order)
    if order.payment_failed_at is not None and order.payment_failed_at >= failed_at:
        return Change.SAME if order.payment_failed_at == failed_at else Change.OLDER
    order.payment_failed_at = failed_at
    return Change.NEWER


def _kept_dispute(order: OrderBase) -> DisputeFact | None:
    if order.dispute_status is None:
        return None
    return DisputeFact(order.dispute_id or "", order.dispute_status,
                       Money.of(order.dispute_amount, order.payment_currency),
                       order.dispute_as_of or datetime.datetime.min.replace(tzinfo=UTC))


def merge_dispute(order: OrderBase, fact: DisputeFact, asked: bool = False,
                  by_rule: bool = False) -> Change:
    """A fact about a dispute of the order's payment. Of one dispute a closed status is
    final: an open one told before it is older than it; one told after it, or two
    different closed statuses, are a CONFLICT. `asked`: the fact is Stripe's answer, the
    dispute as it is now, and is kept. `by_rule`: a conflict is settled for the closed
    status, or by `DisputeFact.rank` (a loss stands), as facts of different disputes
    always are."""
    known(order)
    kept = _kept_dispute(order)
    # A dispute known only from a stored status (`known`) is whichever the events name.
    if kept is not None and kept.dispute_id in ("", fact.dispute_id):
        if kept.status == fact.status:
            return Change.SAME if kept.dispute_id else _keep_dispute(order, fact)
        if asked:
            return _keep_dispute(order, fact)
        if kept.closed and fact.closed and not by_rule:
            return Change.CONFLICT
        if kept.closed != fact.closed:
            if fact.closed:
                return _keep_dispute(order, fact)
            # Open again after it closed, as Stripe told it later (an inquiry turned into
            # a chargeback, or a stale copy): Stripe's dispute as it is now decides.
            if fact.as_of > kept.as_of and kept.dispute_id and not by_rule:
                return Change.CONFLICT
            return Change.OLDER
    if kept is not None and kept.rank() >= fact.rank():
        return Change.OLDER
    return _keep_dispute(order, fact)


def _keep_dispute(order: OrderBase, fact: DisputeFact) -> Change:
    order.dispute_id, order.dispute_status = fact.dispute_id, fact.status
    order.dispute_amount, order.dispute_as_of = fact.amount.minor, fact.as_of
    _currency_of(order, fact.amount)
    return Change.NEWER


def merge_refund(order: OrderBase, fact: RefundFact, asked: bool = False,
                 by_rule: bool = False) -> Change:
    """A fact about the refunds of a charge of the order's payment. Of one charge the
    amount refunded only grows: of two facts the one refunding more is kept, and one
    that is newer but refunds less (a refund that failed, or a stale copy) is a
    CONFLICT either way round. `asked`: Stripe's answer, kept. `by_rule`: a conflict
    is settled for the larger amount. Of different charges the newer fact is kept."""
    known(order)
    if order.refunded_charge is not None and order.refunded_as_of is not None:
        kept_amount, kept_as_of = order.refunded_amount or 0, order.refunded_as_of
        kept = (kept_amount, kept_as_of, bool(order.refund_complete))
        told = (fact.refunded.minor, fact.as_of, fact.complete)
        if order.refunded_charge == fact.charge_id:
            if kept == told:
                return Change.SAME
            if asked:
                return _keep_refund(order, fact)
            disagree = (fact.as_of != kept_as_of and fact.refunded.minor != kept_amount
                        and (fact.as_of > kept_as_of) != (fact.refunded.minor > kept_amount))
            if disagree and not by_rule:
                return Change.CONFLICT
            return Change.OLDER if kept >= told else _keep_refund(order, fact)
        if (kept_as_of, kept_amount) >= fact.rank():
            return Change.OLDER
    return _keep_refund(order, fact)


def _keep_refund(order: OrderBase, fact: RefundFact) -> Change:
    order.refunded_charge, order.refunded_amount = fact.charge_id, fact.refunded.minor
    order.refund_complete, order.refunded_as_of = fact.complete, fact.as_of
    _currency_of(order, fact.refunded)
    return Change.NEWER


def _currency_of(order: OrderBase, amount: Money) -> None:
    """The payment's currency, when no completed payment has said it yet."""
    if amount.currency and not order.payment_currency:
        order.payment_currency = amount.currency
