"""BEHAVIOUR.md 4.2: checkout.session.completed, payment_intent.succeeded,
payment_intent.payment_failed and charge.dispute.created, end to end through the signed
webhook, with the mail read back from a real SMTP server."""
import dataclasses
import json
import urllib.parse

import pytest
import stripe

import plugins
from models import (ORDER_MODELS, BundleOrder, ComplianceOrder, CrtcOrder, FormationOrder, Outbox,
                    WebhookEvent)
from domain import settlement
from engine.db import Circuit
from engine.transaction import Transaction
from tests import stripe_events as se
from tests.stripe_api import stripe_api  # noqa: F401 (fixture)
from tests.stripe_events import (  # noqa: F401 (fixtures)
    RECEIVED, deliver, send, settings)


def parts(message):
    return (message.get_body(("plain",)).get_content(),
            message.get_body(("html",)).get_content())


# --- checkout.session.completed ---------------------------------------------------------------

@pytest.mark.gen_test
async def test_a_paid_session_pays_the_order(send, clock, telegram):
    clock.set(2026, 11, 20, 15, 0)
    CrtcOrder.create(order_number="CA-1", discount_code="LAUNCH10")
    session = se.checkout_session("CA-1", "canada_crtc", payment_intent="pi_test_paid")
    assert (await send("checkout.session.completed", session)).status == "processed"
    order = CrtcOrder.get()
    assert (order.payment_status, order.paid_at, order.stripe_session_id,
            order.stripe_payment_intent_id, order.payment_method) == (
        "paid", se.CREATED_AT, session["id"], "pi_test_paid", "card")
    [alert] = telegram.requests
    assert "CA-1" in alert.json["text"] and "card" in alert.json["text"]
    assert "LAUNCH10" in alert.json["text"]


@pytest.mark.gen_test(timeout=30)
async def test_a_slow_alert_is_sent_once_and_its_outcome_recorded_within_the_budget(
        send, ctx, db, telegram):
    """The answer waits for the alert; the call's database budget does not: Telegram
    taking longer than the budget is not the database being slow."""
    ctx.settings = dataclasses.replace(ctx.settings, database_call_budget_seconds=0.5)
    telegram.delay = 1.0
    circuit = Circuit(db)
    circuit.attach()
    try:
        CrtcOrder.create(order_number="CA-1")
        session = se.checkout_session("CA-1", "canada_crtc", payment_intent="pi_test_slow")
        assert (await send("checkout.session.completed", session)).status == "processed"
        assert not circuit.is_open
    finally:
        await circuit.detach()
    [alert] = Outbox.select()
    assert (alert.kind, alert.status, alert.attempts) == ("alert", "sent", 1)
    assert len(telegram.requests) == 1


@pytest.mark.gen_test
async def test_an_unpaid_bank_debit_session_waits_then_the_intent_pays_it(send, telegram):
    CrtcOrder.create(order_number="CA-2")
    session = se.checkout_session("CA-2", "canada_crtc", payment_status="unpaid",
                                  payment_intent="pi_test_ach",
                                  payment_method_types=["us_bank_account"])
    assert (await send("checkout.session.completed", session)).status == "processed"
    assert CrtcOrder.get().payment_status == "pending_payment" and telegram.requests == []

    intent = se.payment_intent("CA-2", "canada_crtc", intent_id="pi_test_ach",
                               checkout_session_id=session["id"],
                               payment_method_types=["us_bank_account"])
    await send("payment_intent.succeeded", intent)
    order = CrtcOrder.get()
    assert (order.payment_status, order.stripe_session_id, order.stripe_payment_intent_id,
            order.payment_method) == ("paid", session["id"], "pi_test_ach", "ach")
    assert len(telegram.requests) == 1


@pytest.mark.parametrize("metadata", [
    {}, {"order_id": "FO-1"}, {"order_type": "formation"},
    {"order_id": "FO-1", "order_type": "spaceship"}, None,
], ids=["none", "no-type", "no-id", "unknown-type", "null"])
@pytest.mark.parametrize("event_type,build", [
    ("checkout.session.completed", lambda: se.checkout_session(None, None)),
    ("payment_intent.succeeded", lambda: se.payment_intent(None, None)),
])
@pytest.mark.gen_test
async def test_without_usable_order_metadata_nothing_happens(
        send, telegram, stripe_api, metadata, event_type, build):
    """A payment intent no order names may be one whose checkout has not come: it waits
    for a checkout to link it (tests/test_card_facts.py)."""
    FormationOrder.create(order_number="FO-1")
    obj = {**build(), "metadata": metadata}
    assert (await send(event_type, obj)).status == (
        "waiting" if event_type == "payment_intent.succeeded" else "processed")
    assert FormationOrder.get().payment_status == "pending_payment"
    assert telegram.requests == [] and Outbox.select().count() == 0


