"""An operator's retry and a send in flight: every way an operator puts an effect back in
line (the console's buttons, the command line's `outbox retry`) leaves alone a row whose
send holds its lease, so the effect goes out once. Found by a review: `outbox retry`
ignored the lease and Telegram got two alerts for one effect."""
import asyncio
import datetime
import functools

import pytest

from engine import outbox
from engine.claims import lease
from engine.outbox import Effects
from models import Outbox
from ops import console, operator
from tests.waits import eventually

WHO = ("Dana", "127.0.0.1")


async def retry_one(ctx, row):
    return await ctx.db(functools.partial(operator.retry_outbox, ctx, row.id))


async def retry_every_pending(ctx, row):
    return await ctx.db(functools.partial(operator.retry_all, ctx, "pending", WHO))


async def retry_now_from_the_console(ctx, row):
    return await console.retry_now(ctx, row.id)


async def make_due_now_from_the_console(ctx, row):
    return await ctx.db(functools.partial(console.make_due_now, ctx,
                                          operator.destination_of(row)))


async def give_up_from_the_console(ctx, row):
    return await ctx.db(functools.partial(console.give_up, ctx, row.id, "Dana"))


OPERATORS_WAYS = [retry_one, retry_every_pending, retry_now_from_the_console,
                  make_due_now_from_the_console, give_up_from_the_console]


async def alert_in_flight(ctx, telegram):
    """An alert written as its cause writes it, and its live send on its way: Telegram has
    the request and holds its answer. Returns (the row, the send)."""
    effects = Effects(ctx)
    await ctx.db(lambda: effects.alert("Order CA-7 paid", key="alert-CA-7"))
    [row] = effects.rows
    telegram.hold = asyncio.Event()
    sending = asyncio.ensure_future(outbox.deliver(ctx, effects.rows))
    await eventually(lambda: telegram.in_flight, interval=0.01)
    return row, sending


@pytest.mark.parametrize("way", OPERATORS_WAYS, ids=lambda way: way.__name__)
@pytest.mark.gen_test(timeout=60)
async def test_an_effect_whose_send_is_in_flight_is_not_sent_again(ctx, telegram, way):
    row, sending = await alert_in_flight(ctx, telegram)
    try:
        assert await way(ctx, row) == 0  # the bulk actions: none of the rows
    except operator.Refused as refused:  # the actions on one row
        assert f"effect #{row.id} may be on its way out right now" in str(refused)
    # The scheduler's next run, while the first send still waits for its answer.
    scheduled = asyncio.ensure_future(outbox.send_due(ctx))
    # Its decision: done (the row is left to the send in flight), or a second send out.
    await eventually(lambda: scheduled.done() or telegram.in_flight > 1, interval=0.01)
    telegram.hold.set()
    await sending
    await scheduled
    await outbox.send_due(ctx)
    assert len(telegram.posts) == 1
    assert Outbox.get_by_id(row.id).status == "sent"


@pytest.mark.gen_test
async def test_the_probe_of_a_down_destination_never_takes_a_row_a_send_holds(
        ctx, clock, telegram):
    """Telegram down, its one alert on its way out (claimed: its next try one lease after
    its last update): the probe, finding no row due, takes the first row on a backoff,
    and this one is not on a backoff. Taken, it would be sent beside the send under way."""
    clock.set(2026, 11, 23, 12, 0)
    now = clock()
    held = Outbox.create(kind="alert", payload='{"text": "New paid order"}',
                         idempotency_key="alert-held", status="pending", updated_at=now,
                         next_attempt_at=now + lease(ctx))
    destination = ctx.destinations.of("alert")
    destination._go_down("test: down")
    clock.advance(seconds=destination.probe_wait.total_seconds() + 1)
    await outbox.send_due(ctx)
    assert telegram.requests == []
    assert Outbox.get_by_id(held.id).next_attempt_at == now + lease(ctx)
    # On a backoff instead (its last update its failure, its next try later), it is the
    # probe.
    Outbox.update(next_attempt_at=clock() + datetime.timedelta(minutes=5)).where(
        Outbox.id == held.id).execute()
    clock.advance(seconds=destination.probe_wait.total_seconds() + 1)
    await outbox.send_due(ctx)
    assert len(telegram.requests) == 1
