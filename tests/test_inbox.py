"""The inbox stores what arrives, once, whatever text it carries."""
import asyncio
import datetime

import pytest

from models import Outbox, WebhookEvent
from plugins import registries
from plugins.card import EACH_EVENT
from engine import inbox, spool
from tests.door import through_the_door
from tests.service_process import database_down


def test_a_nul_in_stored_text_is_kept_as_a_replacement_character(ctx):
    event, created = through_the_door(
        inbox.store, ctx, "card", "charge.dispute.created", "k-nul", b'{"id": "evt_1"}\x00',
        external_id="evt\x00_1", order_number="FO-\x001")
    stored = WebhookEvent.get_by_id(event.id)
    assert created
    assert (stored.order_number, stored.external_id) == ("FO-\ufffd1", "evt\ufffd_1")
    assert stored.payload == '{"id": "evt_1"}\ufffd'


def test_a_second_record_of_the_same_key_returns_the_first(ctx):
    first, created = through_the_door(inbox.store, ctx, "card", "invoice.paid", "k-1", b"{}")
    again, created_again = through_the_door(inbox.store, ctx, "card", "invoice.paid", "k-1",
                                            b'{"x": 1}')
    assert created and not created_again and again.id == first.id
    assert WebhookEvent.select().count() == 1


@pytest.mark.gen_test
async def test_a_rejected_event_keeps_its_status_and_reason_when_processed(ctx):
    event, _ = through_the_door(inbox.store, ctx, "crypto", "malformed", "k-bad", b"not json",
                            status="rejected", last_error="body is not JSON")
    assert await inbox.process(ctx, event) == "rejected"
    stored = WebhookEvent.get_by_id(event.id)
    assert (stored.status, stored.last_error) == ("rejected", "body is not JSON")


@pytest.fixture
def card_plugin():
    """A plain card plugin of the test's own, under an event type no real one uses."""
    registry = registries()["card"]
    added = []

    def register(event_type, plugin):
        registry.register(event_type, EACH_EVENT)(plugin)
        added.append(event_type)
    yield register
    for event_type in added:
        del registry._plugins[event_type]


@pytest.mark.gen_test
async def test_a_plain_plugin_that_raises_leaves_its_event_stored_as_failed(ctx, card_plugin):
    def handle(ctx, event, effects):
        effects.alert("never sent", purpose="test")
        raise RuntimeError("cannot handle this")
    card_plugin("test.raises", handle)
    event, created, outcome = await inbox.accept(ctx, "card", "test.raises", "k-raise", b"{}")
    stored = WebhookEvent.get_by_id(event.id)
    assert (created, outcome) == (True, "failed")
    assert (stored.status, stored.attempts) == ("failed", 1)
    assert stored.last_error == "RuntimeError: cannot handle this"
    assert stored.next_attempt_at is not None and stored.processed_at is None
    assert not Outbox.select().exists()  # the plugin's effects went with its changes


@pytest.mark.gen_test
async def test_a_new_call_handled_at_once_is_written_once_as_processed(ctx, card_plugin):
    """Stored as processed in the transaction that handles it: no UPDATE of the row
    when the handling goes well (tests/test_round_trips.py counts the statements); a
    rejection still ends it rejected."""
    card_plugin("test.fine", lambda ctx, event, effects: None)
    card_plugin("test.refused", lambda ctx, event, effects: effects.reject("no such move"))
    fine = (await inbox.accept(ctx, "card", "test.fine", "k-fine", b"{}"))[0]
    refused = (await inbox.accept(ctx, "card", "test.refused", "k-refused", b"{}"))[0]
    stored = WebhookEvent.get_by_id(fine.id)
    assert (stored.status, stored.attempts) == ("processed", 1)
    assert stored.processed_at >= stored.received_at
    stored = WebhookEvent.get_by_id(refused.id)
    assert (stored.status, stored.last_error, stored.attempts) == ("rejected", "no such move", 1)


@pytest.mark.gen_test
async def test_a_call_is_handled_once_however_often_it_is_accepted(ctx, card_plugin):
    runs = []
    card_plugin("test.counted", lambda ctx, event, effects: runs.append(event))
    first = await inbox.accept(ctx, "card", "test.counted", "k-once", b'{"n": 1}')
    again = await inbox.accept(ctx, "card", "test.counted", "k-once", b'{"n": 1}')
    assert first[1:] == (True, "processed") and again[1:] == (False, None)
    assert again[0].id == first[0].id and runs == [{"n": 1}]


@pytest.mark.gen_test
async def test_a_call_accepted_in_the_background_is_handled_after_the_answer(
        ctx, card_plugin):
    card_plugin("test.later", lambda ctx, event, effects: None)
    event, created, outcome = await inbox.accept(ctx, "card", "test.later", "k-later", b"{}",
                                                 in_background=True)
    assert (created, outcome) == (True, None)
    assert WebhookEvent.get_by_id(event.id).status == "received"
    await ctx.drain_background()
    assert WebhookEvent.get_by_id(event.id).status == "processed"


