"""Held writes (engine.connection.HeldWrites, engine.commits): in a turn of the group commit
on PostgreSQL, the BEGIN and the writes whose result nobody reads go to the server with
the next statement, or with the COMMIT. The round trips are counted apart from the
database's own count: psycopg2 waits on the server once per round trip, through its
wait callback (a turn's counts are pinned in tests/test_round_trips.py). What a turn
means (its reads, its failures, each unit's own outcome) is the same on both databases,
and tested on both."""
import asyncio
import decimal

import peewee
import psycopg2.extensions
import pytest

from models import FormationOrder, WebhookEvent, database
from engine.connection import BoundedWaits
from engine import joined
from engine.commits import GroupCommit
from engine.prepared import Prepared, save_changes


@pytest.fixture
def postgres_only(database_url):
    if not database_url.startswith("postgres"):
        pytest.skip("SQLite runs in the process: no round trip to save")


@pytest.fixture
def server_waits(postgres_only):
    """How many times psycopg2 has waited for the server since the test began."""
    previous = psycopg2.extensions.get_wait_callback()
    waits = []

    def counted(connection):
        waits.append(1)
        (previous or BoundedWaits.wait)(connection)
    psycopg2.extensions.set_wait_callback(counted)
    yield lambda: len(waits)
    psycopg2.extensions.set_wait_callback(previous)


@pytest.fixture
def orders():
    return [FormationOrder.create(order_number=f"FO-{n}") for n in range(3)]


def paid(order):
    def unit():
        order.payment_status = "paid"
        save_changes(order)
        return order.order_number
    return unit


def stored_statuses():
    return {order.order_number: order.payment_status
            for order in FormationOrder.select().order_by(FormationOrder.order_number)}


@pytest.mark.gen_test
async def test_a_read_sees_the_writes_held_before_it(orders):
    def unit():
        paid(orders[0])()
        return FormationOrder.get(FormationOrder.order_number == "FO-0").payment_status
    assert await GroupCommit().run(unit) == "paid"


def refused_write(order):
    """A held write the database refuses: the order number is NOT NULL."""
    def unit():
        order.order_number = None
        save_changes(order)
    return unit


def reads_after(unit):
    def with_a_read():
        result = unit()
        WebhookEvent.select().count()
        return result
    return with_a_read


@pytest.mark.gen_test
@pytest.mark.parametrize("sent_with", ["the COMMIT", "a later unit's read"])
async def test_a_held_write_refused_fails_its_own_unit_alone(orders, sent_with):
    """Sent with a later statement, its failure shows there: the turn is undone and run
    again with savepoints and nothing held, where it is its own unit's failure."""
    later = paid(orders[2]) if sent_with == "the COMMIT" else reads_after(paid(orders[2]))
    commits = GroupCommit()
    results = await asyncio.gather(commits.run(paid(orders[0])),
                                   commits.run(refused_write(orders[1])),
                                   commits.run(later), return_exceptions=True)
    assert results[0] == "FO-0" and results[2] == "FO-2"
    assert isinstance(results[1], peewee.IntegrityError)
    assert stored_statuses() == {"FO-0": "paid", "FO-1": "pending_payment", "FO-2": "paid"}


@pytest.mark.gen_test
async def test_a_held_write_refused_by_the_only_unit_is_its_failure(orders):
    with pytest.raises(peewee.IntegrityError):
        await GroupCommit().run(refused_write(orders[0]))
    assert FormationOrder.select().where(FormationOrder.order_number.is_null()).count() == 0
    # The connection is usable after the failed string: the next turn commits.
    assert await GroupCommit().run(paid(orders[1])) == "FO-1"
    assert stored_statuses()["FO-1"] == "paid"



def the_database_threads_backend():
    return database.execute_sql("SELECT pg_backend_pid()").fetchone()[0]


def end_backend(other_connection, pid):
    """As a restart or failover does: the server ends the session, unseen by psycopg2
    until it next speaks on the connection."""
    other_connection.autocommit = True
    cursor = other_connection.cursor()
    cursor.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    assert cursor.fetchone() == (True,)


