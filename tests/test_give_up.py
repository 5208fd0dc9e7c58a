"""Giving events up, one at a time or all those a filter finds, and retrying them in bulk,
from the console and the command line: a given-up event is dead and final, as the retry
policy's give-up, with who, when and why kept on it and shown on its page and its order's
timeline; an event a handling may hold is left as it is."""
import datetime
import re

import hypothesis
import pytest
from hypothesis import strategies as st

from engine import inbox
from engine.transaction import Transaction
from models import ConsoleAction, Outbox, WebhookEvent
from ops import console
from ops import operator as ops_operator
from tests.console_helpers import (  # noqa: F401 (fixtures)
    console_settings, logged_in, notice, operator, refused, text,
)
from tests.door import through_the_door
from tests.test_cli import at, outbox_row, run, stored_event
from tests.test_ops_endpoints import samples, value

NOW = (2026, 11, 23, 12, 0)


@pytest.fixture
def settings(settings):
    return console_settings(settings)


def failed_event(next_try=at(2026, 11, 23, 13, 0), **fields):
    """An event whose handling failed, its next try at `next_try` (beyond a lease: no
    handling holds it)."""
    event = stored_event(status="failed", received=at(2026, 11, 23, 9, 0),
                         last_error="KeyError: state_code", **fields)
    WebhookEvent.update(next_attempt_at=next_try, attempts=2).where(
        WebhookEvent.id == event.id).execute()
    return WebhookEvent.get_by_id(event.id)


def given_up_record(event_id):
    event = WebhookEvent.get_by_id(event_id)
    return event.status, event.given_up_by, event.given_up_at, event.given_up_reason


@pytest.mark.gen_test(timeout=60)
async def test_a_failed_event_is_given_up_with_its_reason_kept_and_shown(logged_in, clock):
    clock.set(*NOW)
    event = failed_event(order_number="FO-7")
    assert (await logged_in.post(f"/console/events/{event.id}/give-up")).code == 400
    response, page = await logged_in.act(f"/console/events/{event.id}/give-up",
                                         {"reason": "duplicate of FO-6, refunded"})
    assert response.headers["Location"] == f"/console/events/{event.id}"
    assert notice(page).startswith(f"Event #{event.id} given up, with your reason: it is "
                                   "dead and final")
    assert given_up_record(event.id) == ("dead", "Dana", clock(), "duplicate of FO-6, refunded")
    assert re.search(r'<dd id="event-given-up">by Dana at 2026-11-23 12:00:00 UTC: '
                     r'duplicate of FO-6, refunded</dd>', text(page))
    assert 'action="/console/events/%d/give-up"' % event.id not in text(page)
    timeline = text(await logged_in.get("/console/orders/FO-7"))
    assert re.search(r"given up by Dana</td>.*?duplicate of FO-6, refunded", timeline, re.S)
    listed = text(await logged_in.get("/console/events?status=dead"))
    assert "dead (given up by Dana)" in listed and 'class="status bad"' not in listed
    assert [(a.operator, a.action, a.target, a.outcome) for a in ConsoleAction.select()
            .where(ConsoleAction.action == "give up event")] == [
        ("Dana", "give up event", str(event.id), "duplicate of FO-6, refunded")]
    # It no longer counts among the failures that need someone.
    overview = text(await logged_in.get("/console/"))
    assert "1 given up by operators" in overview
    assert 'href="/console/events?status=dead"' not in overview


