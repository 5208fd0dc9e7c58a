"""BEHAVIOUR.md 3.3: an order's payment status is a state machine on facts, whatever order
Stripe delivers its events in; refunds and dispute outcomes are part of it; a refunded,
disputed or lost order is never settled, never has its commission released, and the
administrator is told once, with the amount and currency. End to end through the signed
webhook, events shaped as Stripe sends them in the API versions the suite covers, Stripe's
API a loopback stand-in (tests/stripe_api.py), mail read back from a real SMTP server."""
import dataclasses
import datetime
import json

import pytest

from models import UTC, ComplianceOrder, CrtcOrder, FormationOrder, SubscriptionCycle, WebhookEvent
from domain import card_events, holdback
from domain.settlement import settle_crtc_orders
from engine import inbox
from engine.transaction import Transaction
from tests import stripe_events as se
from tests.stripe_api import stripe_api  # noqa: F401 (fixture)
from tests.stripe_events import RECEIVED, deliver, send, settings  # noqa: F401 (fixtures)

# When each fact was true at Stripe (its event's `created`): a first card declined, the
# payment, a dispute a week later, its end a month later, a refund after that.
DECLINED, PAID, DISPUTED, CLOSED, REFUNDED = (1795683540, 1795683600, 1796288400,
                                              1798276800, 1798880000)
# A Friday after all of them, and the Tuesday after: a card payment has settled by then.
SETTLING_DAY = datetime.datetime(2027, 1, 5, 9, 0, tzinfo=UTC)
VERSIONS = ["2023-10-16", "2024-06-20", "2025-03-31.basil", "2026-03-25.dahlia"]


def parts(message):
    return (message.get_body(("plain",)).get_content(),
            message.get_body(("html",)).get_content())


def subjects(smtp):
    return [message["Subject"] for _, message in smtp.messages]


def confirmed(frappe):
    return [json.loads(r.json["doc"])["name"] for r in frappe.requests if r.method == "POST"]


async def pay_by_checkout(send, number, kind="canada_crtc", intent="pi_test_1",
                          amount=49900, currency="usd"):
    session = {**se.checkout_session(number, kind, payment_intent=intent, amount_total=amount),
               "currency": currency}
    await send("checkout.session.completed", session, created=PAID)
    return session


async def settle(ctx, clock):
    clock.fixed = SETTLING_DAY
    return await settle_crtc_orders(ctx, Transaction(ctx))


# --- 1. a declined first card told after the payment ---------------------------------------

@pytest.mark.parametrize("api_version", VERSIONS)
@pytest.mark.gen_test
async def test_a_declined_first_attempt_told_after_the_payment_leaves_the_order_paid(
        send, ctx, clock, smtp, telegram, frappe, api_version):
    """The same PaymentIntent: the first card declined, the second paid; the failure's
    event delivered last (as the real CLI did). The order stays paid, nobody is told of
    a failure, and it settles."""
    CrtcOrder.create(order_number="CA-1")
    await pay_by_checkout(send, "CA-1")
    await send("payment_intent.succeeded", se.payment_intent(
        "CA-1", "canada_crtc", intent_id="pi_test_1"), api_version=api_version, created=PAID)
    declined = se.payment_intent("CA-1", "canada_crtc", intent_id="pi_test_1",
                                 status="requires_payment_method",
                                 last_payment_error=se.card_declined())
    stored = await send("payment_intent.payment_failed", declined, api_version=api_version,
                        created=DECLINED)
    assert stored.status == "processed"
    order = CrtcOrder.get()
    assert order.payment_status == "paid"
    assert order.payment_failed_at == datetime.datetime.fromtimestamp(DECLINED, UTC)
    assert smtp.messages == []
    [alert] = telegram.requests
    assert "Amount: $499.00" in alert.json["text"].splitlines()
    assert (await settle(ctx, clock))["settled"] == 1 and confirmed(frappe) == ["CA-1"]


@pytest.mark.gen_test
async def test_a_failure_before_the_payment_fails_the_order_until_the_payment_comes(
        send, smtp):
    FormationOrder.create(order_number="FO-1")
    await send("payment_intent.payment_failed", se.payment_intent(
        "FO-1", "formation", intent_id="pi_test_1", status="requires_payment_method",
        last_payment_error=se.card_declined()), created=DECLINED)
    assert FormationOrder.get().payment_status == "failed"
    [(_, message)] = smtp.messages
    assert "$499.00" in parts(message)[0]
    await pay_by_checkout(send, "FO-1", kind="formation")
    order = FormationOrder.get()
    assert (order.payment_status, order.payment_received) == ("paid", True)


