"""A turn of the group commit runs its units' like statements together on PostgreSQL
(engine.commits: the calls' events inserted and their orders or order names read ahead
of the units, in one statement, their effects at the turn's end in another), and comes
to what the units' own statements come to, one after another, on SQLite. Every test
here runs on both databases but those of what only PostgreSQL has, row locks and
sessions waiting on each other (tests/test_round_trips.py counts what a turn of
webhooks costs)."""
import asyncio
import contextlib
import datetime
import os
import threading

import peewee
import psycopg2
import pytest

from domain import orders
from engine import inbox, outbox, spool
from engine.db import Circuit
from engine.prepared import Prepared, save_changes, slot, write_later
from engine.transaction import OrderRef
from handlers.workflow import hourly_keys
from models import ComplianceOrder, CrtcOrder, FormationOrder, Outbox, WebhookEvent, database
from engine.connection import BoundedWaits, open_database
from tests.door import through_the_door
from tests.service_process import ON_POSTGRES, database_down
from tests.test_inbox import card_plugin  # noqa: F401 (a fixture)
from tests.test_order_names import frappe_body


def one_turn(*calls):
    """The calls' units, asked in the same turn of the loop: one turn of the commit."""
    return asyncio.gather(*calls)


def asking_a_job(card_plugin, event_type="test.job"):  # noqa: F811
    """A plain plugin whose event asks for one job of the order the payload names."""
    def handle(ctx, payload, effects):
        effects.job("deliver", {"order_number": payload["order"]}, purpose="deliver")
    card_plugin(event_type, handle)


def accept(ctx, key, order, event_type="test.job", **fields):
    body = f'{{"order": "{order}", "key": "{key}"}}'.encode()
    return inbox.accept(ctx, "card", event_type, key, body, order_number=order, **fields)


@pytest.mark.gen_test
async def test_copies_of_a_call_either_side_of_the_hour_in_one_turn_are_handled_once(
        ctx, card_plugin, worker):  # noqa: F811
    """The second copy's dedup window holds the first's key: inserted in one statement
    neither would see the other, so that turn inserts its events one by one."""
    asking_a_job(card_plugin)
    hour = 500_000
    before = accept(ctx, f"copy:h{hour}", "FO-1", **hourly_keys("copy", hour - 36, hour - 1))
    after = accept(ctx, f"copy:h{hour + 1}", "FO-1", **hourly_keys("copy", hour - 35, hour))
    other = accept(ctx, "other:h1", "FO-2")
    first, second, third = await one_turn(before, after, other)
    assert (first.created, second.created, third.created) == (True, False, True)
    assert second.event.id == first.event.id
    assert WebhookEvent.select().count() == 2
    assert sorted(request.json["order_number"] for request in worker.posts) == [
        "FO-1", "FO-2"]


@pytest.mark.gen_test
async def test_copies_of_a_call_under_one_key_in_one_turn_are_handled_once(
        ctx, card_plugin, worker):  # noqa: F811
    asking_a_job(card_plugin)
    calls = await one_turn(*(accept(ctx, "same:h7", "FO-1") for _ in range(3)),
                           accept(ctx, "else:h7", "FO-2"))
    assert [call.created for call in calls] == [True, False, False, True]
    assert {call.event.id for call in calls[:3]} == {calls[0].event.id}
    assert [call.outcome for call in calls] == ["processed", None, None, "processed"]
    assert len(worker.posts) == 2


@pytest.mark.gen_test
async def test_a_job_behind_another_of_its_order_in_the_same_turn_waits_for_it(
        ctx, card_plugin, worker, clock):  # noqa: F811
    """The second event's job is behind the first's (another event of its order, unsent
    when it was written), as if written after it in a turn of its own; an order's job
    with nothing before it goes at once."""
    asking_a_job(card_plugin)
    await one_turn(accept(ctx, "first", "FO-1"), accept(ctx, "second", "FO-1"),
                   accept(ctx, "alone", "FO-2"))
    jobs = {row.event.dedup_key: row for row in Outbox.select()}
    assert (jobs["first"].status, jobs["alone"].status) == ("sent", "sent")
    assert jobs["second"].status == "pending" and len(worker.posts) == 2
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)
    assert await outbox.send_due(ctx) == 1
    assert worker.posts[-1].json["order_number"] == "FO-1"
    assert Outbox.select().where(Outbox.status == "sent").count() == 3