@pytest.mark.gen_test(timeout=60)
async def test_a_given_up_event_is_final(logged_in, ctx, clock, database_url, worker):
    clock.set(*NOW)
    event = failed_event(next_try=at(2026, 11, 23, 12, 5))
    clock.set(2026, 11, 23, 11, 0)  # its next try more than a lease away
    await logged_in.act(f"/console/events/{event.id}/give-up", {"reason": "test order"})
    clock.set(2026, 11, 23, 12, 10)  # past the time its retry would have come
    assert await inbox.retry_due(ctx) == 0
    assert (await ops_operator.replay_failed(ctx)) == []
    _, page = await logged_in.act(f"/console/events/{event.id}/replay")
    assert refused(page) and "was given up by Dana" in notice(page)
    assert 'name="confirm"' in text(page)
    replayed = run(database_url, "events", "replay", str(event.id))
    assert replayed.returncode == 1 and "was given up by Dana" in replayed.stderr
    assert given_up_record(event.id)[0] == "dead" and worker.requests == []
    # Forced, it is handled again, and no longer given up (the record of actions keeps it).
    _, page = await logged_in.act(f"/console/events/{event.id}/replay", {"confirm": "yes"})
    assert "it is now processed" in notice(page)
    assert given_up_record(event.id) == ("processed", None, None, None)
    assert [a.action for a in ConsoleAction.select().order_by(ConsoleAction.id)][-3:] == [
        "give up event", "replay event", "replay event"]


@pytest.mark.gen_test(timeout=60)
async def test_an_event_a_handling_may_hold_is_left_as_it_is(logged_in, clock):
    clock.set(*NOW)
    claimed = failed_event(next_try=at(2026, 11, 23, 12, 0, 40))  # within a lease
    page = text(await logged_in.get(f"/console/events/{claimed.id}"))
    assert 'id="event-held"' in page and "Give up</button>" not in page
    _, page = await logged_in.act(f"/console/events/{claimed.id}/give-up", {"reason": "x"})
    assert refused(page) and f"event #{claimed.id} may be being handled right now" in notice(page)
    assert given_up_record(claimed.id)[:2] == ("failed", None)
    processed = stored_event(status="processed")
    _, page = await logged_in.act(f"/console/events/{processed.id}/give-up", {"reason": "x"})
    assert refused(page) and "is processed: only a failed event" in notice(page)
    assert (await logged_in.post("/console/events/999999/give-up", {"reason": "x"})).code == 404


def waiting_fact(waiting_for):
    fact = stored_event(source="card", event_type="invoice.paid", status="waiting",
                        received=at(2026, 11, 23, 9, 0), order_number=None)
    WebhookEvent.update(waiting_for=waiting_for, next_attempt_at=at(2026, 11, 23, 13, 0)).where(
        WebhookEvent.id == fact.id).execute()
    return fact


def test_a_fact_its_order_woke_since_it_was_read_is_not_given_up(ctx, clock, monkeypatch):
    """Between the give-up's read of a waiting fact and its write, its order comes: the
    wake made it due, to be handled; the give-up leaves it so, and says what it is now.
    Another fact, still waiting, is given up."""
    clock.set(*NOW)
    woken, still = waiting_fact("subscription:sub_test_1"), waiting_fact("invoice:in_test_2")
    through_the_door(Transaction(ctx).wake_facts, ["subscription:sub_test_1"], clock())
    read, stale = ops_operator.get_event, ["waiting"]

    def read_before_the_wake(event_id):
        """The give-up's first read of the fact, as it was before its wake committed."""
        event = read(event_id)
        if stale:
            event.status = stale.pop()
        return event

    monkeypatch.setattr(ops_operator, "get_event", read_before_the_wake)
    with pytest.raises(ops_operator.Refused, match=f"event #{woken.id} is received: only"):
        through_the_door(ops_operator.give_up_event, ctx, woken.id, "test mode",
                         ("Dana", "127.0.0.1"))
    assert stale == [] and given_up_record(woken.id) == ("received", None, None, None)
    assert ConsoleAction.select().count() == 0
    through_the_door(ops_operator.give_up_event, ctx, still.id, "test mode",
                     ("Dana", "127.0.0.1"))
    assert given_up_record(still.id) == ("dead", "Dana", clock(), "test mode")
    assert [(a.action, a.target) for a in ConsoleAction.select()] == [
        ("give up event", str(still.id))]