@pytest.mark.gen_test
@pytest.mark.parametrize("turn", ["a unit that reads", "writes alone"])
async def test_a_session_the_server_ended_is_replaced_before_the_turn(
        postgres_only, orders, other_connection, turn):
    """The server says so when it ends a session (a restart, an administrator): the next
    turn's BEGIN then goes alone, and is reconnected as it always was. Held, it would
    fail with the turn's writes, inside the transaction."""
    commits = GroupCommit()
    pid = await commits.run(the_database_threads_backend)
    end_backend(other_connection, pid)

    def reading():
        paid(orders[0])()
        return FormationOrder.get(FormationOrder.order_number == "FO-0").payment_status
    assert await commits.run(reading if turn == "a unit that reads" else paid(orders[0])) in (
        "paid", "FO-0")
    assert await commits.run(the_database_threads_backend) != pid
    assert stored_statuses()["FO-0"] == "paid"


@pytest.mark.gen_test
async def test_a_session_lost_within_a_turn_fails_the_turn_once_only(
        postgres_only, orders):
    """A unit's statement finds the session gone (here the unit ends its own session,
    once): the turn is undone without a ROLLBACK (the server ended the transaction with
    the session) and run again with savepoints on a new connection, where every unit
    goes through."""
    ended = []

    def ends_its_session():
        if not ended:
            ended.append(1)
            database.execute_sql("SELECT pg_terminate_backend(pg_backend_pid())")
        return "ran again"
    commits = GroupCommit()
    await commits.run(lambda: None)
    results = await asyncio.gather(commits.run(paid(orders[0])),
                                   commits.run(ends_its_session),
                                   commits.run(paid(orders[1])))
    assert results == ["FO-0", "ran again", "FO-1"]
    assert stored_statuses() == {"FO-0": "paid", "FO-1": "paid", "FO-2": "pending_payment"}


# --- statements prepared on the server ---------------------------------------------------

def prepared_on_the_connection():
    """The statements the database thread's session has prepared: {name: the string
    its PREPARE came in}."""
    return dict(database.execute_sql(
        "SELECT name, statement FROM pg_prepared_statements").fetchall())


@pytest.mark.gen_test
async def test_a_statement_is_prepared_once_per_session_then_executed_by_name(
        postgres_only, orders, other_connection):
    commits = GroupCommit()
    await commits.run(paid(orders[0]))
    [(name, text)] = (await commits.run(prepared_on_the_connection)).items()
    assert f'PREPARE {name}(text, integer) AS UPDATE "formation_orders"' in text
    await commits.run(paid(orders[1]))
    assert list(await commits.run(prepared_on_the_connection)) == [name]
    # A new session (the server ended the old one) prepares it anew.
    end_backend(other_connection, await commits.run(the_database_threads_backend))
    await commits.run(paid(orders[2]))
    assert list(await commits.run(prepared_on_the_connection)) == [name]
    assert set(stored_statuses().values()) == {"paid"}


@pytest.mark.gen_test
async def test_after_a_failed_round_trip_that_prepared_the_statements_are_prepared_anew(
        postgres_only, orders, statements):
    """The failed string prepared both statements before the refused write failed; which
    of its PREPAREs ran is unknown to the service, so the next one starts from none
    (DEALLOCATE ALL). Preparing one again over itself would fail every later turn, each
    then run again with savepoints."""
    commits = GroupCommit()
    failed = await asyncio.gather(commits.run(paid(orders[0])),
                                  commits.run(refused_write(orders[1])),
                                  return_exceptions=True)
    assert failed[0] == "FO-0" and isinstance(failed[1], peewee.IntegrityError)
    before = len(statements())
    assert await commits.run(paid(orders[2])) == "FO-2"
    assert not [sql for sql in statements()[before:] if "SAVEPOINT" in sql]
    [text] = (await commits.run(prepared_on_the_connection)).values()
    assert 'DEALLOCATE ALL; PREPARE' in text and 'UPDATE "formation_orders"' in text
    assert stored_statuses()["FO-2"] == "paid"


@pytest.mark.gen_test
async def test_a_deallocate_held_and_never_sent_is_held_again(postgres_only, orders, statements):
    """After a failed round trip that prepared, the next turn holds DEALLOCATE ALL before
    its PREPARE; that turn's unit raises before anything is sent, so the rollback drops
    them unsent. The turn after must still deallocate first."""
    commits = GroupCommit()
    await asyncio.gather(commits.run(paid(orders[0])), commits.run(refused_write(orders[1])),
                         return_exceptions=True)

    def paid_then_raises():
        paid(orders[2])()
        raise ValueError("the unit's own failure, before any statement is sent")
    with pytest.raises(ValueError):
        await commits.run(paid_then_raises)
    before = len(statements())
    assert await commits.run(paid(orders[2])) == "FO-2"
    assert not [sql for sql in statements()[before:] if "SAVEPOINT" in sql]
    [text] = (await commits.run(prepared_on_the_connection)).values()
    assert text.startswith("BEGIN; DEALLOCATE ALL; PREPARE")