@pytest.mark.gen_test
async def test_jobs_behind_an_unsent_one_stored_before_the_turn_wait_for_it(
        ctx, card_plugin, worker):  # noqa: F811
    asking_a_job(card_plugin)
    effects = outbox.Effects(ctx)
    through_the_door(effects.job, "deliver", {"order_number": "FO-1"}, key="job-earlier")
    await one_turn(accept(ctx, "first", "FO-1"), accept(ctx, "second", "FO-1"))
    assert not worker.posts
    assert Outbox.select().where(Outbox.status == "pending").count() == 3


@pytest.mark.gen_test
async def test_a_unit_that_raises_undoes_its_turn_and_the_others_are_kept_once(
        ctx, card_plugin, worker, database_url):  # noqa: F811
    """The turn that ran its events and effects together is rolled back and run again,
    each unit on its own: the failing call is kept as failed, its effect not written,
    and each other call stored, handled and sent once."""
    asking_a_job(card_plugin)

    def fail(ctx, payload, effects):
        effects.job("deliver", {"order_number": payload["order"]}, purpose="deliver")
        raise RuntimeError("cannot handle this")
    card_plugin("test.raises", fail)
    calls = await one_turn(accept(ctx, "a", "FO-1"), accept(ctx, "b", "FO-2", "test.raises"),
                           accept(ctx, "c", "FO-3"))
    assert [call.outcome for call in calls] == ["processed", "failed", "processed"]
    assert [event.status for event in WebhookEvent.select().order_by(WebhookEvent.id)] == [
        "processed", "failed", "processed"]
    assert sorted(row.order_number for row in Outbox.select()) == ["FO-1", "FO-3"]
    assert sorted(request.json["order_number"] for request in worker.posts) == [
        "FO-1", "FO-3"]


@pytest.mark.gen_test
async def test_one_effect_asked_for_by_two_calls_of_a_turn_is_written_once(
        ctx, card_plugin, worker):  # noqa: F811
    def alert_once(ctx, payload, effects):
        effects.job("deliver", {"order_number": payload["order"]}, key="job-once")
    card_plugin("test.once", alert_once)
    calls = await one_turn(accept(ctx, "x", "FO-1", "test.once"),
                           accept(ctx, "y", "FO-1", "test.once"))
    assert [call.outcome for call in calls] == ["processed", "processed"]
    [row] = Outbox.select()
    assert (row.event_id, row.status) == (calls[0].event.id, "sent")
    assert len(worker.posts) == 1


@pytest.mark.gen_test
async def test_an_effect_the_database_refuses_fails_its_own_call_alone(
        ctx, card_plugin, worker, database_url):  # noqa: F811
    """PostgreSQL's text cannot hold a NUL: the turn's effects, written in one statement,
    are refused together, and the turn run again unit by unit finds the call that asked
    for it. SQLite stores it."""
    asking_a_job(card_plugin)
    # JSON's escape: the body is text without a NUL, the order number read from it has one.
    with_a_nul = inbox.accept(ctx, "card", "test.job", "b", b'{"order": "FO-\\u00002"}')
    calls = await one_turn(accept(ctx, "a", "FO-1"), with_a_nul, accept(ctx, "c", "FO-3"))
    refused = database_url.startswith("postgres")
    assert [call.outcome for call in calls] == [
        "processed", "failed" if refused else "processed", "processed"]
    expected = sorted(["FO-1", "FO-3"] if refused else ["FO-1", "FO-\x002", "FO-3"])
    assert sorted(row.order_number for row in Outbox.select()) == expected
    assert sorted(request.json["order_number"] for request in worker.posts) == expected