@pytest.mark.gen_test
async def test_a_subscription_session_links_the_subscription_to_the_compliance_order(send):
    ComplianceOrder.create(order_number="CO-1", service_slug="registered-agent")
    session = se.checkout_session("CO-1", "compliance", mode="subscription",
                                  subscription="sub_test_1", payment_intent=None)
    await send("checkout.session.completed", session)
    order = ComplianceOrder.get()
    assert (order.payment_status, order.stripe_subscription_id) == ("paid", "sub_test_1")


@pytest.mark.gen_test
async def test_a_free_checkout_completes_the_order_as_a_paid_one_does(send, post, clock,
                                                                      telegram):
    # BU-5001 bought with a 100 % promotion code: on the real Stripe it stayed
    # pending_payment for good, and nobody was told.
    clock.set(2026, 11, 20, 15, 0)
    BundleOrder.create(order_number="BU-5001", discount_code="FREE100",
                       service_name="Formation bundle")
    session = se.checkout_session_needing_no_payment("BU-5001", "bundle")
    assert (await send("checkout.session.completed", session)).status == "processed"
    order = BundleOrder.get()
    assert (order.payment_status, order.paid_at, order.stripe_session_id,
            order.stripe_payment_intent_id) == ("paid", se.CREATED_AT, session["id"], None)
    assert order.notes == ("No payment required: checkout total 0 (a 100 % discount or a "
                           "free price) (2026-11-20T15:00:00+00:00)")
    [alert] = telegram.requests
    lines = alert.json["text"].splitlines()
    assert lines[0] == "New order BU-5001 (bundle): no payment required"
    assert "Campaign discount code: FREE100" in lines and "paid" not in lines[0]
    # A second Event object for the same session (Stripe may send one): nothing more.
    answer = await deliver(post, clock, se.event("checkout.session.completed", session))
    assert answer[:2] == RECEIVED and len(telegram.requests) == 1


@pytest.mark.gen_test
async def test_a_free_crtc_checkout_has_nothing_to_settle(send, ctx, clock, frappe, smtp):
    clock.set(2026, 11, 20, 15, 0)
    CrtcOrder.create(order_number="CA-5002")
    await send("checkout.session.completed",
               se.checkout_session_needing_no_payment("CA-5002", "canada_crtc"))
    order = CrtcOrder.get()
    assert (order.payment_status, order.payment_method) == ("paid", "free")
    assert not Outbox.select().where(Outbox.kind == "email").exists(), \
        "no 'payment method unknown' mail for an order that needed no payment"
    counts = await settlement.settle_crtc_orders(ctx, Transaction(ctx))
    assert counts["settled"] == 1 and CrtcOrder.get().funds_available is True


@pytest.mark.gen_test
async def test_a_trial_subscription_completes_the_order_and_links_it(send, clock, telegram):
    clock.set(2026, 11, 20, 15, 0)
    ComplianceOrder.create(order_number="CO-1")
    session = se.checkout_session_needing_no_payment(
        "CO-1", "compliance", mode="subscription", subscription="sub_test_trial")
    await send("checkout.session.completed", session)
    order = ComplianceOrder.get()
    assert (order.payment_status, order.paid_at, order.stripe_subscription_id) == (
        "paid", se.CREATED_AT, "sub_test_trial")
    assert "a trial or a discount" in order.notes
    [alert] = telegram.requests
    assert alert.json["text"].startswith("New order CO-1 (compliance): no payment required")


@pytest.mark.gen_test
async def test_a_session_whose_mode_cannot_be_read_is_kept_as_failed(post, clock, telegram,
                                                                     caplog):
    """Signed, but its mode is no string: what its order is read ahead for cannot be
    told either, so nothing is; the event is kept, its handling failed, and answered."""
    ComplianceOrder.create(order_number="CO-1")
    session = {**se.checkout_session_needing_no_payment("CO-1", "compliance"),
               "mode": ["payment"]}
    answer = await deliver(post, clock, se.event("checkout.session.completed", session))
    assert answer[:2] == RECEIVED
    [event] = WebhookEvent.select()
    assert event.status == "failed" and "TypeError" in event.last_error
    assert "checkout.session.completed: its orders not named" in caplog.text
    assert ComplianceOrder.get().payment_status == "pending_payment" and not telegram.requests


