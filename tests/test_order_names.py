"""The workflow system's document name (order_name): kept on the order when a workflow
webhook gives it, and used for every later call and job about that order; the order
number only while none is known. Through the real endpoints, with Frappe's own bodies."""
import datetime
import json

import pytest

from models import UTC, BundleOrder, ComplianceOrder, CrtcOrder, FormationOrder, WebhookEvent
from domain.settlement import settle_crtc_orders
from engine import inbox
from engine.transaction import Transaction
from tests import stripe_events as se
from tests.conftest import WEBHOOK_SECRET, table_away
from tests.stripe_events import send, settings  # noqa: F401 (fixtures)

FRAPPE_HEADERS = {"X-Webhook-Secret": WEBHOOK_SECRET}


def frappe_body(body):
    """The bytes current Frappe sends (frappe.as_json of the rendered template)."""
    return json.dumps(body, indent=1, sort_keys=True, separators=(",", ": ")).encode()


@pytest.fixture
def webhook(post):
    async def deliver(path, order_name, order_number, **fields):
        body = {"order_name": order_name, "order_number": order_number, **fields}
        status, _, _ = await post(f"/api/v1/webhooks/{path}", frappe_body(body),
                                  FRAPPE_HEADERS)
        assert status == 200
    return deliver


@pytest.mark.gen_test
async def test_a_workflow_webhook_keeps_the_document_name_on_its_order(webhook, worker):
    CrtcOrder.create(order_number="CA-7")
    FormationOrder.create(order_number="FO-7")
    await webhook("crtc/awaiting-funds", "CRTC-2026-0007", "CA-7")
    await webhook("formation/ready", "FORM-2026-0007", "FO-7")
    assert CrtcOrder.get().order_name == "CRTC-2026-0007"
    assert FormationOrder.get().order_name == "FORM-2026-0007"
    # Renamed in the workflow system: the latest name is kept.
    await webhook("crtc/phone-ready", "CRTC-2026-0007-B", "CA-7")
    assert CrtcOrder.get().order_name == "CRTC-2026-0007-B"
    # A webhook about an order not stored here creates nothing.
    await webhook("formation/ready", "FORM-2026-0099", "FO-99")
    assert FormationOrder.select().count() == 1


@pytest.mark.gen_test
async def test_settlement_confirms_funds_on_the_named_document(webhook, ctx, clock, frappe):
    friday = datetime.datetime(2026, 11, 20, 16, 0, tzinfo=UTC)
    CrtcOrder.create(order_number="CA-7", payment_status="paid", payment_method="card",
                     paid_at=friday)
    CrtcOrder.create(order_number="CA-8", payment_status="paid", payment_method="card",
                     paid_at=friday + datetime.timedelta(minutes=1))
    await webhook("crtc/awaiting-funds", "CRTC-2026-0007", "CA-7")
    frappe.requests.clear()
    clock.set(2026, 11, 24, 9, 0)
    await settle_crtc_orders(ctx, Transaction(ctx))
    named = [json.loads(r.json["doc"])["name"] for r in frappe.requests]
    # CA-8 never had a webhook: its document is named by its order number.
    assert named == ["CRTC-2026-0007", "CA-8"]
    assert {r.json["action"] for r in frappe.requests} == {"Confirm Funds"}


@pytest.mark.gen_test
async def test_a_renewal_job_names_the_document(webhook, send, worker):
    ComplianceOrder.create(order_number="CO-42", service_slug="registered-agent",
                           stripe_subscription_id="sub_test_42", payment_status="paid")
    await webhook("service/queued", "SVC-2026-0042", "CO-42")
    worker.requests.clear()
    await send("invoice.paid", se.invoice("sub_test_42", invoice_id="in_test_named"))
    [job] = worker.requests
    assert (job.json["order_name"], job.json["order_number"]) == ("SVC-2026-0042", "CO-42")


@pytest.mark.gen_test
async def test_the_gov_fee_redispatch_names_the_parents_document(webhook, send, worker):
    ComplianceOrder.create(order_number="CO-PARENT", service_slug="ca-annual-report")
    BundleOrder.create(order_number="BU-FEE", parent_order_number="CO-PARENT")
    await webhook("service/approved", "SVC-2026-PARENT", "CO-PARENT")
    worker.requests.clear()
    session = se.checkout_session("BU-FEE", "bundle", payment_intent="pi_test_fee")
    assert (await send("checkout.session.completed", session)).status == "processed"
    [job] = worker.requests
    assert (job.json["order_name"], job.json["order_number"], job.json["gov_fee_paid"]) == (
        "SVC-2026-PARENT", "CO-PARENT", True)


@pytest.mark.gen_test
async def test_a_parent_not_known_yet_is_redispatched_when_the_event_is_retried(
        send, ctx, clock, worker, telegram):
    BundleOrder.create(order_number="BU-FEE", parent_order_number="CO-LATER")
    session = se.checkout_session("BU-FEE", "bundle", payment_intent="pi_test_fee")
    stored = await send("checkout.session.completed", session)
    # The child is paid (and announced) now; only the re-dispatch waits for its parent.
    assert stored.status == "failed" and "CO-LATER" in stored.last_error
    assert BundleOrder.get().payment_status == "paid" and len(telegram.requests) == 1
    assert worker.requests == []

    ComplianceOrder.create(order_number="CO-LATER", order_name="SVC-2026-LATER")
    clock.advance(minutes=2)
    assert await inbox.retry_due(ctx) == 1
    [job] = worker.requests
    assert (job.json["order_name"], job.json["gov_fee_paid"]) == ("SVC-2026-LATER", True)
    assert WebhookEvent.get().status == "processed" and len(telegram.requests) == 1


@pytest.mark.gen_test
async def test_the_same_name_again_writes_nothing(webhook, worker, clock):
    """A name that did not change is not written again (its updated_at stays)."""
    FormationOrder.create(order_number="FO-7", order_name="FORM-7",
                          updated_at=datetime.datetime(2026, 1, 2, tzinfo=UTC))
    clock.set(2026, 11, 25, 12, 0)
    await webhook("formation/ready", "FORM-7", "FO-7")
    order = FormationOrder.get()
    assert (order.order_name, order.updated_at) == (
        "FORM-7", datetime.datetime(2026, 1, 2, tzinfo=UTC))
    await webhook("formation/ready", "FORM-7-B", "FO-7")
    order = FormationOrder.get()
    assert (order.order_name, order.updated_at) == ("FORM-7-B", clock())


@pytest.mark.gen_test
async def test_a_name_that_cannot_be_kept_is_logged_and_the_job_still_goes(
        webhook, worker, db, caplog):
    FormationOrder.create(order_number="FO-7")
    with table_away(db, "compliance_orders"):
        await webhook("formation/ready", "FORM-7", "FO-7")
    assert "order FO-7: its workflow document name 'FORM-7' not kept" in caplog.text
    assert FormationOrder.get().order_name is None
    assert [request.json["order_number"] for request in worker.requests] == ["FO-7"]
    assert WebhookEvent.get().status == "processed"
