"""Every ordering of one payment's events gives the same order: its payment status, the
amounts it keeps, the settlement decision and the administrator's notices of money taken
back (BEHAVIOUR.md 3.3). Stripe promises no order: a checkout completed, an earlier
attempt's payment_failed, the intent succeeded, a dispute created and closed, a refund.

The orderings hypothesis draws are sent end to end through the signed webhook, the order
settled (or not) against a Frappe stand-in afterwards; every one of the 720 orderings of
the same facts goes through the rule itself in tests/test_payment_state.py."""
import datetime
import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from models import UTC, CrtcOrder
from domain.settlement import settle_crtc_orders
from engine import inbox
from engine.transaction import Transaction
from tests import stripe_events as se
from tests.stripe_api import stripe_api  # noqa: F401 (fixture)
from tests.stripe_events import send, settings  # noqa: F401 (fixtures)
from tests.test_payment_facts import CLOSED, DECLINED, DISPUTED, PAID, REFUNDED, SETTLING_DAY

AMOUNT = 49900
# Each scenario: how the dispute closed, the refund (amount, when), and what every
# ordering must come to: (payment_status, refunded_amount, settled).
SCENARIOS = {
    "won, then refunded in part": ("won", 10000, REFUNDED, ("paid", 10000, True)),
    "refunded in part, then lost": ("lost", 10000, PAID + 3600,
                                    ("dispute_lost", 10000, False)),
    "won, then refunded in full": ("won", AMOUNT, REFUNDED, ("refunded", AMOUNT, False)),
}
EVENTS = ("checkout", "failed", "succeeded", "disputed", "closed", "refunded")
HANDLED_AT = datetime.datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


# --- end to end -------------------------------------------------------------------------

_example = itertools.count(1)


def stripe_events(scenario, n):
    """The six events of payment `n`, as Stripe sends them: (type, object, created)."""
    outcome, refunded, refunded_at, _ = SCENARIOS[scenario]
    number, intent = f"CA-P{n}", f"pi_test_p{n}"
    declined = se.payment_intent(number, "canada_crtc", intent_id=intent,
                                 status="requires_payment_method",
                                 last_payment_error=se.card_declined())
    dispute_id, charge_id = f"dp_test_p{n}", f"ch_test_p{n}"
    return number, intent, {
        "checkout": ("checkout.session.completed", se.checkout_session(
            number, "canada_crtc", payment_intent=intent, session_id=f"cs_test_p{n}"), PAID),
        "failed": ("payment_intent.payment_failed", declined, DECLINED),
        "succeeded": ("payment_intent.succeeded", se.payment_intent(
            number, "canada_crtc", intent_id=intent, checkout_session_id=f"cs_test_p{n}"),
            PAID),
        "disputed": ("charge.dispute.created", se.dispute(
            intent, amount=AMOUNT, dispute_id=dispute_id, charge_id=charge_id), DISPUTED),
        "closed": ("charge.dispute.closed", se.dispute(
            intent, amount=AMOUNT, dispute_id=dispute_id, charge_id=charge_id,
            status=outcome), CLOSED),
        "refunded": ("charge.refunded", se.charge(
            intent, amount_refunded=refunded, charge_id=charge_id), refunded_at),
    }


@hypothesis_settings(max_examples=100, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=st.sampled_from(sorted(SCENARIOS)), ordering=st.permutations(EVENTS))
def test_every_ordering_sent_to_the_webhook_gives_the_same_order_and_settlement(
        io_loop, send, ctx, clock, smtp, frappe, stripe_api, scenario, ordering):
    n = next(_example)

    async def run():
        number, intent, events = stripe_events(scenario, n)
        # A dispute or refund told first is found through Stripe: the intent's metadata.
        stripe_api.charged(events["succeeded"][1], "card")
        clock.fixed = HANDLED_AT
        CrtcOrder.create(order_number=number)
        for name in ordering:
            event_type, obj, created = events[name]
            await send(event_type, obj, created=created)
        clock.fixed = HANDLED_AT + datetime.timedelta(hours=1)
        assert await inbox.retry_due(ctx) == 0, "nothing left failed"
        clock.fixed = SETTLING_DAY
        await settle_crtc_orders(ctx, Transaction(ctx))
        order = CrtcOrder.get(CrtcOrder.order_number == number)
        settled = number in [json.loads(r.json["doc"])["name"] for r in frappe.requests
                             if r.method == "POST"]
        told_admin = sorted(message["Subject"].replace(number, "#")
                            for _, message in smtp.messages
                            if number in message["Subject"]
                            and not message["Subject"].startswith("Payment failed"))
        # getattr: the same test, run on code without the column, fails on the status.
        return ((order.payment_status, getattr(order, "refunded_amount", None), settled),
                told_admin, order)

    outcome, told_admin, order = io_loop.run_sync(run)
    assert outcome == SCENARIOS[scenario][3], ordering
    # Paid when Stripe says, whichever of the payment's events came first.
    assert (order.paid_at, order.payment_amount, order.dispute_id) == (
        datetime.datetime.fromtimestamp(PAID, UTC), AMOUNT, f"dp_test_p{n}")
    assert order.stripe_session_id == f"cs_test_p{n}"
    refund = SCENARIOS[scenario][1]
    closed_subject = {"won": "Dispute won on order #", "lost": "Dispute lost on order #"}
    assert told_admin == sorted([
        "Dispute opened on order #", closed_subject[SCENARIOS[scenario][0]],
        f"Refund {'in full' if refund == AMOUNT else 'in part'} on order #: "
        f"${refund / 100:.2f}"]), ordering