def test_a_session_names_its_order_only_when_its_unit_locks_it():
    """What the plain handling will lock and read (its `orders_of`): the order
    a paid or free session completes; none for a session paid through several allowed
    methods on a CRTC order (Stripe is asked first, and the order read after), one not
    paid yet, or one naming no order of ours."""
    registry = plugins.registries()["card"]

    def asked(session):
        return [(ref.kind, ref.number) for ref in registry.orders_of(
            "checkout.session.completed", se.event("checkout.session.completed", session))]
    assert asked(se.checkout_session("FO-1", "formation")) == [("formation", "FO-1")]
    assert asked(se.checkout_session_needing_no_payment("BU-1", "bundle")) == [
        ("bundle", "BU-1")]
    assert asked(se.checkout_session("CA-1", "canada_crtc", payment_method_types=(
        "card", "us_bank_account"))) == []
    assert asked(se.checkout_session("FO-2", "formation", payment_status="unpaid")) == []
    assert asked(se.checkout_session("FO-3", "nonsense")) == []


@pytest.mark.gen_test
async def test_a_session_in_setup_mode_completes_nothing(send, telegram):
    ComplianceOrder.create(order_number="CO-1")
    session = {**se.checkout_session_needing_no_payment("CO-1", "compliance"), "mode": "setup"}
    assert (await send("checkout.session.completed", session)).status == "processed"
    assert ComplianceOrder.get().payment_status == "pending_payment" and not telegram.requests


@pytest.mark.gen_test
async def test_a_subscription_on_another_kind_of_order_is_not_kept(send):
    BundleOrder.create(order_number="BU-1")
    session = se.checkout_session("BU-1", "bundle", mode="subscription",
                                  subscription="sub_test_x")
    assert (await send("checkout.session.completed", session)).status == "processed"
    assert BundleOrder.get().payment_status == "paid"


@pytest.mark.gen_test
async def test_a_trial_subscription_for_an_order_not_yet_written_waits_for_it(send):
    session = se.checkout_session("CO-404", "compliance", mode="subscription",
                                  payment_status="no_payment_required",
                                  subscription="sub_test_late")
    stored = await send("checkout.session.completed", session)
    assert stored.status == "waiting" and "CO-404" in stored.last_error
    assert set(stored.waiting_for.split()) == {"order:CO-404", "subscription:sub_test_late"}


def several_methods_paid(order_number):
    """A CRTC checkout that allowed several methods, and its intent as the event has it: the
    charge only named ("ch_..."), since Stripe never expands objects in events."""
    allowed = ["card", "klarna", "us_bank_account"]
    session = se.checkout_session(order_number, "canada_crtc", payment_intent="pi_test_multi",
                                  payment_method_types=allowed)
    intent = se.payment_intent(order_number, "canada_crtc", intent_id="pi_test_multi",
                               payment_method_types=allowed)
    assert intent["latest_charge"].startswith("ch_")
    return session, intent


@pytest.mark.gen_test
async def test_stripe_is_asked_in_our_api_version_whatever_the_package_default(
        send, stripe_api, monkeypatch):
    # A later stripe package defaults to a later version, whose shapes may have moved.
    monkeypatch.setattr(stripe._api_version._ApiVersion, "CURRENT", "2099-01-01.later")
    CrtcOrder.create(order_number="CA-3")
    session, intent = several_methods_paid("CA-3")
    stripe_api.charged(intent, "klarna")
    await send("checkout.session.completed", session)
    [asked] = stripe_api.requests
    assert asked.headers["Stripe-Version"] == "2026-03-25.dahlia"
    assert CrtcOrder.get().payment_method == "bnpl"


@pytest.mark.parametrize("first", ["checkout.session.completed", "payment_intent.succeeded"])
@pytest.mark.gen_test
async def test_the_method_one_of_several_allowed_is_asked_of_stripe(
        send, smtp, stripe_api, first):
    CrtcOrder.create(order_number="CA-3")
    session, intent = several_methods_paid("CA-3")
    stripe_api.charged(intent, "klarna")
    events = {"checkout.session.completed": session, "payment_intent.succeeded": intent}
    await send(first, events.pop(first))
    order = CrtcOrder.get()
    assert (order.payment_status, order.payment_method) == ("paid", "bnpl")
    [asked] = stripe_api.requests
    assert asked.path == "/v1/payment_intents/pi_test_multi"
    assert "expand[0]=latest_charge" in urllib.parse.unquote(asked.query)
    [(later_type, later)] = events.items()
    assert (await send(later_type, later)).status == "processed"
    order = CrtcOrder.get()
    assert (order.payment_method, order.stripe_payment_intent_id) == ("bnpl", "pi_test_multi")
    assert smtp.messages == []


