"""The sender's order over every ordering: calls of a few streams (and of none), each with a
version its sender gave it that need not follow its arrival, sent in any order, one by one
or several at once, while the database goes down and comes back, the spool is drained or
its drain dies after storing its calls, plugins fail and are retried, time passes.
Whatever hypothesis draws, each call is handed to its plugin once; within a stream one
after another, and told it is history exactly when a later version of its stream was
handled before it; calls of a stream stored together are handled in version order.

The calls go through the engine's own way in (`inbox.accept`) to a source of this test's,
whose plugins record what they were handed: one run in the storing's transaction (a plain
plugin), one after it (an async one, as a card event that asks Stripe)."""
import asyncio
import contextlib
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine import commits, inbox, spool
from engine.claims import lease
from models import WebhookEvent
from plugins.registry import Placement, Registry
from tests.conftest import start_afresh
from tests.service_process import database_down

SOURCE = "ordered"
ORDERS = ("FO-1", "FO-2", "CO-3", None)

send = st.tuples(st.just("send"), st.sampled_from(ORDERS), st.sampled_from(("plain", "async")),
                 st.integers(min_value=0, max_value=2),  # the times its plugin fails first
                 st.integers(min_value=0, max_value=9))  # its sender's version
retry = st.tuples(st.just("retry"), st.integers(min_value=0, max_value=180))  # seconds later
# Calls that come together: one turn of the group commit stores and handles them.
burst = st.tuples(st.just("burst"), st.lists(send, min_size=2, max_size=4))
step = st.one_of(
    *[send] * 6, burst, burst, retry, retry,
    st.just(("database down",)), st.just(("database up",)),
    st.just(("drain",)), st.just(("drain dies after storing",)))


# A call's stream is its order's; its version, the sender's, as fixed-width text.
PLACED = Placement(same=lambda call: None,
                   stream=lambda call: call["order"] and f"stream:{call['order']}",
                   version=lambda call: f"{call['version']:04d}")


class Recorder:
    """The test's plugins: each fails the first times its call says, then records the
    call it was handed, once committed."""

    def __init__(self):
        self.handled = []
        self.registry = Registry("test call")
        self.registry.register("plain", PLACED)(self.plain)
        self.registry.register("async", PLACED)(self.async_)

    def plain(self, ctx, call, effects):
        self.fail_first(call, effects)
        history = effects.overtaken_by is not None
        commits.on_commit(lambda: self.handled.append(
            (call["order"], call["seq"], call["version"], history)))

    async def async_(self, ctx, call, effects):
        self.fail_first(call, effects)
        self.handled.append((call["order"], call["seq"], call["version"],
                             effects.overtaken_by is not None))

    @staticmethod
    def fail_first(call, effects):
        if effects.event.attempts < call["fails"]:
            raise RuntimeError(f"fails until attempt {call['fails']}")


class Run:
    """One example: its calls sent so far, by order, and the database's state."""

    def __init__(self, ctx, clock, db):
        self.ctx, self.clock, self.db = ctx, clock, db
        self.sent = {order: [] for order in ORDERS}
        self.down = contextlib.ExitStack()
        self.is_down = False

    async def do(self, action, *args):
        if action == "send":
            await self.send(*args)
        elif action == "burst":
            await asyncio.gather(*(self.send(*call) for _, *call in args[0]))
        elif action == "database down" and not self.is_down:
            self.down.enter_context(database_down(self.db))
            self.is_down = True
        elif action == "database up" and self.is_down:
            self.down.close()
            self.is_down = False
        elif self.is_down:
            return  # the scheduler's work waits for the database
        elif action == "drain":
            await inbox.drain_spool(self.ctx)
        elif action == "drain dies after storing":
            await self.drain_dies()
        elif action == "retry":
            self.clock.advance(seconds=args[0])
            await inbox.retry_due(self.ctx)

    async def send(self, order, kind, fails, version):
        self.clock.advance(milliseconds=1)
        seq = len(self.sent[order]) + 1
        self.sent[order].append(seq)
        call = {"order": order, "seq": seq, "fails": fails, "version": version}
        placed = self.ctx.plugins[SOURCE].placed(kind, call)
        await inbox.accept(self.ctx, SOURCE, kind, f"{order}-{seq}",
                           json.dumps(call), order_number=order, stream=placed.stream,
                           version=placed.version)

    async def drain_dies(self):
        """What a drain killed while it handles its calls leaves: its files' calls stored,
        under the lease the drain took, none handled, the files gone (the restarted drain
        finds every call stored already and deletes them)."""
        async def store(entry):
            return await self.ctx.db(lambda: inbox.store_spooled(self.ctx, entry))

        async def handle_none(drained):
            pass
        await spool.store_all(self.ctx.settings.spool_dir, store, handle_none)

    async def finish(self):
        """The database back for good, the spool drained, and time enough for every
        retry and lease."""
        if self.is_down:
            await self.do("database up")
        await inbox.drain_spool(self.ctx)
        # Each try of an order's first unfinished call at most: every call's last retry.
        for _ in range(3 * sum(map(len, self.sent.values())) + 1):
            self.clock.advance(seconds=lease(self.ctx).total_seconds() + 3600)
            await inbox.retry_due(self.ctx)
            if not WebhookEvent.select().where(
                    WebhookEvent.status.in_(inbox.AWAITING_HANDLING)).exists():
                return


@pytest.fixture
def fresh(ctx, db, clock):
    """Before each example: empty tables, an empty spool, nothing remembered."""
    recorder = Recorder()
    ctx.plugins = {**ctx.plugins, SOURCE: recorder.registry}

    def reset():
        start_afresh(ctx, db)
        recorder.handled.clear()
        clock.set(2026, 11, 20, 9, 0)
        return recorder
    return reset


@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=15, max_size=40))
def test_each_streams_calls_are_handled_once_in_their_senders_order(
        steps, fresh, ctx, clock, db, io_loop):
    recorder = fresh()
    run = Run(ctx, clock, db)

    async def scenario():
        try:
            for action in steps:
                await run.do(*action)
            await run.finish()
        finally:
            run.down.close()
    io_loop.run_sync(scenario, timeout=120)

    for order, sent in run.sent.items():
        handled = [call for call in recorder.handled if call[0] == order]
        assert sorted(seq for _, seq, _, _ in handled) == sent, (order, steps)
        if order is None:  # a call of no stream waits for nothing and is never history
            assert not any(history for *_, history in handled)
            continue
        for place, (_, seq, version, history) in enumerate(handled):
            # History exactly when a later version of its stream was handled before it.
            assert history == any(earlier[2] > version for earlier in handled[:place]), \
                (order, seq, handled, steps)
    assert not WebhookEvent.select().where(WebhookEvent.status != "processed").exists()