@pytest.mark.gen_test
async def test_a_call_is_kept_when_recording_its_failed_handling_fails_too(
        ctx, card_plugin, monkeypatch):
    def handle(ctx, event, effects):
        raise RuntimeError("cannot handle this")
    card_plugin("test.worse", handle)
    record_failure = inbox._record_failure
    calls = []

    def failing_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise TypeError("a bug in recording the failure")
        return record_failure(*args)
    monkeypatch.setattr(inbox, "_record_failure", failing_once)
    event, created, outcome = await inbox.accept(ctx, "card", "test.worse", "k-worse", b"{}")
    # Stored alone after the combined unit failed, then handled as a stored event.
    assert (created, outcome) == (True, "failed")
    assert WebhookEvent.get_by_id(event.id).status == "failed"
    assert len(calls) == 2


@pytest.mark.gen_test
async def test_a_failure_whose_text_has_a_nul_is_recorded_cleaned(ctx, card_plugin):
    # PostgreSQL cannot store a NUL in text: uncleaned, the failure was never recorded.
    def handle(ctx, event, effects):
        raise RuntimeError("bad value 'x\x00y'\n" + "y" * 5000)
    card_plugin("test.nul", handle)
    event, created, outcome = await inbox.accept(ctx, "card", "test.nul", "k-nul-error", b"{}")
    stored = WebhookEvent.get_by_id(event.id)
    assert (created, outcome) == (True, "failed")
    assert (stored.status, stored.attempts) == ("failed", 1)
    assert stored.last_error.startswith("RuntimeError: bad value 'x y' yyy")
    assert len(stored.last_error) <= 500


@pytest.mark.gen_test
async def test_an_event_due_behind_a_slow_one_is_not_handled_twice(ctx, card_plugin, clock):
    """The inbox retry's leases cover the handling being done: an event waiting behind a
    slow one is not held under a lease that runs out while it waits, for another process
    to take it too."""
    clock.set(2026, 11, 23, 9, 0, 0)
    runs = []

    async def slow(ctx, event, effects):
        runs.append("slow")
        if len(runs) == 1:
            # Slower than a lease; meanwhile another process's retry run comes.
            clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)
            await inbox.retry_due(ctx)

    async def quick(ctx, event, effects):  # async: nothing re-checks its status first
        runs.append("quick")
    card_plugin("test.slow", slow)
    card_plugin("test.quick", quick)
    for event_type in ("test.slow", "test.quick"):
        event, _ = through_the_door(inbox.store, ctx, "card", event_type,
                                    f"k-{event_type}", b"{}", status="failed")
        WebhookEvent.update(next_attempt_at=clock()).where(
            WebhookEvent.id == event.id).execute()

    await inbox.retry_due(ctx)
    assert runs.count("quick") == 1
    assert {e.status for e in WebhookEvent.select()} == {"processed"}


async def lease_of(ctx, event_id):
    return await ctx.db(lambda: WebhookEvent.get_by_id(event_id).next_attempt_at)


async def until(condition):
    """Wait until `await condition()` is true, for 10 s at most, then go on: the test's
    assertions say what did not happen (without a keeper, a lease is never re-taken)."""
    for _ in range(100):
        if await condition():
            return
        await asyncio.sleep(0.1)


async def half_leases_pass(ctx, clock, event_id, count):
    """Let `count` half leases pass on the clock, each time until the event's lease is
    re-taken."""
    for _ in range(count):
        before = await lease_of(ctx, event_id)
        clock.advance(seconds=ctx.settings.claim_lease_seconds / 2)
        await until(lambda: _moved(ctx, event_id, before))


async def _moved(ctx, event_id, before):
    return await lease_of(ctx, event_id) != before


async def _logged(caplog, text):
    return text in caplog.text


def due_event(ctx, clock, event_type):
    """A failed card event of `event_type` whose retry time has come."""
    event, _ = through_the_door(inbox.store, ctx, "card", event_type, f"k-{event_type}",
                                b"{}", status="failed")
    WebhookEvent.update(next_attempt_at=clock()).where(WebhookEvent.id == event.id).execute()
    return event


@pytest.mark.gen_test(timeout=30)
async def test_the_inbox_retry_hands_events_over_while_an_earlier_one_is_slow(
        ctx, card_plugin, clock):
    """Two due events that wait for nothing of each other (of no stream, or of two): the
    first one's handling waits (Stripe slow); the second is handled meanwhile, in the same
    run, not after it. A backlog over many streams drains side by side."""
    clock.set(2026, 11, 23, 9, 0, 0)
    let_go, handled = asyncio.Event(), []

    async def slow(ctx, event, effects):
        await let_go.wait()
        handled.append("slow")

    async def quick(ctx, event, effects):
        handled.append("quick")
    card_plugin("test.waits", slow)
    card_plugin("test.goes", quick)
    due_event(ctx, clock, "test.waits")
    due_event(ctx, clock, "test.goes")
    run = asyncio.ensure_future(inbox.retry_due(ctx))
    for _ in range(200):
        if handled or run.done():
            break
        await asyncio.sleep(0.05)
    assert handled == ["quick"]
    let_go.set()
    assert await run == 2
    assert handled == ["quick", "slow"]
    assert {e.status for e in WebhookEvent.select()} == {"processed"}


