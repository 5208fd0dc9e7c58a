"""The engine's cost, pinned: statements and round trips per webhook, per turn of the
group commit and per drain of the outbox, counted (bench/statements.py). On PostgreSQL
each round trip is a wait of the one database thread. The counts are deterministic, so
each is held to an upper bound (or an exact number) here; a change that adds a
statement, or a round trip on PostgreSQL, fails this file.

These numbers are expected to change with a deliberate change of the engine: change them
in the same commit, with the measurement that justifies it (bench/, docs/PERFORMANCE.md
give the numbers and why). Every other test file asserts behaviour only; this is the one
place where what the engine costs is held."""
import asyncio
import datetime
import zoneinfo
import threading

import pytest

from bench.statements import StatementCount
from engine import commits, outbox
from engine.commits import GroupCommit
from engine.outbox import Effects
from engine.prepared import InsertOnce
from models import Attempt, CrtcOrder, FormationOrder, Outbox, WebhookEvent, database
from tests import shkeeper
from tests import stripe_events as se
from tests.test_order_names import FRAPPE_HEADERS, frappe_body
from tests.door import name_search_jobs
from tests.waits import eventually
from tests.test_held_writes import (  # noqa: F401 (fixtures)
    orders, paid, postgres_only, server_waits, stored_statuses)

# The statements one webhook costs today, from its request to its response (on SQLite;
# on PostgreSQL the first two go as one, below): the event's INSERT (only if no event is
# stored under an earlier key of its dedup window: no read of its own), the order's read,
# per effect an outbox INSERT (a job's or action's also says whether an earlier one of
# its order is unsent), then the UPDATE of its send outcome; with BEGIN and COMMIT of
# both transactions. An event of a stream (a workflow webhook, a crypto callback) is
# stored as received and costs two more: the read of its place in its stream, its row
# locked (engine.inbox.POSITION: whether it waits behind an earlier one, or a later one
# was handled), and the UPDATE that finishes it. A card payment (checkout.session.
# completed, of no stream: stored as processed, handled in the unit that stores it) costs
# 13: the 9 of its handling, the UPDATE that makes the card facts waiting for its payment
# intent due (held: on PostgreSQL it goes with the next statement), and, after the
# answer, the claim of those facts to hand them over (BEGIN, UPDATE, COMMIT; none may
# wait, but which is not known without a round trip on the request path); a crypto
# payment 14, its background handling included (the DELETE of its order's fallback
# ledger entry among them, which a callback listing its transactions sends whether or
# not there is one: held, it costs no round trip). Each payment's order changes also
# cost the INSERT of their history (models.OrderChange), one statement for all its
# fields, held: on PostgreSQL it goes with the next statement, no round trip more.
WORKFLOW_BOUNDS = {"formation/submitted": 12, "formation/ready": 10}
# The round trips those cost on PostgreSQL, where a turn's BEGIN goes with its first
# statement and the writes whose result nobody reads (an UPDATE of an order, of an
# event's status, of a send's outcome, a crypto payment's treasury job and ledger entry)
# go with the next statement or the COMMIT, and the event's INSERT and the order's read
# are one statement (engine.commits.Ahead): for formation/ready, the INSERT of the event
# with the order's read, its place in its stream, the job's INSERT and the COMMIT, then
# the outcome's UPDATE with its BEGIN and COMMIT; formation/submitted the same, its
# workflow action and job in one INSERT and their outcomes in one round trip.
WORKFLOW_ROUND_TRIPS = {"formation/submitted": 5, "formation/ready": 5}
# A card payment's 4 on the request path, and the 2 of its background claim (above).
CARD_ROUND_TRIPS, CRYPTO_ROUND_TRIPS = 6, 5
WEBHOOKS = 8


def within(count, database_url, statements, round_trips):
    assert count.total <= statements, count.total
    if database_url.startswith("postgres"):
        assert count.round_trips <= round_trips, count.round_trips
    else:
        assert count.round_trips == count.total  # no round trip to save in the process


