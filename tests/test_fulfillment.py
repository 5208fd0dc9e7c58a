"""POST /api/v1/webhooks/fulfillment/<status>: the worker reports fulfilment moves of
compliance orders, as it would send them (X-Webhook-Secret, a JSON body naming the
order); the administrator's mail read back from a real SMTP server."""
import pytest

from domain import fulfillment
from domain.reminders import send_reminders
from engine.inbox import retry_due
from models import ComplianceOrder, FormationOrder, WebhookEvent
from tests.conftest import WEBHOOK_SECRET

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
ANSWERS = {"ready_to_file": "approval_requested", "awaiting_intake": "intake_reminders_started"}


@pytest.fixture
def report(post):
    """The worker's report that order `number` moved to `status`; it names each report
    with its own Idempotency-Key (a status may come back within the dedup window)."""
    sent = iter(range(1, 1000))

    async def send(status, number="CO-1", key="auto"):
        headers = {**AUTH, "Idempotency-Key": f"move-{next(sent)}"} if key == "auto" else AUTH
        code, answer, _ = await post(f"/api/v1/webhooks/fulfillment/{status}",
                                     {"order_number": number}, headers)
        return code, answer
    return send


def recorded(status):
    return (200, {"received": True,
                  "action": ANSWERS.get(status, "fulfillment_status_recorded")})


def order(**fields):
    return ComplianceOrder.create(order_number="CO-1", customer_email="ada@example.test",
                                  customer_name="Ada", service_name="IFTA filing", **fields)


@pytest.mark.gen_test
async def test_an_order_moves_through_its_states_and_waits_for_approval_to_file(
        report, smtp):
    order()
    path = ["awaiting_intake", "authorization_required", "authorization_signed",
            "awaiting_government_fee_approval", "awaiting_secure_credentials",
            "ready_to_file", "filed_waiting_state", "completed"]
    for status in path:
        assert await report(status) == recorded(status)
        assert ComplianceOrder.get().fulfillment_status == status
    [(recipients, message)] = smtp.messages
    assert recipients == ["admin@example.test"]
    assert message["Subject"] == "Filing for order CO-1 waits for your approval"
    for part in ("plain", "html"):
        body = message.get_body((part,)).get_content()
        assert "waits for your approval" in body and "IFTA filing" in body
    assert {e.status for e in WebhookEvent.select()} == {"processed"}


@pytest.mark.parametrize("start,status", [
    ("completed", "ready_to_file"), ("authorization_required", "ready_to_file"),
    (None, "authorization_signed"), (None, "filed_waiting_state"),
    ("awaiting_intake", "awaiting_intake_typo"), ("ready_to_file", "awaiting_intake"),
])
@pytest.mark.gen_test
async def test_a_move_the_order_cannot_make_is_409_kept_as_rejected_and_changes_nothing(
        report, smtp, start, status):
    order(fulfillment_status=start)
    code, answer = await report(status)
    if status not in fulfillment.STATES:
        assert (code, answer) == (404, {"error": "not found"})
        return
    reason = f"order CO-1 cannot move from {start or 'no status'} to {status}"
    assert (code, answer) == (409, {"error": reason})
    assert ComplianceOrder.get().fulfillment_status == start
    [event] = WebhookEvent.select()
    assert (event.status, event.last_error) == ("rejected", reason)
    assert smtp.messages == []
    assert await report(status, key=None) == (409, {"error": reason})  # first delivery
    assert await report(status, key=None) == (409, {"error": reason})  # and its repeat


@pytest.mark.gen_test
async def test_reporting_the_status_an_order_has_again_changes_nothing(report, smtp):
    order()
    assert await report("ready_to_file") == recorded("ready_to_file")
    assert await report("ready_to_file") == recorded("ready_to_file")
    assert len(smtp.messages) == 1


@pytest.mark.gen_test
async def test_awaiting_intake_starts_the_intake_reminders(report, clock, ctx, smtp):
    order()
    clock.set(2026, 11, 20, 9, 0)
    await send_reminders(ctx)
    assert smtp.messages == []
    await report("awaiting_intake")
    await send_reminders(ctx)
    [(recipients, message)] = smtp.messages
    assert recipients == ["ada@example.test"]
    assert message["Subject"] == "Your order CO-1 is waiting for your intake form"


@pytest.mark.gen_test
async def test_a_report_before_its_order_exists_is_handled_once_the_order_is_there(
        report, clock, ctx, smtp):
    clock.set(2026, 11, 20, 9, 0)
    # Stored, not handled yet: the answer promises no approval request.
    assert await report("ready_to_file") == (200, {"received": True, "action": "queued"})
    assert WebhookEvent.get().status == "failed"
    order()
    clock.advance(hours=1)
    await retry_due(ctx)
    assert ComplianceOrder.get().fulfillment_status == "ready_to_file"
    assert WebhookEvent.get().status == "processed" and len(smtp.messages) == 1


@pytest.mark.gen_test
async def test_a_report_needs_the_secret_and_an_order_number(post):
    url = "/api/v1/webhooks/fulfillment/ready_to_file"
    assert (await post(url, {"order_number": "CO-1"}, {"X-Webhook-Secret": "wrong"}))[:2] == (
        401, {"error": "Unauthorized"})
    assert (await post(url, {"order_name": "CO-1"}, AUTH))[:2] == (
        400, {"error": "missing field: order_number"})
    assert WebhookEvent.select().count() == 0


def test_completed_is_final_and_only_a_signature_resolves_an_authorization():
    assert not [status for status, allowed in fulfillment.ALLOWED_FROM.items()
                if fulfillment.COMPLETED in allowed]
    assert [status for status, allowed in fulfillment.ALLOWED_FROM.items()
            if fulfillment.AUTHORIZATION_REQUIRED in allowed] == ["authorization_signed"]
    assert set(fulfillment.ALLOWED_FROM) == set(fulfillment.STATES)


@pytest.mark.gen_test
async def test_a_report_for_an_order_of_another_kind_is_refused_not_recorded(report):
    """The old code answered `fulfillment_status_recorded` and retried it for ever."""
    FormationOrder.create(order_number="FO-7", order_name="ORD-7")
    reason = ("order FO-7 is a formation order, not a compliance order: it has no "
              "fulfilment status")
    assert await report("ready_to_file", number="FO-7") == (409, {"error": reason})
    [event] = WebhookEvent.select()
    assert (event.status, event.last_error) == ("rejected", reason)
