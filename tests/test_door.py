"""The one door to the database (engine.commits, `ctx.db`): units run in the database
thread, a call's time on the database is bounded as a whole, and the test suite's
thread check refuses a statement anywhere else."""
import asyncio
import functools
import threading

import pytest

from clients.http import Result
from models import Outbox, WebhookEvent
from engine import commits, outbox, retention
from engine.db import Circuit
from tests.door import OutsideTheDoor
from tests.test_cli import outbox_row
from tests.waits import eventually


def holding_the_thread(release):
    """A unit that holds the database thread until `release` is set, and the event set
    once it does."""
    held = threading.Event()

    def unit():
        held.set()
        release.wait(30)
    return unit, held


@pytest.mark.gen_test
async def test_a_unit_runs_in_the_database_thread_and_its_result_comes_back(ctx):
    def unit():
        return threading.current_thread().name, WebhookEvent.select().count()

    thread, count = await ctx.db(unit)
    assert thread.startswith("database") and count == 0


@pytest.mark.gen_test
async def test_past_the_call_budget_the_wait_is_over_and_a_unit_not_started_never_runs(ctx):
    release = threading.Event()
    ran = []
    unit, held = holding_the_thread(release)
    holding_unit = asyncio.ensure_future(ctx.db(unit))
    await eventually(held.is_set, interval=0.01)  # the database thread is held by it
    with commits.budget(0.1):
        with pytest.raises(commits.OverBudget):
            await ctx.db(lambda: ran.append(1))
    release.set()
    await holding_unit
    assert await ctx.db(lambda: "after") == "after"
    assert ran == []


@pytest.mark.gen_test
async def test_work_that_outlives_the_call_has_no_budget(ctx):
    release = threading.Event()
    holding = asyncio.ensure_future(ctx.db(functools.partial(release.wait, 30)))
    with commits.budget(0.1):
        later = ctx.background(ctx.db(lambda: "done"))
    await asyncio.sleep(0.3)  # time past the call's budget: the behaviour under test
    release.set()
    await holding
    assert await later == "done"


@pytest.mark.gen_test(timeout=30)
async def test_a_calls_budget_counts_only_its_waits_on_the_database(ctx, db):
    circuit = Circuit(db)
    circuit.attach()
    release = threading.Event()
    holding_unit = None
    try:
        with commits.budget(0.3):
            await asyncio.sleep(0.6)  # a send, a password check: not the database's time
            assert await ctx.db(lambda: "within") == "within"
            await asyncio.sleep(0.6)  # time off the database again: not counted
            assert await ctx.db(lambda: "still within") == "still within"
            unit, held = holding_the_thread(release)
            holding_unit = ctx.background(ctx.db(unit))
            await eventually(held.is_set, interval=0.01)  # the database thread is held
            with pytest.raises(commits.OverBudget):
                await ctx.db(lambda: "never")
        assert circuit.is_open  # a database that slow is taken for down
    finally:
        release.set()
        if holding_unit is not None:
            await holding_unit
        await circuit.detach()


@pytest.mark.gen_test(timeout=30)
async def test_the_waits_a_call_makes_at_once_count_once(ctx):
    release = threading.Event()
    unit, held = holding_the_thread(release)
    holding_unit = ctx.background(ctx.db(unit))
    await eventually(held.is_set, interval=0.01)  # the database thread is held by it
    try:
        with commits.budget(1.0):
            both = asyncio.gather(ctx.db(lambda: 1), ctx.db(lambda: 2))
            await asyncio.sleep(0.6)  # both wait this long on the database, at once
            release.set()
            assert await both == [1, 2]
            # 0.6 s of waiting, not 1.2: the budget is not spent.
            assert await ctx.db(lambda: 3) == 3
    finally:
        release.set()
        await holding_unit


@pytest.mark.gen_test(timeout=30)
async def test_an_allowance_counts_only_the_waits_on_the_database_and_opens_no_circuit(
        ctx, db):
    circuit = Circuit(db)
    circuit.attach()
    release = threading.Event()
    ran = []
    try:
        with commits.allowance(2):
            await asyncio.sleep(2.5)  # a call to another system: not counted
            assert await ctx.db(lambda: "within") == "within"
            unit, held = holding_the_thread(release)
            holding = ctx.background(ctx.db(unit))
            await eventually(held.is_set, interval=0.01)  # the database thread is held
            with pytest.raises(commits.AllowanceSpent):
                await ctx.db(lambda: ran.append(1))
            # Spent: the next unit is refused at once, and never runs either.
            with pytest.raises(commits.AllowanceSpent):
                await ctx.db(lambda: ran.append(2))
        assert not circuit.is_open
        release.set()
        await holding
        assert await ctx.db(lambda: "after") == "after" and ran == []
    finally:
        release.set()
        await circuit.detach()


@pytest.mark.gen_test
async def test_the_thread_check_refuses_service_code_off_the_database_thread(
        ctx, thread_check):
    with pytest.raises(OutsideTheDoor):
        retention.prune(ctx)
    assert len(thread_check.refused) == 1
    thread_check.refused.clear()
    assert await ctx.db(functools.partial(retention.prune, ctx)) == (0, 0)
    # Statements written in a test (set-up, checks) are let through.
    assert WebhookEvent.select().count() == 0
    assert thread_check.refused == []


def sends_counted(ctx, destination, result):
    return ctx.metrics.sends.labels(destination, result)._value.get()


@pytest.mark.gen_test
async def test_a_counter_changed_in_a_unit_is_counted_once_when_its_turn_runs_again(ctx):
    """Another unit of the same turn fails: the turn is rolled back and run again with
    savepoints, and the outcome recorded once, counted once."""
    row = outbox_row()

    def failing():
        raise ValueError("this unit fails")
    recorded, failed = await asyncio.gather(
        ctx.db(functools.partial(outbox.record_outcome, ctx, row, Result(ok=True))),
        ctx.db(failing), return_exceptions=True)
    assert recorded is None and isinstance(failed, ValueError)
    assert Outbox.get_by_id(row.id).status == "sent"
    assert sends_counted(ctx, "worker", "sent") == 1


@pytest.mark.gen_test
async def test_a_counter_changed_in_a_unit_that_is_undone_is_not_counted(ctx):
    row = outbox_row()

    def recorded_then_failing():
        outbox.record_outcome(ctx, row, Result(ok=True))
        raise ValueError("this unit fails after recording")
    with pytest.raises(ValueError):
        await ctx.db(recorded_then_failing)
    assert Outbox.get_by_id(row.id).status == "pending"
    assert sends_counted(ctx, "worker", "sent") == 0