# --- 2. a late success does not undo a dispute -----------------------------------------------

@pytest.mark.gen_test
async def test_a_late_success_of_a_disputed_payment_leaves_it_disputed_and_unsettled(
        send, ctx, clock, frappe, telegram):
    clock.fixed = datetime.datetime(2026, 11, 26, 9, 0, tzinfo=UTC)
    CrtcOrder.create(order_number="CA-2")
    await pay_by_checkout(send, "CA-2")
    paid_at = CrtcOrder.get().paid_at
    await send("charge.dispute.created", se.dispute("pi_test_1", amount=49900),
               created=DISPUTED)
    clock.fixed = datetime.datetime(2026, 12, 10, 9, 0, tzinfo=UTC)
    # Stripe's retry (or a backfill) of the payment's own event, long after.
    await send("payment_intent.succeeded", se.payment_intent(
        "CA-2", "canada_crtc", intent_id="pi_test_1"), created=PAID)
    order = CrtcOrder.get()
    assert (order.payment_status, order.paid_at) == ("disputed", paid_at)
    assert (await settle(ctx, clock))["examined"] == 0 and confirmed(frappe) == []
    assert len(telegram.requests) == 1


# --- 3. refunds and dispute outcomes ---------------------------------------------------------

@pytest.mark.parametrize("api_version", VERSIONS)
@pytest.mark.gen_test
async def test_a_crtc_order_refunded_in_full_is_not_settled_and_its_admin_told_once(
        send, post, ctx, clock, smtp, frappe, worker, api_version):
    CrtcOrder.create(order_number="CA-3", delivered_at=SETTLING_DAY,
                     holdback_ends_at=SETTLING_DAY)
    await pay_by_checkout(send, "CA-3", amount=123456, currency="cad")
    build = se.charge if api_version.endswith(("basil", "dahlia")) else se.charge_before_basil
    refunded = build("pi_test_1", amount=123456, amount_refunded=123456, currency="cad")
    await send("charge.refunded", refunded, api_version=api_version, created=REFUNDED)
    # The same refund told again (Stripe's retry): nothing more.
    again = se.event("charge.refunded", refunded, api_version=api_version, created=REFUNDED)
    assert (await deliver(post, clock, again))[:2] == RECEIVED
    await ctx.drain_background()

    order = CrtcOrder.get()
    assert (order.payment_status, order.refunded_amount, order.refund_complete) == (
        "refunded", 123456, True)
    assert order.commission_forfeit_reason == f"charge {refunded['id']} refunded in full"
    assert (await settle(ctx, clock))["examined"] == 0 and confirmed(frappe) == []
    assert (await holdback.release_due(ctx)).released == 0 and worker.requests == []
    assert subjects(smtp) == ["Refund in full on order CA-3: CAD 1234.56"]
    text, html = parts(smtp.messages[0][1])
    for body in (text, html):
        assert "CAD 1234.56" in body and "$" not in body and "withheld" in body


@pytest.mark.parametrize("taken_back", ["refunded in full", "dispute lost"])
@pytest.mark.gen_test
async def test_money_taken_back_after_the_settlement_tells_what_to_undo_in_frappe(
        send, ctx, clock, smtp, frappe, taken_back):
    """A CRTC order refunded or lost after the settlement advanced it was told it "will not
    be settled or advanced", while its funds were marked available and Frappe had moved
    it on: the mail says it was settled, when, and what to undo in Frappe."""
    CrtcOrder.create(order_number="CA-6")
    await pay_by_checkout(send, "CA-6")
    assert (await settle(ctx, clock))["settled"] == 1 and len(confirmed(frappe)) == 1
    later = int((SETTLING_DAY + datetime.timedelta(days=3)).timestamp())
    if taken_back == "refunded in full":
        await send("charge.refunded", se.charge("pi_test_1", amount=49900,
                                                amount_refunded=49900), created=later)
    else:
        await send("charge.dispute.closed", se.dispute(
            "pi_test_1", amount=49900, status="lost", dispute_id="dp_test_6"), created=later)
    order = CrtcOrder.get()
    assert order.funds_available
    [mail] = [m for _, m in smtp.messages if "CA-6" in m["Subject"]
              and not m["Subject"].startswith("Dispute opened")]
    for body in parts(mail):
        assert "will not be settled" not in body
        assert f"settled already ({order.funds_available_at.isoformat(timespec='seconds')})" \
            in body.replace("\n", " ")
        assert '"Confirm Funds" was asked of Frappe' in body.replace("\n", " ")