@pytest.mark.gen_test
@pytest.mark.parametrize("stored", [True, False], ids=["order stored", "order not stored"])
@pytest.mark.parametrize("path", sorted(WORKFLOW_BOUNDS))
async def test_a_workflow_webhook_stays_within_its_statements(path, stored, post, worker,
                                                              frappe, database_url):
    """The order's document name is read in one statement for every kind of order, so an
    order not stored here (looked for in each kind's table) costs no more."""
    if stored:
        FormationOrder.create(order_number="FO-7", order_name="FORM-7")
    body = {"order_name": "FORM-7", "order_number": "FO-7", "state_code": "DE",
            "entity_name": "Acme LLC"}
    with StatementCount().open() as count:
        status, _, _ = await post(f"/api/v1/webhooks/{path}", frappe_body(body),
                                  FRAPPE_HEADERS)
    assert status == 200
    within(count, database_url, WORKFLOW_BOUNDS[path], WORKFLOW_ROUND_TRIPS[path])


@pytest.mark.gen_test
@pytest.mark.parametrize("minutes_late", [0, 10], ids=["in time", "late"])
async def test_a_webhook_naming_its_change_pays_for_its_predecessors_and_its_same_stay(
        minutes_late, post, worker, frappe, clock, database_url):
    """A body with `modified` of a path that follows others (formation/ready follows
    formation/approved) costs five statements more than one without, however late it
    comes: whether a change of the document on such a path is stored
    (domain.reconcile.predecessors_first), read in a transaction of its own before the
    call is accepted (two round trips on PostgreSQL); and two SELECTs, whether a run or a
    later change's webhook found its change first in the workflow log
    (domain.reconcile.same_stay), asked only when no key of the call is stored, which is
    then read apart from the INSERT. On PostgreSQL that INSERT goes in a statement of its
    own, not with its order's name read ahead: three round trips more; and the same
    change's copies are read again once its stream is taken, one more, since another
    process may have committed one between (engine.inbox._copy_handled)."""
    # Frappe's local time: Asia/Kolkata when its System Settings name none.
    modified = (clock() - datetime.timedelta(minutes=minutes_late)).astimezone(
        zoneinfo.ZoneInfo("Asia/Kolkata"))
    body = {"order_name": "FORM-7", "order_number": "FO-7",
            "modified": modified.strftime("%Y-%m-%d %H:%M:%S.%f")}
    with StatementCount().open() as count:
        status, _, _ = await post("/api/v1/webhooks/formation/ready", frappe_body(body),
                                  FRAPPE_HEADERS)
    assert status == 200
    more = 6 if database_url.startswith("postgres") else 5
    within(count, database_url, WORKFLOW_BOUNDS["formation/ready"] + more,
           WORKFLOW_ROUND_TRIPS["formation/ready"] + more)


@pytest.mark.gen_test(timeout=30)
async def test_a_turn_of_webhooks_costs_three_round_trips_and_one_per_webhook(
        ctx, post, worker, frappe, database_url, monkeypatch):
    """Eight webhooks asked while the database thread is held share at most two turns.
    On PostgreSQL a turn costs its events' INSERT with its orders' names read (and the
    BEGIN), its jobs' INSERT and the COMMIT, as a webhook alone does, and one round trip
    per webhook more: its place in its stream, read in its own unit after its locks
    (engine.inbox.POSITION): 14 round trips for the eight, where each webhook's own
    statements cost 42 (counted until the jobs are at the worker, before their
    outcomes). Every call is stored and sent once."""
    count, answers = await in_held_turns(ctx, monkeypatch, worker, [post(
        "/api/v1/webhooks/formation/ready",
        frappe_body({"order_name": f"FORM-{n}", "order_number": f"FO-{n}"}),
        FRAPPE_HEADERS) for n in range(WEBHOOKS)])
    assert [status for status, _, _ in answers] == [200] * WEBHOOKS
    assert WebhookEvent.select().count() == WEBHOOKS
    assert sorted(request.json["order_number"] for request in worker.posts) == [
        f"FO-{n}" for n in range(WEBHOOKS)]
    assert Outbox.select().where(Outbox.status == "sent").count() == WEBHOOKS
    if database_url.startswith("postgres"):
        assert count.round_trips <= 2 * 3 + WEBHOOKS, count.round_trips