@pytest.mark.gen_test
async def test_an_intent_stripe_cannot_tell_about_leaves_the_method_unknown_and_mails_once(
        send, smtp, stripe_api, caplog):
    CrtcOrder.create(order_number="CA-3")
    session, intent = several_methods_paid("CA-3")  # unknown to the stand-in: 404
    await send("checkout.session.completed", session)
    assert (await send("payment_intent.succeeded", intent)).status == "processed"
    assert len(stripe_api.requests) == 2, "each event asked, as the method was still unknown"
    order = CrtcOrder.get()
    assert (order.payment_status, order.payment_method) == ("paid", None)
    [(recipients, message)] = smtp.messages
    assert message["Subject"] == "Payment method unknown for CRTC order CA-3"
    for body in parts(message):
        assert "payment_method" in body and "pi_test_multi" in body
    assert any(r.levelname == "WARNING" and "CA-3" in r.getMessage() for r in caplog.records)


@pytest.mark.gen_test
async def test_a_crtc_order_with_a_known_method_is_not_flagged(send, smtp):
    CrtcOrder.create(order_number="CA-4")
    await send("checkout.session.completed", se.checkout_session("CA-4", "canada_crtc"))
    assert CrtcOrder.get().payment_method == "card" and smtp.messages == []


@pytest.mark.gen_test
async def test_a_second_checkout_for_a_paid_order_mails_the_admin_about_a_refund(send, smtp):
    FormationOrder.create(order_number="FO-1")
    first = se.checkout_session("FO-1", "formation", payment_intent="pi_test_first")
    await send("checkout.session.completed", first)
    await send("payment_intent.succeeded",
               se.payment_intent("FO-1", "formation", intent_id="pi_test_first"))
    assert smtp.messages == [], "one payment told twice is not a second payment"

    second = se.checkout_session("FO-1", "formation", payment_intent="pi_test_second")
    await send("checkout.session.completed", second)
    await send("payment_intent.succeeded",
               se.payment_intent("FO-1", "formation", intent_id="pi_test_second",
                                 checkout_session_id=second["id"]))
    [(_, message)] = smtp.messages
    assert message["Subject"] == "Second payment for order FO-1"
    text = parts(message)[0]
    assert first["id"] in text and second["id"] in text
    assert FormationOrder.get().stripe_session_id == first["id"]


# --- payment_intent.succeeded -----------------------------------------------------------------

@pytest.mark.gen_test
async def test_an_intent_without_a_session_is_its_own_reference(send, telegram):
    BundleOrder.create(order_number="BU-7")
    intent = se.payment_intent("BU-7", "bundle", intent_id="pi_test_direct")
    await send("payment_intent.succeeded", intent)
    order = BundleOrder.get()
    assert (order.payment_status, order.stripe_session_id, order.stripe_payment_intent_id) == (
        "paid", "pi_test_direct", "pi_test_direct")
    assert len(telegram.requests) == 1


@pytest.mark.gen_test
async def test_an_intent_for_an_order_not_stored_waits_for_it(send):
    stored = await send("payment_intent.succeeded", se.payment_intent("FO-404", "formation"))
    assert stored.status == "waiting" and "order:FO-404" in stored.waiting_for.split()


# --- payment_intent.payment_failed ------------------------------------------------------------

