"""The shared "complete a payment" step, against real peers."""
import datetime
import decimal
import json

import pytest

from models import ComplianceOrder, CrtcOrder, FormationOrder, Outbox, database
from engine import outbox
from engine.transaction import Transaction
from domain.money import Money, money
from domain.orders import OrderNotFound, complete_payment, payment_method_of
from tests.door import through_the_door


def complete(ctx, *args, **kwargs):
    """complete_payment in a unit of work of its own, as the plugins run it."""
    tx = Transaction(ctx)
    result = through_the_door(complete_payment, ctx, tx, *args, **kwargs)
    return result, tx


@pytest.mark.gen_test
async def test_first_completion_marks_paid_and_alerts_once(ctx, clock, telegram):
    clock.set(2026, 11, 20, 15, 30)
    FormationOrder.create(order_number="FO-1", customer_email="c@example.test",
                          discount_code="SPRING25", service_name="Wyoming LLC")
    (order, newly_paid), effects = complete(ctx, "FO-1", "formation", "cs_test_1",
                                            source="card", payment_intent_id="pi_1")
    await outbox.deliver(ctx, effects.rows)
    order = FormationOrder.get(FormationOrder.order_number == "FO-1")
    assert newly_paid and order.payment_status == "paid"
    assert order.paid_at == datetime.datetime(2026, 11, 20, 15, 30, tzinfo=datetime.timezone.utc)
    assert (order.stripe_session_id, order.stripe_payment_intent_id) == ("cs_test_1", "pi_1")
    [request] = telegram.requests
    assert request.path == "/bot123:bot-token/sendMessage"
    text = request.json["text"]
    assert request.json["chat_id"] == "-1001"
    assert "FO-1" in text and "card" in text and "SPRING25" in text

    # The same payment told again, by either of its ids: nothing more.
    for reference in ("cs_test_1", "pi_1"):
        (order, newly_paid), effects = complete(ctx, "FO-1", "formation", reference,
                                                source="card")
        await outbox.deliver(ctx, effects.rows)
        assert not newly_paid and effects.rows == []
    assert FormationOrder.get().stripe_session_id == "cs_test_1"
    assert len(telegram.requests) == 1


@pytest.mark.gen_test
async def test_another_payment_for_a_paid_order_warns_and_mails_the_admin_once(
        ctx, smtp, telegram, caplog):
    FormationOrder.create(order_number="FO-1", payment_status="paid",
                          stripe_session_id="cs_first", stripe_payment_intent_id="pi_first",
                          customer_email="c@example.test")
    for _ in range(2):  # a redelivery, or a retry of the event, is not a second mail
        (_, newly_paid), effects = complete(ctx, "FO-1", "formation", "crypto-tx9",
                                            source="crypto", payment_method="crypto")
        await outbox.deliver(ctx, effects.rows)
        assert not newly_paid
    [(recipients, message)] = smtp.messages
    assert recipients == ["admin@example.test"]
    assert message["Subject"] == "Second payment for order FO-1"
    text = message.get_body(("plain",)).get_content()
    assert "cs_first" in text and "crypto-tx9" in text and "refund" in text
    assert "c@example.test" in message.get_body(("html",)).get_content()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warnings and "FO-1" in warnings[0].getMessage()
    order = FormationOrder.get()
    assert (order.stripe_session_id, order.stripe_payment_intent_id) == ("cs_first", "pi_first")
    assert telegram.requests == []


def test_a_paid_crtc_order_gets_a_missing_payment_method_filled_in(ctx):
    CrtcOrder.create(order_number="CA-2", payment_status="paid", stripe_session_id="cs_2",
                     stripe_payment_intent_id="pi_2")
    complete(ctx, "CA-2", "canada_crtc", "pi_2", source="card", payment_intent_id="pi_2",
             payment_method="bnpl")
    assert CrtcOrder.get().payment_method == "bnpl"


def test_a_paid_order_gets_a_missing_payment_intent_filled_in(ctx):
    FormationOrder.create(order_number="FO-2", payment_status="paid", stripe_session_id="cs_2")
    (_, newly_paid), _ = complete(ctx, "FO-2", "formation", "cs_2", source="card",
                                  payment_intent_id="pi_2")
    order = FormationOrder.get()
    assert not newly_paid and order.stripe_payment_intent_id == "pi_2"
    assert Outbox.select().count() == 0


@pytest.mark.parametrize("processor_type,method", [
    ("card", "card"), ("us_bank_account", "ach"), ("affirm", "bnpl"), ("klarna", "bnpl"),
    ("afterpay_clearpay", "bnpl"), ("crypto", "crypto"), ("link", None), (None, None)])
def test_payment_method_mapping(processor_type, method):
    assert payment_method_of(processor_type) == method


def test_crtc_order_records_its_payment_method(ctx):
    CrtcOrder.create(order_number="CA-1")
    complete(ctx, "CA-1", "canada_crtc", "cs_ca", source="card",
             payment_method=payment_method_of("us_bank_account"))
    assert CrtcOrder.get().payment_method == "ach"