@pytest.mark.parametrize("status,next_try,received,held", [
    ("failed", None, datetime.timedelta(minutes=-5), False),
    ("failed", None, datetime.timedelta(seconds=-30), True),
    ("failed", datetime.timedelta(seconds=30), datetime.timedelta(hours=-1), True),
    ("failed", datetime.timedelta(seconds=60), datetime.timedelta(hours=-1), True),
    ("failed", datetime.timedelta(seconds=61), datetime.timedelta(hours=-1), False),
    ("failed", datetime.timedelta(0), datetime.timedelta(hours=-1), False),
    ("received", None, datetime.timedelta(seconds=-59), True),
    ("received", None, datetime.timedelta(seconds=-61), False),
    ("dead", datetime.timedelta(seconds=30), datetime.timedelta(hours=-1), False),
    ("processed", None, datetime.timedelta(0), False),
])
def test_the_pages_and_the_actions_keep_one_rule(ctx, clock, status, next_try, received,
                                                 held):
    """What a page offers (`in_flight`) is what an action does (`not_in_flight`)."""
    clock.set(*NOW)
    event = stored_event(status=status, received=clock() + received)
    WebhookEvent.update(next_attempt_at=None if next_try is None else clock() + next_try).where(
        WebhookEvent.id == event.id).execute()
    event = WebhookEvent.get_by_id(event.id)
    free = through_the_door(lambda: WebhookEvent.select().where(
        WebhookEvent.id == event.id, ops_operator.not_in_flight(ctx, WebhookEvent)).count())
    assert (ops_operator.in_flight(ctx, event), free) == (held, int(not held))


SECONDS = st.one_of(st.none(), st.integers(-3600, 3600),
                    st.sampled_from([-61, -60, -59, -1, 0, 1, 59, 60, 61]))