@pytest.mark.gen_test
async def test_a_partial_refund_is_an_amount_kept_on_a_paid_order_that_still_settles(
        send, ctx, clock, smtp, frappe):
    CrtcOrder.create(order_number="CA-4")
    await pay_by_checkout(send, "CA-4")
    await send("charge.refunded", se.charge("pi_test_1", amount_refunded=10000,
                                            charge_id="ch_test_4"), created=REFUNDED)
    await send("charge.refunded", se.charge("pi_test_1", amount_refunded=15000,
                                            charge_id="ch_test_4"), created=REFUNDED + 60)
    order = CrtcOrder.get()
    assert (order.payment_status, order.refunded_amount, order.refund_complete) == (
        "paid", 15000, False)
    assert order.notes.splitlines()[-1].startswith(
        "Refunded in part: $150.00 of $499.00, charge ch_test_4")
    assert subjects(smtp) == ["Refund in part on order CA-4: $100.00",
                              "Refund in part on order CA-4: $150.00"]
    assert (await settle(ctx, clock))["settled"] == 1 and confirmed(frappe) == ["CA-4"]


@pytest.mark.parametrize("outcome,status,settles,subject", [
    ("won", "paid", True, "Dispute won on order CA-5"),
    ("warning_closed", "paid", True, "Dispute closed (inquiry) on order CA-5"),
    ("lost", "dispute_lost", False, "Dispute lost on order CA-5"),
])
@pytest.mark.gen_test
async def test_a_dispute_closes_as_stripe_decided(send, ctx, clock, smtp, frappe, outcome,
                                                  status, settles, subject):
    CrtcOrder.create(order_number="CA-5")
    await pay_by_checkout(send, "CA-5")
    opened = "warning_needs_response" if outcome == "warning_closed" else "needs_response"
    await send("charge.dispute.created", se.dispute(
        "pi_test_1", amount=49900, status=opened, dispute_id="dp_test_5"), created=DISPUTED)
    assert CrtcOrder.get().payment_status == "disputed"
    await send("charge.dispute.closed", se.dispute(
        "pi_test_1", amount=49900, status=outcome, dispute_id="dp_test_5"), created=CLOSED)
    order = CrtcOrder.get()
    assert (order.payment_status, order.dispute_status) == (status, outcome)
    assert subjects(smtp) == ["Dispute opened on order CA-5", subject]
    assert "$499.00" in parts(smtp.messages[1][1])[0]
    assert ((await settle(ctx, clock))["settled"] == 1) is settles
    assert order.commission_forfeited_at is not None, "any dispute forfeits the commission"


@pytest.mark.gen_test
async def test_funds_withdrawn_tell_of_a_dispute_whose_created_event_never_came(
        send, smtp):
    FormationOrder.create(order_number="FO-6", stripe_payment_intent_id="pi_test_6",
                          payment_status="paid")
    await send("charge.dispute.funds_withdrawn", se.dispute(
        "pi_test_6", dispute_id="dp_test_6", withdrawn=True), created=DISPUTED)
    assert FormationOrder.get().payment_status == "disputed"
    await send("charge.dispute.funds_reinstated", se.dispute(
        "pi_test_6", dispute_id="dp_test_6", status="won", withdrawn=True, reinstated=True),
        created=CLOSED)
    order = FormationOrder.get()
    assert (order.payment_status, order.dispute_status) == ("paid", "won")
    assert subjects(smtp) == ["Dispute opened on order FO-6", "Dispute won on order FO-6"]
    assert [line.split(":")[0] for line in order.notes.splitlines()] == [
        "Dispute funds withdrawn", "Dispute funds reinstated (won)"]


@pytest.mark.gen_test
async def test_a_dispute_closed_told_before_it_was_opened_stays_closed(send, smtp):
    FormationOrder.create(order_number="FO-7", stripe_payment_intent_id="pi_test_7",
                          payment_status="paid")
    await send("charge.dispute.closed", se.dispute("pi_test_7", dispute_id="dp_test_7",
                                                   status="won"), created=CLOSED)
    await send("charge.dispute.created", se.dispute("pi_test_7", dispute_id="dp_test_7"),
               created=DISPUTED)
    assert FormationOrder.get().payment_status == "paid"
    assert sorted(subjects(smtp)) == ["Dispute opened on order FO-7",
                                      "Dispute won on order FO-7"]