@pytest.mark.gen_test(timeout=30)
@pytest.mark.parametrize("receiver", ["card", "crypto"])
async def test_a_turn_of_payments_costs_three_round_trips_whatever_their_number(
        ctx, post, clock, telegram, database_url, monkeypatch, receiver):
    """Eight payments asked while the database thread is held share at most two turns.
    On PostgreSQL a turn costs its events' INSERT with its orders' read (locked; and the
    BEGIN), its alerts' INSERT and the COMMIT (a crypto payment's treasury job and
    ledger entry go with the next of those): 6 round trips for the eight, counted until
    their alerts are at Telegram, before their outcomes; a crypto callback, of its
    invoice's stream, one more each for its place in it (engine.inbox.POSITION)."""
    numbers = [f"CA-{1000 + n}" for n in range(WEBHOOKS)]
    for number in numbers:
        CrtcOrder.create(order_number=number)

    def pay(number):
        if receiver == "crypto":
            return post(shkeeper.URL, shkeeper.paid(number), shkeeper.key_headers())
        return se.deliver(post, clock, se.event("checkout.session.completed",
                                                se.checkout_session(number, "canada_crtc")))
    count, answers = await in_held_turns(ctx, monkeypatch, telegram,
                                         [pay(number) for number in numbers])
    statuses = [status for status, _, _ in answers]
    assert statuses == [202 if receiver == "crypto" else 200] * WEBHOOKS
    assert CrtcOrder.select().where(CrtcOrder.payment_status == "paid").count() == WEBHOOKS
    if database_url.startswith("postgres"):
        in_streams = WEBHOOKS if receiver == "crypto" else 0
        assert count.round_trips <= 2 * 3 + in_streams, count.round_trips


async def in_held_turns(ctx, monkeypatch, peer, calls):
    """`calls` asked while the database thread is held, so that they share at most two
    turns; their statements counted until each has its send at `peer`, which holds the
    sends until then. Returns (the count, the calls' answers)."""
    asked = []
    enqueue = ctx.commits._enqueue
    monkeypatch.setattr(ctx.commits, "_enqueue",
                        lambda *unit, **how: asked.append(unit) or enqueue(*unit, **how))
    held, peer.hold = threading.Event(), asyncio.Event()
    commits.DATABASE_THREAD.submit(held.wait, 10)
    with StatementCount().open() as count:
        answers = asyncio.gather(*calls)
        try:
            await eventually(lambda: len(asked) == len(calls), interval=0.01)
        finally:
            held.set()
        await eventually(lambda: peer.in_flight == len(calls), interval=0.01)
    peer.hold.set()
    return count, await answers


@pytest.fixture
def settings(settings):
    return se.with_payment_processors(settings)


@pytest.mark.gen_test
async def test_a_card_payment_stays_within_its_statements(post, ctx, clock, telegram,
                                                          database_url):
    FormationOrder.create(order_number="FO-1")
    paid = se.event("checkout.session.completed", se.checkout_session("FO-1", "formation"))
    with StatementCount().open() as count:
        assert (await se.deliver(post, clock, paid))[:2] == se.RECEIVED
        await ctx.drain_background()
    assert FormationOrder.get().payment_status == "paid"
    # 14: the background claim of the facts it woke makes them due again first
    # (engine.inbox.handle_woken), a write held for the claim's read; 15 with the
    # order's history.
    within(count, database_url, 15, CARD_ROUND_TRIPS)


@pytest.mark.gen_test
async def test_a_crypto_payment_stays_within_its_statements(post, ctx, telegram, database_url):
    CrtcOrder.create(order_number="CA-1001")
    with StatementCount().open() as count:
        status, _, _ = await post(shkeeper.URL, shkeeper.paid("CA-1001"), shkeeper.key_headers())
        await ctx.drain_background()
    assert status == 202 and CrtcOrder.get().payment_status == "paid"
    # 15: the kinds of the orders of its number, read to route it (treasury.Callback.routed),
    # a statement of its own on SQLite, on PostgreSQL read ahead with the order; and the
    # order's history, one more (held with the turn's writes on PostgreSQL).
    within(count, database_url, 16 if database_url.startswith("sqlite") else 15,
           CRYPTO_ROUND_TRIPS)