@pytest.mark.gen_test(timeout=60)
async def test_an_event_handled_for_longer_than_a_lease_keeps_its_lease(ctx, card_plugin, clock):
    """An async plugin slower than a whole lease (a Stripe lookup on a bad day): its
    event's lease is re-taken while it runs, so another process's retry run meanwhile
    does not take the event too."""
    clock.set(2026, 11, 23, 9, 0, 0)
    runs, taken_elsewhere = [], []

    async def slow(ctx, payload, effects):
        runs.append("slow")
        if len(runs) == 1:
            await half_leases_pass(ctx, clock, event.id, 3)
            taken_elsewhere.append(await inbox.retry_due(ctx))
    card_plugin("test.slower", slow)
    event = due_event(ctx, clock, "test.slower")

    assert await inbox.retry_due(ctx) == 1
    assert (runs, taken_elsewhere) == (["slow"], [0])
    assert WebhookEvent.get_by_id(event.id).status == "processed"


@pytest.mark.gen_test(timeout=60)
async def test_a_drained_call_waiting_behind_a_slow_one_keeps_its_lease(ctx, card_plugin, clock):
    """Spooled calls of one order are handled one after another: the second one's lease,
    taken when it was stored, is kept while the first one's handling lasts longer than a
    lease, so another process's retry run does not handle it meanwhile."""
    clock.set(2026, 11, 23, 9, 0, 0)
    runs, taken_elsewhere = [], []
    for number, event_type in enumerate(("test.first", "test.second")):
        spool.append(ctx.settings.spool_dir, {
            **inbox._call(ctx, "card", event_type, f"k-drained-{number}", b"{}",
                          order_number="FO-LEASE"),
            "received_at": clock().isoformat()})

    async def first(ctx, payload, effects):
        runs.append("first")
        if runs != ["first"]:
            return
        second = await ctx.db(lambda: WebhookEvent.get(event_type="test.second"))
        await half_leases_pass(ctx, clock, second.id, 3)
        taken_elsewhere.append(await inbox.retry_due(ctx))

    async def second(ctx, payload, effects):
        runs.append("second")
    card_plugin("test.first", first)
    card_plugin("test.second", second)

    assert await inbox.drain_spool(ctx) == 2
    assert (runs, taken_elsewhere) == (["first", "second"], [0])
    assert {e.status for e in WebhookEvent.select()} == {"processed"}


@pytest.mark.gen_test(timeout=60)
async def test_a_kept_lease_another_process_took_meanwhile_is_let_go(
        ctx, card_plugin, clock, caplog):
    """Compare-and-set: once the row holds a lease this process did not take (another
    process claimed it while the database was out of reach, say), the keeper leaves
    that lease alone rather than take the row back."""
    clock.set(2026, 11, 23, 9, 0, 0)
    theirs, seen = clock() + datetime.timedelta(hours=1), []

    async def slow(ctx, payload, effects):
        await ctx.db(lambda: WebhookEvent.update(next_attempt_at=theirs).where(
            WebhookEvent.id == event.id).execute())
        clock.advance(seconds=ctx.settings.claim_lease_seconds / 2)
        await until(lambda: _logged(caplog, "no longer held here"))
        seen.append(await lease_of(ctx, event.id))
    card_plugin("test.overtaken", slow)
    event = due_event(ctx, clock, "test.overtaken")

    assert await inbox.retry_due(ctx) == 1
    assert f"event #{event.id}: its lease is no longer held here" in caplog.text
    assert seen == [theirs]


@pytest.mark.gen_test(timeout=60)
async def test_a_lease_that_cannot_be_re_taken_is_tried_again_at_the_next_look(
        ctx, db, card_plugin, clock, caplog):
    """The database out of reach when the lease is due for re-taking: logged, and
    re-taken at the keeper's next look once it answers again."""
    clock.set(2026, 11, 23, 9, 0, 0)
    leases = []

    async def slow(ctx, payload, effects):
        leases.append(await lease_of(ctx, event.id))
        with database_down(db):
            clock.advance(seconds=ctx.settings.claim_lease_seconds / 2)
            await until(lambda: _logged(caplog, "lease(s) could not be re-taken"))
        await until(lambda: _moved(ctx, event.id, leases[0]))
        leases.append(await lease_of(ctx, event.id))
    card_plugin("test.unreachable", slow)
    event = due_event(ctx, clock, "test.unreachable")

    assert await inbox.retry_due(ctx) == 1
    assert "1 lease(s) could not be re-taken" in caplog.text
    assert leases == [leases[0], clock() + datetime.timedelta(
        seconds=ctx.settings.claim_lease_seconds)]
