"""The commission holdback of CRTC orders: crtc/delivered starts it, the release job pays
it once from the 14th day on, a dispute before that withholds it. A fixed clock across
days 13, 14 and 15; the worker, Frappe and the mail server are real peers on loopback;
deliveries and disputes come in as their senders send them."""
import dataclasses
import datetime

import pytest

from domain.holdback import release_due
from models import UTC, CrtcOrder
from tests import stripe_events as se
from tests.conftest import WEBHOOK_SECRET
from tests.test_cli import cli_env, run_async
from tests.stripe_events import send, settings  # noqa: F401 (fixtures)
from tests.test_card_payments import parts

DELIVERED = datetime.datetime(2026, 11, 2, 15, 30, tzinfo=UTC)
DELIVERY = {"order_name": "CRTC-ORD-0007", "order_number": "CA-7"}
AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}


def crtc_order(**fields):
    return CrtcOrder.create(order_number="CA-7", payment_status="paid",
                            stripe_payment_intent_id="pi_test_ca7", customer_name="Dana",
                            customer_email="dana@example.test", **fields)


def released_jobs(worker):
    return [r for r in worker.requests if r.json["action"] == "release_commission"]


@pytest.fixture
def deliver(post, clock):
    async def send_delivery(body=DELIVERY, headers=AUTH, answer="delivery_recorded"):
        status, said, _ = await post("/api/v1/webhooks/crtc/delivered", body, headers)
        assert (status, said) == (200, {"received": True, "action": answer})
    return send_delivery


async def delivered(clock, deliver):
    """CA-7 exists and its delivery is reported at DELIVERED."""
    crtc_order()
    clock.fixed = DELIVERED
    await deliver()


async def on_day(ctx, clock, day, hour=DELIVERED.hour, minute=DELIVERED.minute):
    clock.fixed = DELIVERED.replace(hour=hour, minute=minute) + datetime.timedelta(days=day)
    return await release_due(ctx)


@pytest.mark.gen_test
async def test_the_delivery_starts_a_14_day_holdback_released_once_from_day_14(
        ctx, clock, deliver, worker):
    await delivered(clock, deliver)
    order = CrtcOrder.get()
    assert (order.delivered_at, order.holdback_ends_at) == (
        DELIVERED, DELIVERED + datetime.timedelta(days=14))
    assert order.order_name == "CRTC-ORD-0007"
    assert [r.json["action"] for r in worker.requests] == ["mark_delivered"]

    assert (await on_day(ctx, clock, 13, hour=23, minute=59)).released == 0
    assert (await on_day(ctx, clock, 14, minute=DELIVERED.minute - 1)).released == 0
    assert released_jobs(worker) == []
    assert (await on_day(ctx, clock, 14)).released == 1  # the instant the holdback ends
    assert (await on_day(ctx, clock, 14, hour=18)).released == 0
    assert (await on_day(ctx, clock, 15)).released == 0

    [job] = released_jobs(worker)
    assert job.json == {"action": "release_commission", "order_name": "CRTC-ORD-0007",
                        "order_number": "CA-7", "order_type": "canada_crtc"}
    assert job.headers["Idempotency-Key"] == "job-release-commission-CA-7"
    assert CrtcOrder.get().commission_released_at == DELIVERED + datetime.timedelta(days=14)


@pytest.mark.gen_test
async def test_a_repeated_delivery_webhook_does_not_restart_the_holdback(
        ctx, clock, deliver, worker):
    await delivered(clock, deliver)
    clock.fixed = DELIVERED + datetime.timedelta(days=10)
    await deliver(headers={**AUTH, "Idempotency-Key": "frappe-resend-2"})
    assert CrtcOrder.get().holdback_ends_at == DELIVERED + datetime.timedelta(days=14)
    await on_day(ctx, clock, 14)
    assert len(released_jobs(worker)) == 1


@pytest.mark.gen_test
async def test_a_delivery_that_comes_before_its_order_is_recorded_when_the_order_appears(
        ctx, clock, deliver):
    from engine.inbox import retry_due
    clock.fixed = DELIVERED
    await deliver(answer="queued")  # stored, to be handled once its order is there
    crtc_order()
    clock.fixed = DELIVERED + datetime.timedelta(hours=1)
    await retry_due(ctx)
    assert CrtcOrder.get().delivered_at == DELIVERED  # when it was reported