@pytest.mark.gen_test
async def test_an_order_renamed_by_a_call_of_the_turn_is_read_anew_by_the_next(
        ctx, worker, frappe):
    """The names read ahead are each used once: after the first call renames the order,
    the second reads the name it left, and renames it back."""
    FormationOrder.create(order_number="FO-1", order_name="FORM-OLD")
    FormationOrder.create(order_number="FO-2", order_name="FORM-2")

    def ready(name, number="FO-1"):
        body = frappe_body({"order_name": name, "order_number": number})
        return inbox.accept(ctx, "workflow", "formation/ready", f"{name}:{number}", body,
                            order_number=number, orders=(OrderRef(None, number),))
    calls = await one_turn(ready("FORM-NEW"), ready("FORM-OLD"), ready("FORM-2", "FO-2"),
                           ready("FORM-3", "FO-3"))
    assert [call.outcome for call in calls] == ["processed"] * 4
    assert [order.order_name for order in FormationOrder.select().order_by(
        FormationOrder.order_number)] == ["FORM-OLD", "FORM-2"]
    # FO-1's second job waits behind its first.
    assert sorted(request.json["order_name"] for request in worker.posts) == [
        "FORM-2", "FORM-3", "FORM-NEW"]


@pytest.mark.gen_test
async def test_a_job_of_no_event_asked_after_an_events_in_the_same_turn_waits_for_it(
        ctx, card_plugin, worker):  # noqa: F811
    """A job without an event (the commission holdback's release) is written with the
    turn's other effects, after the ones asked for before it: behind the event's job of
    its order, as it would be written after it in a turn of its own."""
    asking_a_job(card_plugin)
    release = outbox.Effects(ctx)
    await one_turn(accept(ctx, "first", "FO-1"), releasing(ctx, release, "FO-1"))
    [row] = release.rows
    assert row.behind
    await outbox.deliver(ctx, release.rows)
    assert [request.json["order_number"] for request in worker.posts] == ["FO-1"]
    assert Outbox.get_by_id(row.id).status == "pending"


def releasing(ctx, effects, order, key=None):
    return ctx.commits.run(lambda: effects.job(
        "release_commission", {"order_number": order}, key=key or f"job-release-{order}"))


@pytest.mark.gen_test
async def test_of_two_jobs_of_no_event_for_one_order_in_a_turn_the_second_waits(ctx):
    """As each would be written alone; FO-3's waits for an event's stored before."""
    event, _ = through_the_door(inbox.store, ctx, "card", "test.job", "before", b"{}")
    through_the_door(outbox.Effects(ctx, event).job, "deliver", {"order_number": "FO-3"},
                     purpose="deliver")
    release = outbox.Effects(ctx)
    await one_turn(releasing(ctx, release, "FO-1"), releasing(ctx, release, "FO-1", "again"),
                   releasing(ctx, release, "FO-2"), releasing(ctx, release, "FO-3"))
    assert [row.behind for row in release.rows] == [False, True, False, True]


def paying(card_plugin):  # noqa: F811
    """A plain plugin that completes the payment of the formation order the payload
    names, under the payload's key as its reference (domain.orders.complete_payment)."""
    def handle(ctx, payload, effects):
        orders.complete_payment(ctx, effects, payload["order"], "formation", payload["key"],
                                source="card")
    card_plugin("test.pays", handle)


def pays(ctx, key, order):
    """A call of the `paying` plugin, its order read ahead as a payment plugin asks."""
    return accept(ctx, key, order, "test.pays", orders=(OrderRef("formation", order),))


def paid_by_peewee(ctx, payload, effects):
    (FormationOrder.update(payment_status="paid", stripe_session_id=payload["key"])
     .where(FormationOrder.order_number == payload["order"]).execute())


def paid_by_saving_a_row_read_otherwise(ctx, payload, effects):
    order = effects.order("formation", payload["order"])
    order.payment_status, order.stripe_session_id = "paid", payload["key"]
    save_changes(order)