@pytest.mark.gen_test
async def test_a_child_order_redispatches_its_parent_with_the_fee_paid(ctx, worker):
    ComplianceOrder.create(order_number="CO-PARENT", service_slug="ca-annual-report")
    ComplianceOrder.create(order_number="CO-FEE", parent_order_number="CO-PARENT")
    _, effects = complete(ctx, "CO-FEE", "compliance", "cs_fee", source="card")
    await outbox.deliver(ctx, effects.rows)
    [request] = worker.requests
    assert request.json == {"action": "process_compliance_service", "order_name": "CO-PARENT",
                            "order_number": "CO-PARENT", "service_slug": "ca-annual-report",
                            "gov_fee_paid": True}


@pytest.mark.gen_test
async def test_a_parent_of_any_kind_is_redispatched_under_its_document_name(ctx, worker):
    FormationOrder.create(order_number="FO-PARENT", order_name="FORM-2026-0007")
    ComplianceOrder.create(order_number="CO-FEE", parent_order_number="FO-PARENT")
    _, effects = complete(ctx, "CO-FEE", "compliance", "cs_fee", source="card")
    await outbox.deliver(ctx, effects.rows)
    [request] = worker.requests
    assert request.json == {"action": "process_compliance_service",
                            "order_name": "FORM-2026-0007", "order_number": "FO-PARENT",
                            "service_slug": "", "gov_fee_paid": True}


@pytest.mark.gen_test
async def test_a_child_whose_parent_is_not_known_yet_is_paid_and_the_redispatch_retried(
        ctx, worker, telegram):
    ComplianceOrder.create(order_number="CO-FEE", parent_order_number="CO-LATER")
    (order, newly_paid), effects = complete(ctx, "CO-FEE", "compliance", "cs_fee",
                                            source="card")
    await outbox.deliver(ctx, effects.rows)
    assert newly_paid and ComplianceOrder.get().payment_status == "paid"
    assert effects.retry_reason == "parent order CO-LATER of CO-FEE not found"
    assert worker.requests == [] and len(telegram.requests) == 1

    ComplianceOrder.create(order_number="CO-LATER", service_slug="ca-annual-report")
    (_, newly_paid), effects = complete(ctx, "CO-FEE", "compliance", "cs_fee", source="card")
    await outbox.deliver(ctx, effects.rows)
    assert not newly_paid and effects.retry_reason is None
    [request] = worker.requests
    assert request.json["order_number"] == "CO-LATER" and request.json["gov_fee_paid"]
    assert len(telegram.requests) == 1


def test_an_unknown_order_is_an_error_so_the_event_is_retried(ctx):
    with pytest.raises(OrderNotFound):
        complete(ctx, "FO-404", "formation", "cs", source="card")


def test_alert_payload_is_stored_with_its_key(ctx):
    FormationOrder.create(order_number="FO-3")
    complete(ctx, "FO-3", "formation", "crypto-tx1", source="crypto")
    row = Outbox.get()
    assert row.idempotency_key == "alert-paid-formation-FO-3"
    assert "crypto" in json.loads(row.payload)["text"]


@pytest.mark.parametrize("minor_units,currency,text", [
    (49900, "usd", "$499.00"), (49900, "cad", "CAD 499.00"), (9999, "EUR", "EUR 99.99"),
    (5000, "jpy", "JPY 5000"), (12345, "kwd", "KWD 12.345"), (5, "usd", "$0.05"),
    (None, "usd", "$0.00"), (49900, None, "499.00 (currency not given)"),
])
def test_an_amount_always_names_its_currency(minor_units, currency, text):
    assert money(minor_units, currency) == text


@pytest.mark.parametrize("amount,currency,minor", [
    ("48959.975", "JPY", 48960), ("1.2345", "KWD", 1235), ("7.805", "USD", 781),
    ("12.5", "HUF", 1250), ("3.14159", "XYZ", 314),
])
def test_an_amount_is_kept_in_the_minor_unit_iso_4217_gives_its_currency(amount, currency,
                                                                          minor):
    """Forints in fillér (Babel's CLDR data would say none: it counts the digits shown,
    not ISO's minor unit); an unlisted code in hundredths."""
    assert Money.of_decimal(decimal.Decimal(amount), currency) == Money(minor, currency)


@pytest.mark.parametrize("stripe_amount,currency,text", [
    (500000, "isk", "ISK 5000"), (5000, "mga", "MGA 5000.00"), (5000, "jpy", "JPY 5000"),
    (1234, "kwd", "KWD 1.234"), (49900, "huf", "HUF 499.00"),
])
def test_stripe_amounts_are_read_in_stripes_unit_for_its_special_cases(stripe_amount,
                                                                        currency, text):
    assert str(Money.of_stripe(stripe_amount, currency)) == text
