"""Intake reminders (BEHAVIOUR.md 8): at most 10 per order, at most one consolidated e-mail per
customer per day, across many days with a fixed clock and a real SMTP server."""
import collections
import dataclasses

import pytest

from models import ComplianceOrder, Outbox
from engine import outbox
from domain.reminders import MAX_REMINDERS_PER_ORDER, send_reminders


def waiting(number, email, **fields):
    return ComplianceOrder.create(order_number=number, customer_email=email,
                                  customer_name="Ada", service_name="BOI report",
                                  fulfillment_status="awaiting_intake", **fields)


def mail_by_customer(smtp):
    received = collections.defaultdict(list)
    for rcpt, message in smtp.messages:
        received[rcpt[0]].append(message)
    return received


def listed_orders(message):
    text = message.get_body(("plain",)).get_content()
    return sorted(word.rstrip(":") for word in text.split() if word.startswith("CO-"))


async def run_hourly_for(ctx, clock, days):
    """The job runs every hour; so it does here, `days` days long (from 00:30, so that
    is `days` calendar days)."""
    for _ in range(days * 24):
        await send_reminders(ctx)
        clock.advance(hours=1)


@pytest.mark.gen_test
async def test_one_consolidated_mail_per_customer_per_day_listing_every_waiting_order(
        ctx, clock, smtp):
    clock.set(2026, 11, 20, 0, 30)
    waiting("CO-1", "ada@example.test")
    waiting("CO-2", "Ada@Example.test")
    waiting("CO-3", "bob@example.test")
    ComplianceOrder.create(order_number="CO-4", customer_email="ada@example.test",
                           fulfillment_status="ready_to_file")

    await run_hourly_for(ctx, clock, days=1)

    received = mail_by_customer(smtp)
    assert sorted(received) == ["ada@example.test", "bob@example.test"]
    [to_ada] = received["ada@example.test"]
    assert listed_orders(to_ada) == ["CO-1", "CO-2"]
    assert to_ada["Subject"] == "2 of your orders are waiting for your intake forms"
    assert "CO-1" in to_ada.get_body(("html",)).get_content()
    [to_bob] = received["bob@example.test"]
    assert to_bob["Subject"] == "Your order CO-3 is waiting for your intake form"
    assert [o.intake_reminders_sent for o in ComplianceOrder.select().order_by(
        ComplianceOrder.order_number)] == [1, 1, 1, 0]


@pytest.mark.gen_test
async def test_at_most_ten_reminders_per_order_across_days(ctx, clock, smtp):
    clock.set(2026, 11, 1, 0, 30)
    waiting("CO-1", "ada@example.test")
    await run_hourly_for(ctx, clock, days=4)
    waiting("CO-2", "ada@example.test")  # a second order starts waiting on day 5
    await run_hourly_for(ctx, clock, days=16)

    mails = mail_by_customer(smtp)["ada@example.test"]
    lists = [listed_orders(message) for message in mails]
    assert len(mails) == 14  # one a day: days 1-10 for CO-1, days 5-14 for CO-2
    assert lists[:4] == [["CO-1"]] * 4
    assert lists[4:10] == [["CO-1", "CO-2"]] * 6
    assert lists[10:] == [["CO-2"]] * 4
    assert [o.intake_reminders_sent for o in ComplianceOrder.select().order_by(
        ComplianceOrder.order_number)] == [MAX_REMINDERS_PER_ORDER] * 2


@pytest.mark.gen_test
async def test_an_order_that_stops_waiting_gets_no_more_reminders(ctx, clock, smtp):
    clock.set(2026, 11, 1, 0, 30)
    order = waiting("CO-1", "ada@example.test")
    await run_hourly_for(ctx, clock, days=2)
    ComplianceOrder.update(fulfillment_status="ready_to_file").where(
        ComplianceOrder.id == order.id).execute()
    await run_hourly_for(ctx, clock, days=3)
    assert len(smtp.messages) == 2


@pytest.mark.gen_test
async def test_a_second_order_waiting_later_the_same_day_waits_for_tomorrow(ctx, clock, smtp):
    clock.set(2026, 11, 1, 0, 30)
    first = waiting("CO-1", "ada@example.test")
    await send_reminders(ctx)
    ComplianceOrder.update(fulfillment_status="ready_to_file").where(
        ComplianceOrder.id == first.id).execute()
    waiting("CO-2", "ada@example.test")
    clock.advance(hours=3)
    await send_reminders(ctx)
    assert len(smtp.messages) == 1
    clock.set(2026, 11, 2, 0, 5)
    await send_reminders(ctx)
    assert [listed_orders(m) for _, m in smtp.messages] == [["CO-1"], ["CO-2"]]


@pytest.mark.gen_test
async def test_a_day_is_a_day_in_the_business_time_zone(ctx, clock, smtp):
    ctx.settings = dataclasses.replace(ctx.settings, business_tz="America/Vancouver")
    clock.set(2026, 11, 2, 7, 0)  # 23:00 on 1 November in Vancouver
    waiting("CO-1", "ada@example.test")
    await send_reminders(ctx)
    clock.set(2026, 11, 2, 7, 59)
    await send_reminders(ctx)
    clock.set(2026, 11, 2, 8, 1)  # just after midnight there: a new day
    await send_reminders(ctx)
    assert len(smtp.messages) == 2


@pytest.mark.gen_test
async def test_a_reminder_the_mail_server_refused_is_sent_later_and_still_counts_once(
        ctx, clock, smtp):
    clock.set(2026, 11, 1, 0, 30)
    waiting("CO-1", "ada@example.test")
    smtp.box.refuse_with = "451 try later"
    await run_hourly_for(ctx, clock, days=1)
    assert smtp.messages == []
    [row] = Outbox.select()
    assert row.status == "pending"

    smtp.box.refuse_with = None
    clock.advance(hours=7)
    await outbox.send_due(ctx)
    assert len(smtp.messages) == 1
    assert ComplianceOrder.get().intake_reminders_sent == 1


@pytest.mark.gen_test
async def test_orders_without_an_address_are_left_out(ctx, clock, smtp):
    clock.set(2026, 11, 1, 0, 30)
    ComplianceOrder.create(order_number="CO-1", fulfillment_status="awaiting_intake")
    waiting("CO-2", "  ")
    assert await send_reminders(ctx) == 0
    assert smtp.messages == []
