"""The one door to the database (engine.commits, `ctx.db`): units run in the database
thread, a call's time on the database is bounded as a whole, and the test suite's
thread check refuses a statement anywhere else."""
import asyncio
import functools
import threading

import pytest

from models import WebhookEvent
from engine import commits, retention
from tests.door import OutsideTheDoor


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
    holding = asyncio.ensure_future(ctx.db(functools.partial(release.wait, 30)))
    await asyncio.sleep(0.05)  # the database thread is held by the first unit
    with commits.budget(0.1):
        with pytest.raises(commits.OverBudget):
            await ctx.db(lambda: ran.append(1))
    release.set()
    await holding
    assert await ctx.db(lambda: "after") == "after"
    assert ran == []


@pytest.mark.gen_test
async def test_work_that_outlives_the_call_has_no_budget(ctx):
    release = threading.Event()
    holding = asyncio.ensure_future(ctx.db(functools.partial(release.wait, 30)))
    with commits.budget(0.1):
        later = ctx.background(ctx.db(lambda: "done"))
    await asyncio.sleep(0.3)
    release.set()
    await holding
    assert await later == "done"


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