@pytest.mark.gen_test
async def test_a_dispute_before_the_payment_is_found_through_stripe_and_holds_the_order(
        send, ctx, clock, stripe_api, frappe):
    """The dispute's event came before any of the payment's (a backfill after an outage):
    Stripe, asked, names the order in the intent's metadata."""
    CrtcOrder.create(order_number="CA-8")
    intent = se.payment_intent("CA-8", "canada_crtc", intent_id="pi_test_8")
    stripe_api.charged(intent, "card")
    await send("charge.dispute.created", se.dispute("pi_test_8", dispute_id="dp_test_8"),
               created=DISPUTED)
    assert stripe_api.asked("payment_intents") == ["/v1/payment_intents/pi_test_8"]
    assert CrtcOrder.get().payment_status == "disputed"
    await pay_by_checkout(send, "CA-8", intent="pi_test_8")
    assert CrtcOrder.get().payment_status == "disputed"
    await send("charge.dispute.closed", se.dispute(
        "pi_test_8", dispute_id="dp_test_8", status="won"), created=CLOSED)
    assert CrtcOrder.get().payment_status == "paid"
    assert (await settle(ctx, clock))["settled"] == 1


@pytest.mark.gen_test
async def test_a_dispute_stripe_cannot_be_asked_about_now_is_retried(send, ctx, clock,
                                                                     stripe_api):
    CrtcOrder.create(order_number="CA-9")
    stripe_api.charged(se.payment_intent("CA-9", "canada_crtc", intent_id="pi_test_9"),
                       "card")
    stripe_api.failing = True
    clock.fixed = datetime.datetime(2026, 12, 3, 9, 0, tzinfo=UTC)
    stored = await send("charge.dispute.created", se.dispute("pi_test_9"), created=DISPUTED)
    assert stored.status == "failed" and "APIError" in stored.last_error
    stripe_api.failing = False
    clock.fixed += datetime.timedelta(hours=1)
    assert await inbox.retry_due(ctx) == 1
    assert CrtcOrder.get().payment_status == "disputed"


# --- conflicting facts: Stripe is asked --------------------------------------------------------

@pytest.mark.parametrize("stripe_says,status", [
    ("lost", "dispute_lost"), ("won", "paid"), (None, "dispute_lost"),
], ids=["stripe-says-lost", "stripe-says-won", "stripe-does-not-know-a-loss-stands"])
@pytest.mark.gen_test
async def test_a_dispute_told_both_won_and_lost_is_as_stripe_has_it_now(
        send, smtp, stripe_api, stripe_says, status):
    """Two events of one dispute disagree on how it closed: Stripe is asked for the
    dispute as it is now, and that is kept; when Stripe cannot tell, a loss stands."""
    FormationOrder.create(order_number="FO-10", stripe_payment_intent_id="pi_test_10",
                          payment_status="paid")
    if stripe_says:
        stripe_api.disputes["dp_test_10"] = se.dispute(
            "pi_test_10", dispute_id="dp_test_10", status=stripe_says)
    await send("charge.dispute.closed", se.dispute("pi_test_10", dispute_id="dp_test_10",
                                                   status="won"), created=CLOSED)
    await send("charge.dispute.funds_withdrawn", se.dispute(
        "pi_test_10", dispute_id="dp_test_10", status="lost", withdrawn=True),
        created=CLOSED + 60)
    order = FormationOrder.get()
    assert (order.payment_status, order.dispute_status) == (status, stripe_says or "lost")
    assert stripe_api.asked("disputes") == ["/v1/disputes/dp_test_10"]
    assert "Dispute lost on order FO-10" in subjects(smtp) or stripe_says == "won"


@pytest.mark.gen_test
async def test_without_a_secret_key_stripe_is_not_asked(ctx, stripe_api, caplog):
    ctx.settings = dataclasses.replace(ctx.settings, stripe_secret_key="")
    assert await card_events.ask_stripe(ctx, "dispute dp_1", lambda v1: v1.disputes.retrieve,
                                        "dp_1") is None
    assert stripe_api.requests == [] and "STRIPE_SECRET_KEY is not set" in caplog.text