PAY = Prepared(lambda: FormationOrder.update(
    payment_status="paid", stripe_session_id=slot(FormationOrder.stripe_session_id)).where(
    FormationOrder.order_number == slot(FormationOrder.order_number)))


def paid_by_a_prepared_statement(ctx, payload, effects):
    PAY.execute_later(stripe_session_id=payload["key"], order_number=payload["order"])


def paid_by_a_held_query(ctx, payload, effects):
    write_later(FormationOrder.update(payment_status="paid", stripe_session_id=payload["key"])
                .where(FormationOrder.order_number == payload["order"]))


def paid_through_a_table_of_no_model(ctx, payload, effects):
    table = peewee.Table(FormationOrder._meta.table_name).bind(database)
    (table.update(payment_status="paid", stripe_session_id=payload["key"])
     .where(table.c.order_number == payload["order"]).execute())


@pytest.mark.gen_test
@pytest.mark.parametrize("writer", [
    paid_by_peewee, paid_by_saving_a_row_read_otherwise, paid_by_a_prepared_statement,
    paid_by_a_held_query, paid_through_a_table_of_no_model])
async def test_an_order_written_in_the_turn_before_its_read_is_read_anew(
        ctx, card_plugin, writer):  # noqa: F811
    """The orders the turn's payments lock are read ahead; a call before them pays FO-1
    (through peewee, by saving a row it read itself, by a compiled statement, by a held
    query, through a table of no model): the payment after it finds FO-1 paid by another
    payment, as it would on its own, not the row read before the turn."""
    FormationOrder.create(order_number="FO-1")
    FormationOrder.create(order_number="FO-2")
    paying(card_plugin)
    card_plugin("test.writes", writer)
    calls = await one_turn(accept(ctx, "cs_first", "FO-1", "test.writes"),
                           pays(ctx, "cs_second", "FO-1"), pays(ctx, "cs_other", "FO-2"))
    assert [call.outcome for call in calls] == ["processed"] * 3
    assert [(order.payment_status, order.stripe_session_id) for order in
            FormationOrder.select().order_by(FormationOrder.order_number)] == [
        ("paid", "cs_first"), ("paid", "cs_other")]


@pytest.mark.gen_test
async def test_two_payments_of_one_order_in_a_turn_pay_it_once(ctx, card_plugin):  # noqa: F811
    """The order read ahead is taken by the first payment; the second reads it anew and
    finds it paid by another payment."""
    FormationOrder.create(order_number="FO-1")
    FormationOrder.create(order_number="FO-2")
    paying(card_plugin)
    calls = await one_turn(pays(ctx, "cs_a", "FO-1"), pays(ctx, "cs_b", "FO-1"),
                           pays(ctx, "cs_c", "FO-2"))
    assert [call.outcome for call in calls] == ["processed"] * 3
    assert [order.stripe_session_id for order in FormationOrder.select().order_by(
        FormationOrder.order_number)] == ["cs_a", "cs_c"]
    assert Outbox.select().where(Outbox.kind == "alert").count() == 2


@pytest.mark.gen_test
async def test_orders_of_two_kinds_read_ahead_with_the_events_are_the_rows_as_read_alone(
        ctx, card_plugin):  # noqa: F811
    """A turn whose calls lock orders of two kinds, one of them absent, and one call a
    copy of another: on PostgreSQL the events' INSERT and each kind's read are parts of
    one statement (engine.commits), whose rows come apart as each part's. Each call finds
    the row its own read would find, column for column and type for type (an aware time,
    a count of cents, a flag), an absent order as absent, and the copy as a copy."""
    paid_at = datetime.datetime(2026, 11, 2, 15, 4, 5, 123456, tzinfo=datetime.timezone.utc)
    FormationOrder.create(order_number="FO-1", paid_at=paid_at, order_name="FORM-1")
    CrtcOrder.create(order_number="CA-1", funds_available=True, total_cents=123_45)
    found = {}

    def reads(ctx, payload, effects):
        order = effects.lock_order(orders.order_type_of(payload["order"]), payload["order"])
        found[payload["key"]] = None if order is None else dict(order.__data__)
    card_plugin("test.reads", reads)

    def reading(key, order):
        return accept(ctx, key, order, "test.reads",
                      orders=(OrderRef(orders.order_type_of(order), order),))
    calls = await one_turn(reading("a", "FO-1"), reading("b", "CA-1"), reading("c", "FO-9"),
                           reading("a", "FO-1"))
    assert [call.created for call in calls] == [True, True, True, False]
    assert found == {"a": FormationOrder.get().__data__, "b": CrtcOrder.get().__data__,
                     "c": None}
    assert found["a"]["paid_at"] == paid_at and found["a"]["order_name"] == "FORM-1"
    assert found["b"]["total_cents"] == 123_45 and found["b"]["funds_available"] is True