@pytest.mark.gen_test
async def test_a_dispute_in_the_holdback_forfeits_the_commission_and_says_so(
        ctx, clock, deliver, send, worker, smtp):
    await delivered(clock, deliver)
    clock.fixed = DELIVERED + datetime.timedelta(days=13)
    await send("charge.dispute.created", se.dispute("pi_test_ca7", reason="fraudulent"))
    await on_day(ctx, clock, 14)
    await on_day(ctx, clock, 15)

    assert released_jobs(worker) == []
    order = CrtcOrder.get()
    assert order.commission_forfeited_at == DELIVERED + datetime.timedelta(days=13)
    assert order.commission_forfeit_reason.startswith("dispute ")
    assert order.commission_forfeit_reason.endswith(": fraudulent")
    assert order.commission_released_at is None
    [(_, message)] = smtp.messages
    for body in parts(message):
        assert "commission on this order is withheld" in body


@pytest.mark.gen_test
async def test_a_dispute_after_the_release_does_not_take_it_back(
        ctx, clock, deliver, send, worker, smtp):
    await delivered(clock, deliver)
    await on_day(ctx, clock, 14)
    clock.fixed = DELIVERED + datetime.timedelta(days=20)
    await send("charge.dispute.created", se.dispute("pi_test_ca7"))
    order = CrtcOrder.get()
    assert order.commission_released_at == DELIVERED + datetime.timedelta(days=14)
    assert order.commission_forfeited_at is None
    assert len(released_jobs(worker)) == 1
    [(_, message)] = smtp.messages
    for body in parts(message):
        assert "already released" in body
        assert "withheld" not in body


@pytest.mark.gen_test
async def test_other_orders_disputes_say_nothing_about_a_commission(send, smtp):
    from models import FormationOrder
    FormationOrder.create(order_number="FO-1", stripe_payment_intent_id="pi_test_fo1")
    await send("charge.dispute.created", se.dispute("pi_test_fo1"))
    [(_, message)] = smtp.messages
    for body in parts(message):
        assert "commission" not in body


@pytest.mark.gen_test
async def test_the_holdback_length_is_a_setting(ctx, clock, deliver, worker):
    ctx.settings = dataclasses.replace(ctx.settings, commission_holdback_days=30)
    await delivered(clock, deliver)
    assert (await on_day(ctx, clock, 29)).released == 0
    assert (await on_day(ctx, clock, 30)).released == 1


@pytest.mark.gen_test
async def test_a_release_the_worker_refuses_for_now_is_sent_later_under_the_same_key(
        ctx, clock, deliver, worker):
    from engine import outbox
    await delivered(clock, deliver)
    worker.status = 503
    await on_day(ctx, clock, 14)
    worker.status = 200
    clock.advance(hours=1)
    await outbox.send_due(ctx)
    keys = [r.headers["Idempotency-Key"] for r in released_jobs(worker)]
    assert keys == ["job-release-commission-CA-7"] * 2
    assert (await on_day(ctx, clock, 15)).released == 0


@pytest.mark.gen_test(timeout=60)
async def test_holdback_list_and_release_on_the_command_line(database_url, settings, worker):
    env = cli_env(database_url, settings)
    now = datetime.datetime.now(UTC)
    crtc_order(delivered_at=now - datetime.timedelta(days=15),
               holdback_ends_at=now - datetime.timedelta(days=1))
    CrtcOrder.create(order_number="CA-8", delivered_at=now,
                     holdback_ends_at=now + datetime.timedelta(days=14))
    CrtcOrder.create(order_number="CA-9", delivered_at=now, holdback_ends_at=now,
                     commission_forfeited_at=now, commission_forfeit_reason="dispute")

    listed = await run_async(env, "holdback", "list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["ORDER", "DELIVERED", "(UTC)", "RELEASE", "AT", "(UTC)",
                                "STATUS"]
    assert [(line.split()[0], line.split()[-1]) for line in lines[1:]] == [
        ("CA-7", "due"), ("CA-8", "holding")]

    released = await run_async(env, "holdback", "release")
    assert (released.returncode, released.stdout.strip()) == (0, "released: 1, not due: 1")
    assert [r.json["order_number"] for r in released_jobs(worker)] == ["CA-7"]
    assert "CA-7" not in (await run_async(env, "holdback", "list")).stdout