@pytest.mark.gen_test
async def test_a_drain_records_a_whole_batch_of_sends_in_one_statement(ctx, clock, worker,
                                                                        database_url):
    """A backlog is sent in batches of claimed rows; the rows a batch sent are marked in
    one UPDATE, not one each (each would hold the database thread, and the live
    requests' turns behind it, for a round trip)."""
    effects = Effects(ctx)
    name_search_jobs(effects, range(1, 51))
    clock.advance(minutes=5)  # past the lease their request held them under
    with StatementCount().open() as count:
        assert await outbox.send_due(ctx) == 50
    assert len(worker.requests) == 50
    assert Outbox.select().where(Outbox.status == "sent", Outbox.attempts == 1).count() == 50
    # Making waiting rows due, two claims (the second finds nothing left), each asking
    # the four kinds apart (engine.outbox._claim_due), one UPDATE for the 50 outcomes:
    # each in its transaction. One per row would be 50 and more. On PostgreSQL the
    # UPDATEs go with their COMMIT, each BEGIN with the next statement.
    within(count, database_url, 19, 14)


@pytest.mark.gen_test
async def test_a_drain_keeps_each_rows_own_attempt_in_its_one_statement(ctx, clock, worker):
    effects = Effects(ctx)
    name_search_jobs(effects, range(1, 21))
    clock.advance(minutes=5)
    with StatementCount().open() as count:
        assert await outbox.send_due(ctx) == 20
    tried = list(Attempt.select().order_by(Attempt.outbox_id))
    assert [attempt.outbox_id for attempt in tried] == [row.id for row in effects.rows]
    assert {(attempt.outcome, attempt.status_code) for attempt in tried} == {("sent", 200)}
    # Sending them one by one would cost over 40. Here: each of the two claims (the 20
    # rows, then none) asks the four kinds apart (engine.outbox._claim_due).
    assert count.total <= 19


# --- a turn of the group commit on PostgreSQL: the writes held, counted by the server's waits

NEW_EVENT = InsertOnce(WebhookEvent)


class Counted:
    """The database's own counts over a block, beside the waits counted here."""

    def __init__(self, waits):
        self.waits = waits

    def __enter__(self):
        self.before = (database.obj.statements, database.obj.round_trips, self.waits())
        return self

    def __exit__(self, *exc):
        statements, round_trips, waits = self.before
        self.statements = database.obj.statements - statements
        self.round_trips = database.obj.round_trips - round_trips
        self.server_waits = self.waits() - waits


async def in_one_counted_turn(server_waits, *units):  # noqa: F811
    """Run `units` together in one turn of a group commit whose connection is open
    already (opening it is not what is counted): their results, and the counts."""
    commits = GroupCommit()
    await commits.run(lambda: None)
    with Counted(server_waits) as count:
        results = await asyncio.gather(*(commits.run(unit) for unit in units))
    return results, count


@pytest.mark.gen_test
async def test_a_turn_of_writes_alone_is_one_round_trip(orders, server_waits):  # noqa: F811
    _, count = await in_one_counted_turn(server_waits, *(paid(order) for order in orders))
    assert set(stored_statuses().values()) == {"paid"}
    # BEGIN, three UPDATEs and the COMMIT, sent as one string.
    assert (count.statements, count.round_trips, count.server_waits) == (5, 1, 1)


@pytest.mark.gen_test
async def test_the_begin_goes_with_the_first_statement(server_waits):  # noqa: F811
    [new_id], count = await in_one_counted_turn(server_waits, lambda: NEW_EVENT.run(
        source="test", event_type="t", dedup_key="a", payload="{}"))
    assert WebhookEvent.get_by_id(new_id).dedup_key == "a"
    # BEGIN with the INSERT (whose new id is read), then the COMMIT.
    assert (count.statements, count.round_trips, count.server_waits) == (3, 2, 2)


@pytest.mark.gen_test
async def test_a_turn_that_asks_nothing_costs_no_round_trip(server_waits):  # noqa: F811
    [answer], count = await in_one_counted_turn(server_waits, lambda: "nothing asked")
    assert answer == "nothing asked"
    assert (count.round_trips, count.server_waits) == (0, 0)
