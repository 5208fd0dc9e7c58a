"""BEHAVIOUR.md 4.2: invoice.paid, invoice.payment_failed and customer.subscription.deleted
(API 2026-03-25.dahlia: the subscription is under invoice.parent.subscription_details; an
invoice rendered before 2025-03-31.basil has it at the top)."""
import datetime
import logging
import threading

import pytest

from models import UTC, ComplianceOrder, SubscriptionCycle, WebhookEvent
from domain import orders
from engine import inbox
from tests import stripe_events as se
from tests.service_process import postgres_only
from tests.stripe_events import RECEIVED, deliver, send, settings  # noqa: F401 (fixtures)
from tests.door import through_the_door
from engine.transaction import Transaction

# How long the other process holds its uncommitted change while our handler runs.
OTHER_COMMITS_AFTER = 0.5


def commit_later(connection):
    """Commit the other session's open transaction while our handler is at work."""
    timer = threading.Timer(OTHER_COMMITS_AFTER, connection.commit)
    timer.start()
    return timer


@pytest.fixture
def subscribed():
    return ComplianceOrder.create(
        order_number="CO-42", service_slug="registered-agent", service_name="Registered Agent",
        stripe_subscription_id="sub_test_42", payment_status="paid",
        customer_name="Robin <b>Roe</b>", customer_email="robin@example.test")


# --- invoice.paid -------------------------------------------------------------------------------

@pytest.mark.gen_test
async def test_each_renewal_dispatches_the_service_with_its_cycle(send, worker, subscribed):
    for invoice_id in ("in_test_a", "in_test_b"):
        stored = await send("invoice.paid", se.invoice("sub_test_42", invoice_id=invoice_id))
        assert stored.status == "processed"
    assert [r.json for r in worker.requests] == [
        {"action": "process_compliance_service", "order_name": "CO-42",
         "order_number": "CO-42", "service_slug": "registered-agent",
         "recurring_cycle": cycle, "invoice_id": invoice_id}
        for cycle, invoice_id in ((1, "in_test_a"), (2, "in_test_b"))]
    assert worker.requests[0].headers["Idempotency-Key"] == "job-subscription-cycle-in_test_a"


@pytest.mark.gen_test
async def test_the_first_charge_after_a_trial_is_cycle_one_of_an_order_paid_at_checkout(
        send, worker, telegram):
    ComplianceOrder.create(order_number="CO-7", service_slug="registered-agent")
    await send("checkout.session.completed", se.checkout_session_needing_no_payment(
        "CO-7", "compliance", mode="subscription", subscription="sub_test_trial"))
    # The trial ends: Stripe charges the first period, an invoice of the subscription's
    # cycle.
    await send("invoice.paid", se.invoice("sub_test_trial", invoice_id="in_test_after_trial"))
    assert [r.json["recurring_cycle"] for r in worker.requests] == [1]
    assert ComplianceOrder.get().payment_status == "paid"
    assert len(telegram.requests) == 1, "one alert for the order, at its checkout"


@pytest.mark.gen_test
async def test_a_renewal_of_an_order_still_pending_completes_its_payment(
        send, clock, worker, telegram):
    # A trial checkout handled before such checkouts completed the order: the first
    # charge ran the renewal job, and the order stayed pending_payment for good.
    clock.set(2026, 12, 4, 10, 0)
    ComplianceOrder.create(order_number="CO-8", service_slug="registered-agent",
                           stripe_subscription_id="sub_test_old_trial")
    await send("invoice.paid", se.invoice("sub_test_old_trial", invoice_id="in_test_first"))
    order = ComplianceOrder.get()
    assert (order.payment_status, order.paid_at, order.stripe_session_id) == (
        "paid", se.CREATED_AT, "in_test_first")
    [alert] = telegram.requests
    assert alert.json["text"].startswith("New paid order CO-8 (compliance)")
    assert [r.json["recurring_cycle"] for r in worker.requests] == [1]


@pytest.mark.gen_test
async def test_cycles_are_counted_apart_from_the_inbox_which_is_pruned(
        send, worker, subscribed):
    await send("invoice.paid", se.invoice("sub_test_42", invoice_id="in_test_1"))
    await send("invoice.paid", se.invoice("sub_test_42", invoice_id="in_test_2"))
    WebhookEvent.delete().execute()
    await send("invoice.paid", se.invoice("sub_test_42", invoice_id="in_test_3"))
    assert worker.requests[-1].json["recurring_cycle"] == 3