@pytest.mark.gen_test
async def test_a_failed_payment_fails_every_order_not_yet_paid_and_mails_the_admin(
        send, clock, smtp):
    """An order whose payment was received (paid, disputed) is left as it is: SPEC.md's
    rule failed a paid order too, which loses money as Stripe delivers (BEHAVIOUR.md 3.3,
    differences)."""
    clock.set(2026, 11, 20, 9, 30, 15)
    statuses = {"formation": "paid", "compliance": "pending_payment", "bundle": "disputed",
                "canada_crtc": "pending_payment"}
    for kind, status in statuses.items():
        ORDER_MODELS[kind].create(order_number="ORD-77", payment_status=status,
                                  notes="created by checkout")
    intent = se.payment_intent("ORD-77", "formation", status="requires_payment_method",
                               last_payment_error=se.card_declined("Insufficient funds."))
    assert (await send("payment_intent.payment_failed", intent)).status == "processed"

    after = {kind: model.get() for kind, model in ORDER_MODELS.items()}
    assert {k: o.payment_status for k, o in after.items()} == {
        "formation": "paid", "compliance": "failed", "bundle": "disputed",
        "canada_crtc": "failed"}
    # Failed when Stripe says (the event's created), not when it was handled.
    line = "Payment failed: Insufficient funds. (2026-11-26T09:00:00+00:00)"
    assert after["compliance"].notes == f"created by checkout\n{line}"
    assert after["formation"].notes == after["bundle"].notes == "created by checkout"

    [(recipients, message)] = smtp.messages
    assert recipients == ["admin@example.test"]
    assert message["Subject"] == "Payment failed for order ORD-77"
    text, html = parts(message)
    for body in (text, html):
        assert "ORD-77" in body and "Insufficient funds." in body and "$499.00" in body
        assert "2026-11-26T09:00:00+00:00" in body and intent["id"] in body
        assert "compliance order ORD-77" in body and "formation order" not in body


@pytest.mark.gen_test
async def test_a_failure_without_a_message_is_an_unknown_error(send, smtp):
    CrtcOrder.create(order_number="CA-9")
    await send("payment_intent.payment_failed",
               se.payment_intent("CA-9", "canada_crtc", status="requires_payment_method"))
    assert "Payment failed: unknown error" in CrtcOrder.get().notes
    assert "unknown error" in parts(smtp.messages[0][1])[0]


@pytest.mark.gen_test
async def test_a_failure_without_an_order_id_does_nothing(send, smtp):
    FormationOrder.create(order_number="FO-1")
    intent = se.payment_intent(None, None, last_payment_error=se.card_declined())
    assert (await send("payment_intent.payment_failed", intent)).status == "processed"
    assert FormationOrder.get().payment_status == "pending_payment" and smtp.messages == []


@pytest.mark.gen_test
async def test_without_an_admin_address_the_order_still_fails_and_nothing_is_mailed(
        send, ctx, smtp):
    ctx.settings = dataclasses.replace(ctx.settings, admin_email="")
    FormationOrder.create(order_number="FO-1")
    await send("payment_intent.payment_failed",
               se.payment_intent("FO-1", "formation", last_payment_error=se.card_declined()))
    assert FormationOrder.get().payment_status == "failed"
    assert smtp.messages == [] and Outbox.select().count() == 0


@pytest.mark.gen_test
async def test_a_mail_server_down_keeps_the_mail_for_retry(send, smtp):
    smtp.box.refuse_with = "451 try again later"
    FormationOrder.create(order_number="FO-1")
    await send("payment_intent.payment_failed",
               se.payment_intent("FO-1", "formation", last_payment_error=se.card_declined()))
    mail = Outbox.get(Outbox.kind == "email")
    assert (mail.status, mail.last_error) == ("pending", "SMTP 451")
    assert FormationOrder.get().payment_status == "failed"


# --- charge.dispute.created -------------------------------------------------------------------

@pytest.mark.gen_test
async def test_a_dispute_marks_the_order_found_by_payment_intent_and_mails_the_admin(
        send, clock, smtp):
    clock.set(2026, 11, 21, 8, 0)
    CrtcOrder.create(order_number="CA-5", payment_status="paid", stripe_session_id="cs_test_5",
                     stripe_payment_intent_id="pi_test_5", customer_name="Dana Client",
                     customer_email="dana@example.test", service_name="CRTC package")
    stored = await send("charge.dispute.created", se.dispute("pi_test_5", amount=123456))
    assert stored.status == "processed"
    order = CrtcOrder.get()
    assert order.payment_status == "disputed"
    # Opened when Stripe says (the event's created), not when it was handled.
    assert order.notes == "Dispute opened: fraudulent, amount $1234.56 (2026-11-26T09:00:00+00:00)"

    [(recipients, message)] = smtp.messages
    assert recipients == ["admin@example.test"]
    assert message["Subject"] == "Dispute opened on order CA-5"
    for body in parts(message):
        for fact in ("CA-5", "$1234.56", "fraudulent", "pi_test_5", "Dana Client",
                     "dana@example.test", "CRTC package"):
            assert fact in body