@hypothesis.settings(max_examples=150, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(kind=st.sampled_from(["event", "effect"]),
                  status=st.sampled_from([*ops_operator.EVENT_STATUSES,
                                          *ops_operator.OUTBOX_STATUSES]),
                  next_try=SECONDS, received=st.integers(-3600, 0))
def test_a_page_and_an_action_see_a_row_in_flight_alike_at_any_time(ctx, clock, kind, status,
                                                                    next_try, received):
    """For any row at any moment, the page's `in_flight` (its buttons) and the action's
    `not_in_flight` (its statement) agree."""
    clock.set(*NOW)
    moment = None if next_try is None else clock() + datetime.timedelta(seconds=next_try)
    if kind == "event":
        row = stored_event(status=status, received=clock() + datetime.timedelta(
            seconds=received))
        WebhookEvent.update(next_attempt_at=moment).where(WebhookEvent.id == row.id).execute()
        model = WebhookEvent
    else:
        row = outbox_row(status=status)
        Outbox.update(next_attempt_at=moment or clock()).where(Outbox.id == row.id).execute()
        model = Outbox
    try:
        row = model.get_by_id(row.id)
        free = through_the_door(lambda: model.select().where(
            model.id == row.id, ops_operator.not_in_flight(ctx, model)).count())
        assert free == int(not ops_operator.in_flight(ctx, row))
    finally:
        model.delete().where(model.id == row.id).execute()


@pytest.mark.gen_test(timeout=60)
async def test_the_events_a_filter_finds_are_retried_or_given_up_at_once(
        logged_in, ctx, clock, worker, frappe):
    clock.set(*NOW)
    card = [failed_event(source="card", event_type="x", order_number=f"CO-{n}")
            for n in range(3)]
    dead_card = failed_event(source="card", event_type="x", order_number="CO-9")
    WebhookEvent.update(status="dead").where(WebhookEvent.id == dead_card.id).execute()
    # Of an order of its own: an unfinished event holds its order's later ones.
    held = failed_event(source="card", event_type="x", order_number="CO-8",
                        next_try=at(2026, 11, 23, 12, 0, 30))
    done = stored_event(source="card", event_type="x", status="processed", order_number="CO-7")
    workflow = [failed_event(order_number=f"FO-{n}") for n in range(2)]

    page = text(await logged_in.get("/console/events?source=card&status=failed"))
    assert "<strong>4</strong> failed event(s) this filter finds" in page
    assert "Retry 4</button>" in page and "Give up 4</button>" in page
    page = text(await logged_in.get("/console/events?source=card&status=dead"))
    assert "<strong>1</strong> dead event(s) this filter finds" in page
    for elsewhere in ("/console/events?status=processed", "/console/events?source=card"):
        page = text(await logged_in.get(elsewhere))
        assert 'id="bulk"' not in page and "Filter by status" in page

    response, page = await logged_in.act("/console/events/give-up", {
        "source": "card", "status": "failed", "reason": "test orders, never paid"})
    assert response.headers["Location"] == "/console/events?source=card&status=failed"
    assert notice(page).startswith("3 event(s) given up, with your reason")
    assert {given_up_record(e.id)[0:2] for e in card} == {("dead", "Dana")}
    assert given_up_record(held.id)[:2] == ("failed", None)  # being handled, maybe
    assert given_up_record(dead_card.id)[:2] == ("dead", None)
    assert given_up_record(done.id)[:2] == ("processed", None)

    response, page = await logged_in.act("/console/events/retry",
                                         {"source": "workflow", "status": "failed"})
    assert response.headers["Location"] == "/console/events?source=workflow&status=failed"
    assert notice(page).startswith("2 event(s) back in line, due now: the scheduler handles "
                                   "them at its next runs, oldest first")
    assert {(e.status, e.attempts, e.next_attempt_at) for e in WebhookEvent.select().where(
        WebhookEvent.id.in_([e.id for e in workflow]))} == {("failed", 0, clock())}
    assert await inbox.retry_due(ctx) == 2
    assert {WebhookEvent.get_by_id(e.id).status for e in workflow} == {"processed"}
    _, page = await logged_in.act("/console/events/retry",
                                  {"source": "workflow", "status": "failed"})
    assert refused(page) and notice(page).startswith("No event retried")
    for form in ({"source": "card", "status": "failed"},  # no reason
                 {"source": "card", "reason": "x"}, {"status": "processed", "reason": "x"}):
        assert (await logged_in.post("/console/events/give-up", form)).code == 400, form
    assert (await logged_in.post("/console/events/retry", {"source": "card"})).code == 400
    actions = [(a.action, a.target) for a in ConsoleAction.select().where(
        ConsoleAction.action.in_(["give up event", "retry event"]))]
    assert sorted(actions) == sorted([("give up event", str(e.id)) for e in card]
                                     + [("retry event", str(e.id)) for e in workflow])
    exposition = samples(await ctx.metrics.exposition(ctx))
    assert value(exposition, "receiver_events_given_up") == 3
    assert value(exposition, "receiver_events_dead") == 1


def test_the_command_line_gives_events_up_as_the_console_does(database_url):
    card = failed_event(source="card", event_type="x")
    crypto = failed_event(source="crypto", event_type="x", order_number="CA-1")
    other = failed_event(source="crypto", event_type="x", order_number="CA-2")
    done = stored_event(status="processed")

    missing = run(database_url, "events", "give-up", str(card.id))
    assert missing.returncode == 2 and "--reason" in missing.stderr
    one = run(database_url, "events", "give-up", str(card.id), "--reason", "test order")
    assert one.returncode == 0 and one.stdout == f"event #{card.id} given up: dead and final\n"
    (status, by, _, reason) = given_up_record(card.id)
    assert (status, reason) == ("dead", "test order") and by.endswith("(command line)")
    again = run(database_url, "events", "give-up", str(card.id), "--reason", "x")
    assert again.returncode == 1 and "was given up already" in again.stderr
    assert run(database_url, "events", "give-up", str(done.id), "--reason", "x").returncode == 1
    bulk = run(database_url, "events", "give-up", "--failed", "--source", "crypto",
               "--until", "2026-11-23T10:00Z", "--reason", "old test orders")
    assert bulk.returncode == 0 and bulk.stdout.startswith("2 event(s) given up")
    assert {given_up_record(e.id)[0] for e in (crypto, other)} == {"dead"}
    listed = run(database_url, "events", "list", "--status", "dead")
    assert listed.stdout.count("dead (given up)") == 3
    shown = run(database_url, "events", "show", str(card.id))
    assert re.search(r"given up:\s+by .+ \(command line\) at .+: test order", shown.stdout)
    assert through_the_door(console.recent_actions)[0].action == "give up event"