@pytest.mark.gen_test
async def test_the_same_invoice_twice_is_one_cycle_and_one_job(
        post, clock, worker, subscribed):
    invoice = se.invoice("sub_test_42", invoice_id="in_test_same")
    for _ in range(2):
        answer = await deliver(post, clock, se.event("invoice.paid", invoice))
        assert answer[:2] == RECEIVED
    assert len(worker.requests) == 1 and SubscriptionCycle.select().count() == 1


def test_an_invoice_keeps_its_cycle_number(ctx, subscribed):
    tx = Transaction(ctx)
    first = through_the_door(orders.record_cycle, ctx, tx, subscribed, "sub_test_42", "in_test_x")
    again = through_the_door(orders.record_cycle, ctx, tx, subscribed, "sub_test_42", "in_test_x")
    other = through_the_door(orders.record_cycle, ctx, tx, subscribed, "sub_test_other",
                             "in_test_y")
    assert (first, again, other) == (1, 1, 1)


@pytest.mark.parametrize("reason", ["subscription_create", "manual", "subscription_update",
                                    None])
@pytest.mark.gen_test
async def test_only_renewals_dispatch(send, worker, subscribed, reason):
    stored = await send("invoice.paid", se.invoice("sub_test_42", billing_reason=reason))
    assert stored.status == "processed"
    assert worker.requests == [] and SubscriptionCycle.select().count() == 0


@pytest.mark.gen_test
async def test_a_renewal_before_its_subscription_is_linked_waits_for_it(
        send, ctx, clock, worker, subscribed):
    """Linked behind the service's back (no checkout woke it), the renewal is looked at
    again once CARD_FACT_WAIT_ALERT_MINUTES have passed (a checkout waking it:
    tests/test_card_facts.py)."""
    stored = await send("invoice.paid", se.invoice("sub_test_unlinked", invoice_id="in_test_u"))
    assert stored.status == "waiting" and "sub_test_unlinked" in stored.last_error
    assert stored.waiting_for == "subscription:sub_test_unlinked"
    assert worker.requests == []

    subscribed.stripe_subscription_id = "sub_test_unlinked"
    subscribed.save()
    assert await inbox.retry_due(ctx) == 0, "not due before its time to be looked at"
    clock.advance(minutes=ctx.settings.card_fact_wait_alert_minutes)
    assert await inbox.retry_due(ctx) == 1
    assert WebhookEvent.get_by_id(stored.id).status == "processed"
    assert worker.requests[0].json["recurring_cycle"] == 1


@postgres_only
@pytest.mark.gen_test
async def test_two_renewals_racing_for_one_cycle_number_end_with_the_next_number(
        send, ctx, worker, subscribed, other_connection):
    # Another process has counted no earlier renewal and is numbering its invoice 1.
    other_connection.cursor().execute(
        "INSERT INTO subscription_cycles (subscription_id, invoice_id, order_number, cycle, "
        "created_at, updated_at) VALUES ('sub_test_42', 'in_test_other', 'CO-42', 1, "
        "now(), now())")
    timer = commit_later(other_connection)
    stored = await send("invoice.paid", se.invoice("sub_test_42", invoice_id="in_test_mine"))
    timer.join()
    # Our insert of cycle 1 waited for the other process and then failed on its row: the
    # turn was run again (engine.commits), and that run counted the other renewal.
    assert stored.status == "processed" and stored.attempts == 1
    assert [(r.json["invoice_id"], r.json["recurring_cycle"]) for r in worker.requests] == [
        ("in_test_mine", 2)]
    assert {c.invoice_id: c.cycle for c in SubscriptionCycle.select()} == {
        "in_test_other": 1, "in_test_mine": 2}


@pytest.mark.gen_test
async def test_an_invoice_without_a_parent_subscription_waits(send, worker):
    invoice = {**se.invoice(None), "parent": None}
    assert (await send("invoice.paid", invoice)).status == "waiting"
    assert worker.requests == []


# --- invoices rendered in an API version before 2025-03-31.basil ---------------------------------