@pytest.mark.gen_test
async def test_statements_prepared_on_the_server_read_by_unique_keys_alone(
        postgres_only, other_connection, orders):
    """The plan PostgreSQL keeps for a prepared statement is made without the values,
    here on empty tables: every read in it must go by equality on the primary key or a
    unique key (Prepared's `on_server`), never a scan whose filter does the choosing."""
    import app.server  # noqa: F401  (every module with statements of its own)
    await GroupCommit().run(paid(orders[0]))  # save_changes builds its statement on use
    other_connection.autocommit = True
    cursor = other_connection.cursor()
    cursor.execute("SELECT indexrelid::regclass::text FROM pg_index WHERE indisunique")
    unique = {name for (name,) in cursor.fetchall()}
    checked = 0
    for statement in Prepared.on_server_statements:
        server = await GroupCommit().run(lambda statement=statement: statement._statement()[4])
        cursor.execute("BEGIN")
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(server.prepare_text(cursor))
        cursor.execute(f"EXPLAIN {server.execute}", [None] * server.execute.count("%s"))
        plan = [line for (line,) in cursor.fetchall()]
        cursor.execute("ROLLBACK")
        cursor.execute(f"DEALLOCATE {server.name}")  # not undone by the rollback
        indexes = [line.partition(" using ")[2].partition(" on ")[0]
                   for line in plan if " Scan " in line]
        filters = [line for line in plan if line.strip().startswith("Filter:")]
        assert not filters and all(index in unique for index in indexes), (server.sql, plan)
        checked += 1
    assert checked >= 10


def test_statements_of_their_own_results_go_as_one_round_trip_each_with_its_rows(
        server_waits):
    """engine.joined.rows_of_each: three statements, one with no rows between
    two with some, in the round trips one statement takes; each gets its own columns'
    names and its own rows, typed as its own columns (an exact amount, an aware time)."""
    parts = [("SELECT n FROM generate_series(1, %s) AS n", [2]),
             ("SELECT 1 AS never, 'x'::text AS seen WHERE false", []),
             ("SELECT %s::numeric(12, 2) AS amount, now() AS at", [decimal.Decimal("1.10")])]

    def waits(call):
        before = server_waits()
        returned = call()
        waited = server_waits() - before
        database.rollback()
        return waited, returned
    alone, _ = waits(lambda: database.execute_sql("SELECT 1").fetchall())
    together, returned = waits(lambda: joined.rows_of_each(database, parts))
    assert together == alone
    (counted, numbers), (empty, none), (priced, [(amount, at)]) = returned
    assert (counted, numbers) == (["n"], [(1,), (2,)])
    assert (empty, none) == (["never", "seen"], [])
    assert priced == ["amount", "at"] and amount == decimal.Decimal("1.10")
    assert at.tzinfo is not None


def test_the_parts_of_one_statement_see_one_snapshot_not_each_others_writes(postgres_only):
    """What engine.joined rests on, as PostgreSQL documents it: a part that reads the
    table another part writes does not see that write, whichever part comes first; so
    engine.commits.Ahead asks for no such pair."""
    insert = ("INSERT INTO webhook_events (source, event_type, dedup_key, payload, status, "
              "attempts, received_at, created_at, updated_at) VALUES ('test', 't', %s, '{}', "
              "'received', 0, now(), now(), now()) RETURNING id")
    count = "SELECT count(*) AS stored FROM webhook_events"
    with database.atomic():
        (_, [(first,)]), (_, [(seen_after,)]) = joined.rows_of_each(
            database, [(insert, ["a"]), (count, [])])
        (_, [(seen_before,)]), (_, [(second,)]) = joined.rows_of_each(
            database, [(count, []), (insert, ["b"])])
    assert (seen_after, seen_before) == (0, 1)
    assert sorted(event.id for event in WebhookEvent.select()) == sorted((first, second))