@pytest.mark.gen_test
async def test_a_refund_told_smaller_after_a_larger_one_is_as_stripe_has_it(
        send, stripe_api):
    FormationOrder.create(order_number="FO-11", stripe_payment_intent_id="pi_test_11",
                          payment_status="paid")
    stripe_api.charges["ch_test_11"] = se.charge("pi_test_11", amount_refunded=20000,
                                                 charge_id="ch_test_11")
    await send("charge.refunded", se.charge("pi_test_11", amount_refunded=30000,
                                            charge_id="ch_test_11"), created=REFUNDED)
    await send("charge.refunded", se.charge("pi_test_11", amount_refunded=20000,
                                            charge_id="ch_test_11"), created=REFUNDED + 60)
    order = FormationOrder.get()
    assert (order.refunded_amount, order.payment_status) == (20000, "paid")
    assert stripe_api.asked("charges") == ["/v1/charges/ch_test_11"]


# --- 4. subscription payments ------------------------------------------------------------------

@pytest.fixture
def subscribed():
    return ComplianceOrder.create(
        order_number="CO-12", service_slug="registered-agent", payment_status="paid",
        stripe_subscription_id="sub_test_12", stripe_session_id="cs_test_first",
        stripe_payment_intent_id="pi_test_first", customer_email="robin@example.test")


@pytest.mark.gen_test
async def test_a_dispute_of_a_renewal_finds_its_order_through_the_invoice_and_subscription(
        send, smtp, stripe_api, subscribed):
    """API 2025-03-31.basil on: neither the dispute nor the intent names the invoice;
    Stripe's invoice payments of the intent do, and the invoice names the subscription."""
    renewal = se.invoice("sub_test_12", invoice_id="in_test_renewal")
    stripe_api.invoice_paid_by(renewal, "pi_test_renewal")
    await send("charge.dispute.created", se.dispute("pi_test_renewal", amount=19900,
                                                    dispute_id="dp_test_12"), created=DISPUTED)
    assert ComplianceOrder.get().payment_status == "disputed"
    assert stripe_api.asked("invoice_payments") == ["/v1/invoice_payments"]
    await send("charge.dispute.closed", se.dispute(
        "pi_test_renewal", amount=19900, dispute_id="dp_test_12", status="lost"),
        created=CLOSED)
    assert ComplianceOrder.get().payment_status == "dispute_lost"
    assert subjects(smtp) == ["Dispute opened on order CO-12", "Dispute lost on order CO-12"]
    for body in parts(smtp.messages[1][1]):
        assert "$199.00" in body and "sub_test_12" in body and "still renews" in body

    # Days before the next renewal: the administrator is told, once.
    upcoming = se.upcoming_invoice("sub_test_12", next_payment_attempt=1800954000)
    await send("invoice.upcoming", upcoming)
    await send("invoice.upcoming", upcoming)  # another notice of the same renewal
    assert subjects(smtp)[2:] == ["Subscription of order CO-12 renews after a lost dispute"]
    text, _ = parts(smtp.messages[2][1])
    assert "$199.00" in text and "2027-01-26T" in text


@pytest.mark.parametrize("api_version", ["2023-10-16", "2024-06-20"])
@pytest.mark.gen_test
async def test_a_refund_of_a_renewal_rendered_before_basil_finds_its_order_by_its_invoice(
        send, stripe_api, subscribed, api_version):
    await send("invoice.paid", se.invoice_before_basil("sub_test_12",
                                                       invoice_id="in_test_cycle"),
               api_version=api_version)
    assert SubscriptionCycle.select().count() == 1
    refunded = se.charge_before_basil("pi_test_cycle", invoice="in_test_cycle", amount=19900,
                                      amount_refunded=19900)
    await send("charge.refunded", refunded, api_version=api_version, created=REFUNDED)
    assert ComplianceOrder.get().payment_status == "refunded"
    assert stripe_api.requests == [], "found by what is stored"


@pytest.mark.gen_test
async def test_an_upcoming_renewal_of_a_subscription_in_good_standing_tells_nobody(
        send, smtp, subscribed):
    await send("invoice.upcoming", se.upcoming_invoice("sub_test_12"))
    assert smtp.messages == []


# --- 5. amounts in every alert and mail about money --------------------------------------------