@pytest.mark.skipif(not ON_POSTGRES, reason="SQLite runs each unit's own statements")
@pytest.mark.gen_test(timeout=20)
@pytest.mark.parametrize("first", ["a payment", "a call with earlier keys"])
async def test_a_turn_inserts_all_its_events_before_it_locks_an_order(
        ctx, card_plugin, other_connection, database_url, first):  # noqa: F811
    """The statement ahead inserts the turn's events, then locks its orders, as a unit
    alone does, whichever unit asked first (a call with earlier keys inserts its own
    event, so the first unit may ask for an order alone). Were the locks taken between
    two events' inserts, or before them, a turn waiting on an order would leave its
    later events uninserted, and another process could insert a copy of one and then
    wait on the order: each would wait on the other (a deadlock, one second of it, then
    one of the turns undone). Here FO-1 is held elsewhere while the turn waits for it: a
    copy of the turn's last event, inserted by another session, waits for the turn's
    row, which is there already."""
    for number in ("FO-1", "FO-2", "FO-3"):
        FormationOrder.create(order_number=number)
    paying(card_plugin)
    other_connection.cursor().execute(
        "SELECT 1 FROM formation_orders WHERE order_number = 'FO-1' FOR UPDATE")
    earlier = {"also_known_as": ["cs_earlier"]} if first != "a payment" else {}
    turn = asyncio.ensure_future(one_turn(
        accept(ctx, "cs_a", "FO-1", "test.pays", orders=(OrderRef("formation", "FO-1"),),
               **earlier),
        pays(ctx, "cs_b", "FO-2"), pays(ctx, "cs_c", "FO-3")))
    sql, params = WebhookEvent.insert(
        source="card", event_type="test.pays", dedup_key="cs_c", payload="{}",
        status="received", received_at=ctx.clock()).on_conflict("nothing").sql()
    copy = psycopg2.connect(database_url)
    try:
        copy.autocommit = True
        cursor = copy.cursor()
        await until_waiting_on_a_lock(cursor)
        cursor.execute("SET lock_timeout = '300ms'")
        with pytest.raises(psycopg2.errors.LockNotAvailable):
            cursor.execute(sql, params)
    finally:
        copy.close()
        other_connection.rollback()
    assert [call.outcome for call in await turn] == ["processed"] * 3


async def until_waiting_on_a_lock(cursor):
    """Until another session waits for a lock: the turn, on the order held."""
    for _ in range(200):
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                       " AND datname = current_database()")
        if cursor.fetchone()[0]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the turn never waited on the order held")