OLD_VERSION = "2024-06-20"


@pytest.mark.gen_test
async def test_a_renewal_in_the_pre_basil_shape_dispatches_for_its_order(
        send, worker, subscribed):
    invoice = se.invoice_before_basil("sub_test_42", invoice_id="in_test_old")
    stored = await send("invoice.paid", invoice, api_version=OLD_VERSION)
    assert stored.status == "processed"
    [job] = worker.requests
    assert (job.json["order_number"], job.json["invoice_id"], job.json["recurring_cycle"]) == (
        "CO-42", "in_test_old", 1)


@pytest.mark.gen_test
async def test_a_failed_payment_in_the_pre_basil_shape_names_its_order(
        send, smtp, subscribed):
    invoice = se.invoice_before_basil("sub_test_42", attempt_count=1, status="open")
    await send("invoice.payment_failed", invoice, api_version=OLD_VERSION)
    subjects = {message["Subject"] for _, message in smtp.messages}
    assert subjects == {"Subscription payment failed for order CO-42",
                        "Your payment did not go through"}


@pytest.mark.gen_test
async def test_an_event_in_another_api_version_is_warned_about_once(
        send, worker, subscribed, caplog):
    caplog.set_level(logging.WARNING, logger="receiver.card")
    for invoice_id in ("in_test_v1", "in_test_v2"):
        await send("invoice.paid", se.invoice_before_basil("sub_test_42", invoice_id=invoice_id),
                   api_version="2023-10-16")
    await send("invoice.paid", se.invoice("sub_test_42", invoice_id="in_test_v3"))
    warnings = [r.getMessage() for r in caplog.records if "API version" in r.getMessage()]
    assert len(warnings) == 1 and "'2023-10-16'" in warnings[0]
    assert "2026-03-25.dahlia" in warnings[0] and len(worker.requests) == 3


# --- invoice.payment_failed ---------------------------------------------------------------------

def bodies(message):
    return (message.get_body(("plain",)).get_content(),
            message.get_body(("html",)).get_content())


@pytest.mark.gen_test
async def test_a_first_failed_attempt_alerts_the_admin_and_nudges_the_customer(
        send, smtp, subscribed):
    invoice = se.invoice("sub_test_42", invoice_id="in_test_f", attempt_count=1,
                         amount_due=19900, status="open")
    assert (await send("invoice.payment_failed", invoice)).status == "processed"
    mail = {tuple(recipients): message for recipients, message in smtp.messages}
    assert set(mail) == {("admin@example.test",), ("robin@example.test",)}

    admin = mail[("admin@example.test",)]
    assert admin["Subject"] == "Subscription payment failed for order CO-42"
    for body in bodies(admin):
        for fact in ("CO-42", "in_test_f", "$199.00", "robin@example.test",
                     "The customer has been asked to update their payment method."):
            assert fact in body

    nudge = mail[("robin@example.test",)]
    assert nudge["Subject"] == "Your payment did not go through"
    text, html = bodies(nudge)
    assert "Robin <b>Roe</b>" in text and invoice["hosted_invoice_url"] in text
    assert "Robin &lt;b&gt;Roe&lt;/b&gt;" in html and "<b>Roe" not in html
    assert f'href="{invoice["hosted_invoice_url"]}"' in html and "$199.00" in html


@pytest.mark.parametrize("attempt", [2, 3, 4])
@pytest.mark.gen_test
async def test_later_attempts_alert_only_the_admin(send, smtp, subscribed, attempt):
    invoice = se.invoice("sub_test_42", attempt_count=attempt, status="open")
    await send("invoice.payment_failed", invoice)
    [(recipients, message)] = smtp.messages
    assert recipients == ["admin@example.test"] and f"attempt {attempt}" in bodies(message)[0]
    for body in bodies(message):
        assert "The customer was not e-mailed again" in body
        assert "asked to update" not in body


@pytest.mark.gen_test
async def test_each_attempt_on_one_invoice_is_its_own_alert(send, smtp, subscribed):
    for attempt in (1, 2):
        await send("invoice.payment_failed",
                   se.invoice("sub_test_42", invoice_id="in_test_r", attempt_count=attempt,
                              status="open"))
    admin = [m for r, m in smtp.messages if r == ["admin@example.test"]]
    assert len(admin) == 2 and len(smtp.messages) == 3