@pytest.mark.gen_test
async def test_a_dispute_in_canadian_dollars_is_not_mailed_as_us_dollars(send, clock, smtp):
    clock.set(2026, 11, 21, 8, 0)
    CrtcOrder.create(order_number="CA-6", payment_status="paid",
                     stripe_payment_intent_id="pi_test_cad")
    await send("charge.dispute.created",
               {**se.dispute("pi_test_cad", amount=49900), "currency": "cad"})
    assert CrtcOrder.get().notes == (
        "Dispute opened: fraudulent, amount CAD 499.00 (2026-11-26T09:00:00+00:00)")
    [(_, message)] = smtp.messages
    for body in parts(message):
        assert "CAD 499.00" in body and "$" not in body


@pytest.mark.gen_test
async def test_the_exact_payment_intent_wins_over_a_substring_match(send):
    FormationOrder.create(order_number="FO-1", stripe_session_id="ref-pi_test_9-old")
    BundleOrder.create(order_number="BU-1", stripe_payment_intent_id="pi_test_9")
    await send("charge.dispute.created", se.dispute("pi_test_9"))
    assert BundleOrder.get().payment_status == "disputed"
    assert FormationOrder.get().payment_status == "pending_payment"


@pytest.mark.gen_test
async def test_a_dispute_falls_back_to_a_substring_of_the_reference(send, smtp):
    ComplianceOrder.create(order_number="CO-3", payment_status="paid",
                           stripe_session_id="legacy:pi_test_old_3")
    FormationOrder.create(order_number="FO-3", stripe_session_id="legacy:PI_TEST_OLD_3")
    await send("charge.dispute.created", se.dispute("pi_test_old_3", reason="duplicate"))
    assert ComplianceOrder.get().payment_status == "disputed"
    assert FormationOrder.get().payment_status == "pending_payment"
    assert smtp.messages[0][1]["Subject"] == "Dispute opened on order CO-3"


@pytest.mark.parametrize("payment_intent", ["pi_test_nowhere", None],
                         ids=["not-found", "no-payment-intent"])
@pytest.mark.gen_test
async def test_a_dispute_with_no_matching_order_waits_for_it_untold(
        send, smtp, stripe_api, payment_intent):
    """Stripe, asked, does not know the payment intent either (or there is none): the
    dispute waits with the ids that will find its order, and nobody is told of a
    dispute on order "unknown" (tests/test_card_facts.py: it is told once found)."""
    FormationOrder.create(order_number="FO-1", stripe_session_id="cs_test_1")
    dispute = {**se.dispute(payment_intent, amount=5, charge_id="ch_test_d"), "reason": None}
    stored = await send("charge.dispute.created", dispute)
    assert stored.status == "waiting"
    assert stored.waiting_for.split() == (
        [f"payment_intent:{payment_intent}"] if payment_intent else []) + ["charge:ch_test_d"]
    assert FormationOrder.get().payment_status == "pending_payment"
    assert smtp.messages == []


@pytest.mark.gen_test
async def test_customer_details_are_escaped_in_the_html_part(send, smtp):
    FormationOrder.create(order_number="FO-1", stripe_payment_intent_id="pi_test_x",
                          customer_name="<script>alert(1)</script>")
    await send("charge.dispute.created", se.dispute("pi_test_x"))
    text, html = parts(smtp.messages[0][1])
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script>alert(1)</script>" in text


@pytest.mark.parametrize("session, plainly", [
    (se.checkout_session("CA-1", "canada_crtc",
                         payment_method_types=("card", "us_bank_account")), False),
    (se.checkout_session("CA-1", "canada_crtc"), True),
    (se.checkout_session("CA-1", "canada_crtc", payment_status="unpaid",
                         payment_method_types=("card", "us_bank_account")), True),
    (se.checkout_session("FO-1", "formation", payment_method_types=("card", "link")), True),
], ids=["CRTC, several methods: Stripe asked", "CRTC, one method", "CRTC, not paid yet",
        "formation, several methods"])
def test_a_session_is_handled_where_it_is_stored_unless_stripe_must_be_asked(session,
                                                                            plainly):
    """Only a paid CRTC session that leaves its method open needs Stripe asked, outside a
    transaction; every other one is handled in the unit that stores it (engine.inbox)."""
    plugin = plugins.registries()["card"].get("checkout.session.completed")
    event = se.event("checkout.session.completed", session)
    assert (plugin.plainly(event) is not None) == plainly
