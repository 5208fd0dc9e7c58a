"""domain.payment_state, the rule alone (no database): every one of the 720 orderings of
one payment's facts gives the same order (tests/test_payment_orderings.py sends orderings
of the same events end to end), an older fact never undoes a newer one, and facts that
cannot both be true are a conflict."""
import datetime
import itertools

import pytest

from models import UTC, CrtcOrder
from domain import payment_state
from domain.money import Money
from domain.payment_state import Change, DisputeFact, RefundFact
from tests.test_payment_facts import CLOSED, DECLINED, DISPUTED
from tests.test_payment_orderings import AMOUNT, EVENTS, HANDLED_AT, SCENARIOS


def at(unix):
    return datetime.datetime.fromtimestamp(unix, UTC)


def facts(scenario):
    """The facts each event tells, as domain.payment_state takes them."""
    outcome, refunded, refunded_at, _ = SCENARIOS[scenario]
    dollars = Money(AMOUNT, "USD")
    refund = RefundFact("ch_1", Money(refunded, "USD"), dollars, refunded == AMOUNT,
                        at(refunded_at))
    return {
        "checkout": ("received", dollars), "succeeded": ("received", dollars),
        "failed": ("failure", at(DECLINED)),
        "disputed": ("dispute", DisputeFact("dp_1", "needs_response", dollars, at(DISPUTED))),
        "closed": ("dispute", DisputeFact("dp_1", outcome, dollars, at(CLOSED))),
        "refunded": ("refund", refund),
    }


def told(order, fact):
    kind, value = fact
    if kind == "received":
        payment_state.merge_received(order, value)
    elif kind == "failure":
        payment_state.merge_failure(order, value)
    elif kind == "dispute":
        assert payment_state.merge_dispute(order, value) is not payment_state.Change.CONFLICT
    elif kind == "refund":
        assert payment_state.merge_refund(order, value) is not payment_state.Change.CONFLICT
    order.payment_status = payment_state.status_of(order)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_ordering_of_the_facts_gives_the_same_order(scenario):
    expected_status, expected_refund, _ = SCENARIOS[scenario][3]
    outcomes = set()
    for ordering in itertools.permutations(EVENTS):
        order = CrtcOrder(order_number="CA-1", payment_status="pending_payment",
                          created_at=HANDLED_AT, updated_at=HANDLED_AT)
        for name in ordering:
            told(order, facts(scenario)[name])
        outcomes.add((order.payment_status, order.refunded_amount, order.dispute_status,
                      order.payment_amount, order.payment_failed_at))
    assert outcomes == {(expected_status, expected_refund, SCENARIOS[scenario][0], AMOUNT,
                         at(DECLINED))}


def test_a_failure_before_anything_else_is_kept_until_the_payment():
    order = CrtcOrder(order_number="CA-1", payment_status="pending_payment")
    told(order, ("failure", at(DECLINED)))
    assert order.payment_status == "failed"
    told(order, ("received", Money(AMOUNT, "USD")))
    assert order.payment_status == "paid"


def dispute(status, when, dispute_id="dp_1"):
    return DisputeFact(dispute_id, status, Money(AMOUNT, "USD"), at(when))


def refund(amount, when, charge_id="ch_1"):
    return RefundFact(charge_id, Money(amount, "USD"), Money(AMOUNT, "USD"), amount == AMOUNT,
                      at(when))


def fresh(**columns):
    return CrtcOrder(order_number="CA-1", **{"payment_status": "paid", **columns})


def test_an_order_paid_before_facts_were_kept_is_received_and_keeps_its_dispute():
    """A stored status is the only fact an order written before (or by another system)
    has: `disputed` there is a dispute of unknown id, which the first event of a real
    dispute replaces."""
    order = fresh(payment_status="disputed", updated_at=HANDLED_AT)
    assert payment_state.merge_dispute(order, dispute("won", CLOSED)) is Change.NEWER
    assert (payment_state.status_of(order), order.dispute_id, order.payment_received) == (
        "paid", "dp_1", True)


@pytest.mark.parametrize("first,second", [("won", "lost"), ("lost", "won")])
def test_one_dispute_closed_two_ways_is_a_conflict_either_way_round(first, second):
    order = fresh()
    payment_state.merge_dispute(order, dispute(first, CLOSED))
    assert payment_state.merge_dispute(order, dispute(second, CLOSED + 60)) is Change.CONFLICT
    assert payment_state.merge_dispute(order, dispute(second, CLOSED + 60),
                                       by_rule=True) is (
        Change.NEWER if second == "lost" else Change.OLDER)
    assert order.dispute_status == "lost", "without Stripe's answer a loss stands"


def test_an_open_status_told_before_the_dispute_closed_is_older():
    order = fresh()
    payment_state.merge_dispute(order, dispute("won", CLOSED))
    assert payment_state.merge_dispute(order, dispute("under_review", CLOSED - 60)) \
        is Change.OLDER
    assert payment_state.status_of(order) == "paid"


def test_an_open_status_told_after_the_dispute_closed_is_a_conflict_for_stripe():
    """An inquiry closed and then escalated, or a stale update: Stripe's dispute as it is
    now decides; without an answer the closed status stands."""
    order = fresh()
    payment_state.merge_dispute(order, dispute("won", CLOSED))
    assert payment_state.merge_dispute(order, dispute("under_review", CLOSED + 60)) \
        is Change.CONFLICT
    assert payment_state.merge_dispute(order, dispute("under_review", CLOSED + 60),
                                       by_rule=True) is Change.OLDER
    assert payment_state.status_of(order) == "paid"
    assert payment_state.merge_dispute(order, dispute("needs_response", CLOSED + 120),
                                       asked=True) is Change.NEWER
    assert payment_state.status_of(order) == "disputed"


def test_a_lost_dispute_stands_beside_a_later_dispute_of_the_same_order():
    order = fresh()
    payment_state.merge_dispute(order, dispute("lost", CLOSED))
    assert payment_state.merge_dispute(order, dispute("needs_response", CLOSED + 60, "dp_2")) \
        is Change.OLDER
    assert payment_state.status_of(order) == "dispute_lost"


@pytest.mark.parametrize("first,second", [((30000, 100), (20000, 200)),
                                          ((20000, 200), (30000, 100))],
                         ids=["smaller-after", "larger-before"])
def test_a_refunded_amount_that_shrinks_with_time_is_a_conflict_either_way_round(first,
                                                                                   second):
    order = fresh()
    payment_state.merge_refund(order, refund(first[0], REFUND_BASE + first[1]))
    assert payment_state.merge_refund(order, refund(second[0], REFUND_BASE + second[1])) \
        is Change.CONFLICT
    payment_state.merge_refund(order, refund(second[0], REFUND_BASE + second[1]),
                               by_rule=True)
    assert order.refunded_amount == 30000, "without Stripe's answer the larger refund stands"


def test_stripes_answer_is_kept_over_any_fact():
    order = fresh()
    payment_state.merge_refund(order, refund(30000, REFUND_BASE))
    assert payment_state.merge_refund(order, refund(20000, REFUND_BASE - 60), asked=True) \
        is Change.NEWER
    assert order.refunded_amount == 20000


REFUND_BASE = CLOSED + 86400