@pytest.mark.gen_test
async def test_the_paid_alert_and_a_second_payment_say_how_much_in_which_currency(
        send, smtp, telegram):
    FormationOrder.create(order_number="FO-13")
    await pay_by_checkout(send, "FO-13", kind="formation", amount=5000, currency="jpy")
    second = {**se.checkout_session("FO-13", "formation", payment_intent="pi_test_again",
                                    amount_total=5000), "currency": "jpy"}
    await send("checkout.session.completed", second)
    [alert] = telegram.requests
    assert "Amount: JPY 5000" in alert.json["text"].splitlines()
    order = FormationOrder.get()
    assert (order.payment_amount, order.payment_currency) == (5000, "JPY")
    [(_, message)] = smtp.messages
    for body in parts(message):
        assert body.count("JPY 5000") == 2


@pytest.mark.gen_test
async def test_a_dispute_found_late_is_told_with_its_amount(send, smtp, stripe_api):
    """Told once its order is known (tests/test_card_facts.py), in its own currency."""
    await send("charge.dispute.created", {**se.dispute("pi_test_late", amount=1234),
                                          "currency": "kwd"})
    assert smtp.messages == []
    FormationOrder.create(order_number="FO-16")
    await pay_by_checkout(send, "FO-16", kind="formation", intent="pi_test_late")
    [(_, message)] = [m for m in smtp.messages if "Dispute" in m[1]["Subject"]]
    assert message["Subject"] == "Dispute opened on order FO-16"
    assert "KWD 1.234" in parts(message)[0]


# --- what cannot be done now, or at all -------------------------------------------------------

@pytest.mark.gen_test
async def test_a_dispute_of_an_order_stripe_names_but_not_stored_yet_waits_for_it(
        send, stripe_api):
    stripe_api.charged(se.payment_intent("CA-404", "canada_crtc", intent_id="pi_test_404"),
                       "card")
    stored = await send("charge.dispute.created", se.dispute("pi_test_404"), created=DISPUTED)
    assert stored.status == "waiting" and "order:CA-404" in stored.waiting_for.split()


@pytest.mark.gen_test
async def test_a_refund_of_a_payment_no_order_of_ours_made_waits_untold(send, smtp,
                                                                       stripe_api):
    stored = await send("charge.refunded", se.charge("pi_test_elsewhere",
                                                     amount_refunded=49900))
    assert stored.status == "waiting" and smtp.messages == []
    assert "payment_intent:pi_test_elsewhere" in stored.waiting_for.split()


@pytest.mark.gen_test
async def test_a_disputed_order_never_has_its_commission_released_forfeit_recorded_or_not(
        ctx, clock, worker):
    """An order disputed before disputes forfeited the commission, or so written by
    another system: no forfeit on record, and still no release."""
    CrtcOrder.create(order_number="CA-15", payment_status="disputed",
                     delivered_at=SETTLING_DAY, holdback_ends_at=SETTLING_DAY)
    clock.fixed = SETTLING_DAY + datetime.timedelta(days=1)
    assert (await holdback.release_due(ctx)).released == 0 and worker.requests == []


def send_sorted(post, ctx, clock):
    """`send`, with the body as localstripe writes it: two-space indent, keys sorted."""
    async def send_event(event_type, obj, created=PAID):
        evt = se.event(event_type, obj, created=created)
        raw = json.dumps(evt, indent=2, sort_keys=True).encode()
        assert (await deliver(post, clock, raw=raw))[:2] == RECEIVED
        await ctx.drain_background()
    return send_event


@pytest.mark.gen_test
async def test_a_failed_3d_secure_attempt_sent_as_localstripe_sends_it_after_the_payment(
        post, ctx, clock, smtp):
    """localstripe's 3-D Secure flow: the authentication of a first attempt fails, the
    second is paid; its events go out with sorted keys, and the failure's may come last."""
    FormationOrder.create(order_number="FO-16")
    await pay_by_checkout(send_sorted(post, ctx, clock), "FO-16", kind="formation",
                          intent="pi_test_3ds")
    failed = se.payment_intent(
        "FO-16", "formation", intent_id="pi_test_3ds", status="requires_payment_method",
        last_payment_error={
            "code": "payment_intent_authentication_failure", "type": "invalid_request_error",
            "message": "The provided PaymentMethod has failed authentication. You can "
                       "provide payment_method_data or a new PaymentMethod to attempt to "
                       "fulfill this PaymentIntent again."})
    await send_sorted(post, ctx, clock)("payment_intent.payment_failed", failed,
                                        created=DECLINED)
    assert FormationOrder.get().payment_status == "paid" and smtp.messages == []