@pytest.mark.gen_test
async def test_a_failure_for_an_unknown_subscription_waits_for_its_order_untold(send, smtp):
    invoice = se.invoice("sub_test_gone", customer_email="payer@example.test", status="open")
    stored = await send("invoice.payment_failed", invoice)
    assert (stored.status, stored.waiting_for) == ("waiting", "subscription:sub_test_gone")
    assert smtp.messages == [], "no mail about order unknown"


@pytest.mark.gen_test
async def test_no_customer_address_means_no_nudge(send, smtp):
    ComplianceOrder.create(order_number="CO-7", stripe_subscription_id="sub_test_7",
                           payment_status="paid")
    await send("invoice.payment_failed",
               se.invoice("sub_test_7", customer_email=None, status="open"))
    [(recipients, message)] = smtp.messages
    assert recipients == ["admin@example.test"]
    for body in bodies(message):
        assert "The customer was not told: no customer e-mail address is known." in body
        assert "asked to update" not in body


# --- customer.subscription.deleted --------------------------------------------------------------

@pytest.mark.gen_test
async def test_a_deleted_subscription_cancels_its_order(send, subscribed):
    ended = int(datetime.datetime(2026, 11, 19, 12, 0, tzinfo=UTC).timestamp())
    await send("customer.subscription.deleted", se.subscription("sub_test_42", ended))
    order = ComplianceOrder.get()
    assert order.subscription_status == "cancelled"
    assert order.cancelled_at == datetime.datetime(2026, 11, 19, 12, 0, tzinfo=UTC)
    assert order.payment_status == "paid"


@pytest.mark.gen_test
async def test_without_an_end_time_the_cancellation_is_dated_by_its_event(send, clock,
                                                                          subscribed):
    clock.set(2026, 11, 20, 10, 0)
    await send("customer.subscription.deleted",
               {**se.subscription("sub_test_42"), "ended_at": None, "canceled_at": None})
    assert ComplianceOrder.get().cancelled_at == se.CREATED_AT


@pytest.mark.gen_test
async def test_an_order_already_cancelled_keeps_its_date(send, subscribed):
    subscribed.subscription_status = "cancelled"
    subscribed.cancelled_at = datetime.datetime(2026, 1, 1, tzinfo=UTC)
    subscribed.save()
    await send("customer.subscription.deleted", se.subscription("sub_test_42"))
    assert ComplianceOrder.get().cancelled_at == datetime.datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.gen_test
async def test_a_deleted_subscription_of_no_order_waits_and_changes_nothing(send, subscribed):
    stored = await send("customer.subscription.deleted", se.subscription("sub_test_other"))
    assert (stored.status, stored.waiting_for) == ("waiting", "subscription:sub_test_other")
    assert ComplianceOrder.get().subscription_status is None


@postgres_only
@pytest.mark.gen_test
async def test_a_dispute_committed_meanwhile_by_another_process_is_not_written_over(
        send, subscribed, other_connection):
    other_connection.cursor().execute(
        "UPDATE compliance_orders SET payment_status = 'disputed', notes = 'Dispute opened' "
        "WHERE id = %s", (subscribed.id,))
    timer = commit_later(other_connection)
    await send("customer.subscription.deleted", se.subscription("sub_test_42"))
    timer.join()
    order = ComplianceOrder.get()
    assert (order.payment_status, order.notes, order.subscription_status) == (
        "disputed", "Dispute opened", "cancelled")


@postgres_only
@pytest.mark.gen_test
async def test_a_cancellation_committed_meanwhile_by_another_process_keeps_its_date(
        send, subscribed, other_connection):
    # The handler must see the other process's cancellation (it reads under a lock), or it
    # would write its own date over the one already recorded.
    other_connection.cursor().execute(
        "UPDATE compliance_orders SET subscription_status = 'cancelled', "
        "cancelled_at = '2026-01-01T00:00:00+00:00' WHERE id = %s", (subscribed.id,))
    timer = commit_later(other_connection)
    await send("customer.subscription.deleted", se.subscription("sub_test_42"))
    timer.join()
    assert ComplianceOrder.get().cancelled_at == datetime.datetime(2026, 1, 1, tzinfo=UTC)