@pytest.mark.skipif(not ON_POSTGRES, reason="SQLite runs each unit's own statements")
def test_two_processes_inserting_copies_of_the_same_calls_in_opposite_orders_both_end(
        database_url):
    """Two processes' turns hold copies of the same 200 calls, come in opposite orders
    (a sender's retries, spread over two instances). Each turn's events go in one INSERT
    in the order of their keys, so the second waits on the first key and then finds
    every key taken; in the order of arrival each would insert half and wait on the
    other's half (a deadlock). Both end, and each event is stored once."""
    now = datetime.datetime.now(datetime.timezone.utc)
    keys = [f"evt_{n:03}" for n in range(200)]
    started, ended = threading.Barrier(2), []

    def statement(order):
        """The service's statement for a turn of these calls, as it sends it."""
        rows = [dict(source="card", event_type="checkout.session.completed", dedup_key=key,
                     external_id=None, order_number=None, payload="{}", status="received",
                     processed_at=None, attempts=0, last_error=None, received_at=now,
                     next_attempt_at=None, reconciled=False, created_at=now, updated_at=now,
                     first=None, last=None) for key in order]
        return inbox.NEW_EVENTS.ahead_rows(rows, take=None)[:2]

    def turn(sql, params):
        """In a process of its own: its own session, a deadlock found after 1 s."""
        connection = psycopg2.connect(database_url)
        try:
            cursor = connection.cursor()
            started.wait()
            cursor.execute(sql, params)
            ended.append(len(cursor.fetchall()))
            connection.commit()
        except psycopg2.Error as failure:
            ended.append(failure)
        finally:
            connection.close()
    threads = [threading.Thread(target=turn, args=statement(order))
               for order in (keys, keys[::-1])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(ended, key=str) == [0, 200]
    assert WebhookEvent.select().count() == 200


@pytest.mark.gen_test
async def test_the_events_of_a_turn_take_their_ids_in_the_order_they_were_asked(
        ctx, card_plugin):  # noqa: F811
    """Inserted in the order of their keys on PostgreSQL (above), a turn's events still
    take their ids in the order their calls came, as each call's own INSERT gives them on
    SQLite: the newest id is the call handled last (what a reconciliation run reads as a
    path's newest event)."""
    asking_a_job(card_plugin)
    keys = ["z-first", "m-second", "a-third"]
    await one_turn(*(accept(ctx, key, f"FO-{n}") for n, key in enumerate(keys)))
    assert [event.dedup_key for event in WebhookEvent.select().order_by(WebhookEvent.id)] == keys


@pytest.mark.skipif(not ON_POSTGRES, reason="SQLite locks no row")
@pytest.mark.gen_test
async def test_a_turn_whose_events_go_one_by_one_locks_no_order_ahead_of_them(
        ctx, card_plugin, statements):  # noqa: F811
    """Copies either side of the hour make the turn leave its events to its units (their
    INSERTs one by one, above): the orders its payments lock are then left to the units
    too, each locked after its own event is inserted, as a unit alone does, never all
    ahead of the events."""
    asking_a_job(card_plugin)
    paying(card_plugin)
    FormationOrder.create(order_number="FO-3")
    hour = 500_000
    calls = await one_turn(
        accept(ctx, f"copy:h{hour}", "FO-1", **hourly_keys("copy", hour - 36, hour - 1)),
        accept(ctx, f"copy:h{hour + 1}", "FO-1", **hourly_keys("copy", hour - 35, hour)),
        pays(ctx, "cs_x", "FO-3"))
    assert [call.created for call in calls] == [True, False, True]
    sent = statements()
    inserted = max(at for at, sql in enumerate(sent) if 'INTO "webhook_events"' in sql)
    locked = min(at for at, sql in enumerate(sent) if "FOR UPDATE" in sql)
    assert inserted < locked


def renaming(ctx, name, number):
    """A workflow call that names the order `number` (of whichever kind) `name`, its
    order's name read ahead as the workflow handler asks."""
    body = frappe_body({"order_name": name, "order_number": number})
    return inbox.accept(ctx, "workflow", "formation/ready", f"{name}:{number}", body,
                        order_number=number, orders=(OrderRef(None, number),))


def locking(connection, table, number):
    """Another process's turn locks the order `number` of `table`; its cursor."""
    cursor = connection.cursor()
    cursor.execute(f"SELECT 1 FROM {table} WHERE order_number = %s FOR UPDATE", (number,))
    return cursor


@pytest.fixture
def watching(database_url):
    """A session that sees the others' waits (pg_stat_activity, read outside any
    transaction: within one it shows the same picture)."""
    connection = psycopg2.connect(database_url)
    connection.autocommit = True
    yield connection.cursor()
    connection.close()


async def crossing(other_connection, watching, start):
    """Another process's turn holds CO-1 while `start()` runs a turn of this one; once
    that turn waits on a lock, the other asks for FO-1 too, and gives up after 300 ms
    (LockNotAvailable: this turn holds FO-1 while it waits for CO-1). What the turn
    came to, once the other has ended."""
    other = locking(other_connection, "compliance_orders", "CO-1")
    turn = asyncio.ensure_future(start())
    try:
        await until_waiting_on_a_lock(watching)
        other.execute("SET lock_timeout = '300ms'")
        other.execute("SELECT 1 FROM formation_orders WHERE order_number = 'FO-1' "
                      "FOR UPDATE")
    finally:
        other_connection.rollback()
    return await turn


@pytest.mark.skipif(not ON_POSTGRES, reason="SQLite locks no row")
@pytest.mark.gen_test(timeout=30)
@pytest.mark.parametrize("first", ["a call that renames FO-1", "a payment of FO-1"])
async def test_a_turn_locks_its_orders_by_kind_then_number_whatever_order_its_calls_came(
        ctx, card_plugin, worker, other_connection, watching, first):  # noqa: F811
    """Another process's turn holds CO-1 and will want FO-1 next: every turn takes a
    compliance order before a formation one. This turn's first call renames or pays for
    FO-1, its second renames CO-1: it locks CO-1 first all the same (the orders a
    payment locks and those a workflow call names are locked together), waits for it,
    and leaves FO-1 to the other turn, which ends. Locking as its calls came, it would
    hold FO-1 while it waits for CO-1, and each turn would wait on the other (a
    deadlock)."""
    FormationOrder.create(order_number="FO-1", order_name="FORM-OLD")
    ComplianceOrder.create(order_number="CO-1", order_name="COMP-OLD")
    paying(card_plugin)
    calls = await crossing(other_connection, watching, lambda: one_turn(
        renaming(ctx, "FORM-NEW", "FO-1") if first.startswith("a call")
        else pays(ctx, "cs_1", "FO-1"),
        renaming(ctx, "COMP-NEW", "CO-1")))
    assert [call.outcome for call in calls] == ["processed"] * 2
    assert ComplianceOrder.get().order_name == "COMP-NEW"
    assert (FormationOrder.get().order_name, FormationOrder.get().stripe_session_id) == (
        ("FORM-NEW", None) if first.startswith("a call") else ("FORM-OLD", "cs_1"))


@pytest.mark.skipif(not ON_POSTGRES, reason="SQLite locks no row")
@pytest.mark.gen_test(timeout=30)
async def test_stored_calls_handled_together_lock_their_orders_by_kind_then_number(
        ctx, worker, other_connection, watching):
    """As above, for calls stored first and handled later, together (a spool drain, the
    inbox retry): their handling asks for its orders ahead as a call's own does, and
    the turn locks CO-1 before FO-1 whatever order they came in."""
    FormationOrder.create(order_number="FO-1", order_name="FORM-OLD")
    ComplianceOrder.create(order_number="CO-1", order_name="COMP-OLD")
    stored = []
    for name, number in (("FORM-NEW", "FO-1"), ("COMP-NEW", "CO-1")):
        body = frappe_body({"order_name": name, "order_number": number})
        stored.append(through_the_door(inbox.store, ctx, "workflow", "formation/ready", name,
                                       body, order_number=number).event)
    outcomes = await crossing(other_connection, watching, lambda: one_turn(
        *(inbox.process(ctx, event) for event in stored)))
    assert outcomes == ["processed"] * 2
    assert (FormationOrder.get().order_name, ComplianceOrder.get().order_name) == (
        "FORM-NEW", "COMP-NEW")


@contextlib.asynccontextmanager
async def as_the_service_opens_it(db, database_url):
    """The database opened as the service opens it (DATABASE_TIMEOUT_MS=1000, PostgreSQL's
    deadlock_timeout by default), a circuit attached that no probe closes meanwhile;
    the suite's database back after."""
    bound = BoundedWaits.seconds
    circuit = Circuit(open_database(database_url, timeout_ms=1000), interval=3600)
    circuit.attach()
    try:
        yield circuit
    finally:
        await circuit.detach()
        BoundedWaits.seconds = bound
        database.initialize(db)


@pytest.mark.skipif(not ON_POSTGRES, reason="SQLite locks no row")
@pytest.mark.gen_test(timeout=30)
async def test_crossed_locks_on_orders_between_two_processes_are_a_conflict_run_again(
        ctx, db, database_url, worker, other_connection, watching):
    """Another process's turn took FO-1 and then wants CO-1 (taken in the other order:
    an older release, or units run one by one); this turn holds CO-1 and waits for
    FO-1. Each waits on the other: a deadlock, which ends as a lock wait past its bound
    (lock_timeout, below the statement timeout) or as PostgreSQL's deadlock_detected,
    a conflict: this turn is undone and run again once the other has ended. Not a
    statement timeout: the database answers, and is not taken for down."""
    FormationOrder.create(order_number="FO-1", order_name="FORM-OLD")
    ComplianceOrder.create(order_number="CO-1", order_name="COMP-OLD")
    async with as_the_service_opens_it(db, database_url) as circuit:
        other = locking(other_connection, "formation_orders", "FO-1")
        turn = asyncio.ensure_future(one_turn(renaming(ctx, "COMP-NEW", "CO-1"),
                                              renaming(ctx, "FORM-NEW", "FO-1")))
        await until_waiting_on_a_lock(watching)

        def other_goes_on():
            other.execute("UPDATE compliance_orders SET order_name = 'COMP-OTHER' "
                          "WHERE order_number = 'CO-1'")
            other_connection.commit()
        try:
            await asyncio.get_running_loop().run_in_executor(None, other_goes_on)
        finally:
            other_connection.rollback()
        calls = await turn
        assert not circuit.is_open
    assert [call.outcome for call in calls] == ["processed"] * 2
    assert (ComplianceOrder.get().order_name, FormationOrder.get().order_name) == (
        "COMP-NEW", "FORM-NEW")
    assert not os.path.exists(ctx.settings.spool_dir) or not os.listdir(ctx.settings.spool_dir)


@pytest.mark.skipif(not ON_POSTGRES, reason="SQLite runs one writer at a time")
@pytest.mark.gen_test(timeout=30)
async def test_copies_of_spooled_calls_another_process_stores_in_the_other_order_conflict(
        ctx, db, database_url, card_plugin, other_connection, watching):  # noqa: F811
    """The drain stores its spooled calls one by one, each its own unit, in the order
    they came: a, then b. Another process stores copies of them (the sender's retries
    went to both instances) in the other order: b, then a. Each waits on a key the other
    has not committed: a conflict, which undoes the drain's turn and runs it again once
    the other has ended; the database is not taken for down, and the spool is drained."""
    asking_a_job(card_plugin)
    async with as_the_service_opens_it(db, database_url) as circuit:
        with database_down(circuit.db):
            for key in ("evt_a", "evt_b"):
                assert (await accept(ctx, key, "FO-1")).event is None  # spooled
        other = other_connection.cursor()

        def copy_of(key):
            other.execute(*WebhookEvent.insert(
                source="card", event_type="test.job", dedup_key=key, payload="{}",
                status="received", received_at=ctx.clock()).on_conflict("nothing").sql())
        copy_of("evt_b")
        drain = asyncio.ensure_future(inbox.drain_spool(ctx))
        await until_waiting_on_a_lock(watching)

        def other_goes_on():
            copy_of("evt_a")
            other_connection.commit()
        try:
            await asyncio.get_running_loop().run_in_executor(None, other_goes_on)
        finally:
            other_connection.rollback()
        assert await drain == 2
        assert not circuit.is_open
    assert sorted(event.dedup_key for event in WebhookEvent.select()) == ["evt_a", "evt_b"]
    assert not spool.backlog(ctx.settings.spool_dir)
