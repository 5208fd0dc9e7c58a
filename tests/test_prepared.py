"""Statements built once (engine.prepared) and the group commit (engine.commits)."""
import asyncio
import datetime
import sqlite3
import threading
import time

import peewee
import pytest

from models import FormationOrder, LedgerEntry, Outbox, TreasuryJob, WebhookEvent, database
from domain import treasury
from engine.commits import GroupCommit, savepoint
from engine.prepared import InsertMany, InsertOnce, Prepared, save_changes, slot
from engine.transaction import Transaction
from tests import shkeeper
from tests.door import through_the_door

NEW_EVENT = InsertOnce(WebhookEvent)


@pytest.fixture
def second_connection(request, database_url):
    """Another connection to the same database, committing each statement: on
    PostgreSQL the conftest's other session, on SQLite a connection of its own."""
    if database_url.startswith("postgres"):
        connection = request.getfixturevalue("other_connection")
        connection.autocommit = True
        yield connection
    else:
        connection = sqlite3.connect(database_url.removeprefix("sqlite:///"),
                                     isolation_level=None)
        yield connection
        connection.close()


def run_sql(connection, sql):
    cursor = connection.cursor()
    cursor.execute(sql)
    return cursor.fetchall() if cursor.description else None


# Sessions waiting on a lock that this connection holds (pg_locks, not pg_stat_activity:
# the latter is read once per transaction, and this connection's stays open).
BLOCKED_BY_THIS_SESSION = ("SELECT count(*) FROM pg_locks "
                           "WHERE NOT granted AND pg_backend_pid() = ANY(pg_blocking_pids(pid))")


def until_a_session_waits_on(connection, seconds=10):
    """Until another session waits on a lock `connection` holds: the unit, having written
    its first row, waits on the row the other process holds. (In a thread: then goes on
    after `seconds` regardless, for the test to say what did not happen.)"""
    deadline = time.monotonic() + seconds
    while not run_sql(connection, BLOCKED_BY_THIS_SESSION)[0][0]:
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


def new_event(key, **values):
    return NEW_EVENT.run(source="test", event_type="t", dedup_key=key, payload="{}",
                         **values)


def test_an_insert_once_returns_the_new_id_then_none_and_the_transaction_goes_on():
    def in_one_transaction():
        first = new_event("k")
        assert new_event("k") is None
        return first, new_event("other")
    first, other = through_the_door(in_one_transaction)
    assert first and other and other != first
    assert WebhookEvent.select().count() == 2


def test_defaults_are_computed_at_each_insert_not_frozen_into_the_statement():
    first = WebhookEvent.get_by_id(through_the_door(new_event, "a"))
    time.sleep(0.01)  # time passes between the inserts: their defaults must differ
    second = WebhookEvent.get_by_id(through_the_door(new_event, "b"))
    assert (first.status, first.attempts) == ("received", 0)
    assert second.received_at > first.received_at


def test_a_prepared_insert_with_a_column_left_to_peewee_is_refused():
    now = datetime.datetime.now(datetime.timezone.utc)
    frozen = Prepared(lambda: WebhookEvent.insert(
        source=slot(WebhookEvent.source), event_type="t", dedup_key=slot(WebhookEvent.dedup_key),
        payload="{}", created_at=now, updated_at=now))
    with pytest.raises(ValueError, match="needs a slot"):
        frozen.execute(source="s", dedup_key="k")


def test_a_row_built_without_reading_back_equals_the_stored_row():
    event = through_the_door(NEW_EVENT.row, source="test", event_type="t", dedup_key="k",
                             payload="{\"a\": 1}", order_number="FO-1")
    stored = WebhookEvent.get_by_id(event.id)
    assert event.__data__ == stored.__data__
    assert through_the_door(NEW_EVENT.row, source="test", event_type="t", dedup_key="k",
                            payload="{}") is None


def test_a_prepared_select_converts_values_both_ways():
    when = datetime.datetime(2026, 11, 22, 3, 4, 5, 678901, tzinfo=datetime.timezone.utc)
    through_the_door(new_event, "k", received_at=when)
    by_time = Prepared(lambda: WebhookEvent.select().where(
        WebhookEvent.received_at == slot(WebhookEvent.received_at)))
    found = through_the_door(by_time.first, received_at=when.astimezone(datetime.timezone(
        datetime.timedelta(hours=-5))))
    assert found.received_at == when and found.received_at.tzinfo is not None
    assert through_the_door(by_time.first,
                            received_at=when + datetime.timedelta(seconds=1)) is None


EVENTS_BY_KEY = InsertMany(
    WebhookEvent, returning=lambda: (WebhookEvent.id, WebhookEvent.dedup_key),
    in_order_of=("source", "dedup_key"))


def test_insert_many_gives_ids_in_the_rows_order_whatever_order_it_inserts_them_in(
        database_url):
    """What InsertMany's ids rest on is what PostgreSQL documents (engine.prepared): the
    rows are inserted in their keys' order, and the ids still follow the order asked."""
    if not database_url.startswith("postgres"):
        pytest.skip("InsertMany is PostgreSQL's (one statement for several rows)")
    keys = ["c", "a", "d", "b", "a"]
    rows = [{"source": "test", "event_type": "t", "dedup_key": key, "payload": f"copy {n}"}
            for n, key in enumerate(keys)]
    returned = through_the_door(EVENTS_BY_KEY.rows, rows)
    ids = {key: row_id for row_id, key in returned}
    assert sorted(ids) == ["a", "b", "c", "d"]
    assert ids["c"] < ids["a"] < ids["d"] < ids["b"]
    # Of two rows under the key, the first asked for is the one inserted.
    assert WebhookEvent.get(WebhookEvent.dedup_key == "a").payload == "copy 1"


def test_save_changes_writes_only_the_changed_columns(second_connection):
    FormationOrder.create(order_number="FO-9", customer_name="Ann")
    order = FormationOrder.get(FormationOrder.order_number == "FO-9")
    # Another system changes a column meanwhile; our save must not write it back.
    run_sql(second_connection,
            "UPDATE formation_orders SET customer_name = 'Bea' WHERE order_number = 'FO-9'")
    order.payment_status = "paid"
    through_the_door(save_changes, order)
    stored = FormationOrder.get(FormationOrder.order_number == "FO-9")
    assert (stored.payment_status, stored.customer_name) == ("paid", "Bea")
    assert not order.dirty_fields


@pytest.mark.gen_test
async def test_a_turn_without_failures_takes_no_savepoint(statements):
    commits = GroupCommit()
    await asyncio.gather(*(commits.run(lambda key=key: new_event(key)) for key in "abc"))
    run = statements()
    assert sum("INSERT INTO" in sql for sql in run) == 3
    assert not [sql for sql in run if "SAVEPOINT" in sql]


@pytest.mark.gen_test
async def test_units_of_one_turn_share_a_commit_and_a_failing_unit_is_undone_alone():
    commits = GroupCommit()
    runs = []

    def unit(key, fail=False):
        def run():
            runs.append((key, database.in_transaction()))
            new_event(key)
            if fail:
                raise RuntimeError("this unit fails")
            return key
        return run

    results = await asyncio.gather(commits.run(unit("a")), commits.run(unit("b", fail=True)),
                                   commits.run(unit("c")), return_exceptions=True)
    assert results[0] == "a" and results[2] == "c"
    assert isinstance(results[1], RuntimeError)
    # Without savepoints until "b" failed; then the whole turn again, with them.
    assert runs == [("a", True), ("b", True), ("a", True), ("b", True), ("c", True)]
    assert sorted(e.dedup_key for e in WebhookEvent.select()) == ["a", "c"]


@pytest.mark.gen_test
async def test_a_part_that_fails_alone_is_undone_and_its_unit_goes_on(statements):
    commits = GroupCommit()

    def unit():
        new_event("kept")
        try:
            with savepoint():
                new_event("undone")
                raise RuntimeError("this part fails")
        except RuntimeError:
            new_event("after the part")
        return "done"

    results = await asyncio.gather(commits.run(unit), commits.run(lambda: new_event("other")))
    assert results[0] == "done"
    assert sorted(e.dedup_key for e in WebhookEvent.select()) == [
        "after the part", "kept", "other"]
    assert [sql for sql in statements() if sql.startswith("SAVEPOINT")]


@pytest.mark.gen_test
async def test_a_caller_resumes_only_after_the_commit(second_connection):
    commits = GroupCommit()
    await commits.run(lambda: new_event("durable"))
    # Another connection sees it: the transaction was committed before run() returned.
    assert run_sql(second_connection,
                   "SELECT COUNT(*) FROM webhook_events WHERE dedup_key = 'durable'") == [(1,)]


@pytest.mark.gen_test
async def test_when_the_commit_fails_every_unit_of_the_turn_fails(monkeypatch):
    commits = GroupCommit()

    def failing_commit(*args, **kwargs):  # the disk refusing the write, as SQLite says it
        raise peewee.OperationalError("disk I/O error")
    monkeypatch.setattr(database.obj, "commit", failing_commit)
    results = await asyncio.gather(commits.run(lambda: new_event("x")),
                                   commits.run(lambda: new_event("y")),
                                   return_exceptions=True)
    monkeypatch.undo()
    assert all(isinstance(result, peewee.OperationalError) for result in results)
    assert not Outbox.select().exists()
    assert not WebhookEvent.select().exists()


INSERT_BY_HAND = (
    "INSERT INTO webhook_events (source, event_type, dedup_key, payload, status, attempts, "
    "received_at, created_at, updated_at) VALUES ('test', 't', '{key}', '{{}}', 'received', 0, "
    "now(), now(), now())")


@pytest.mark.gen_test(timeout=30)
async def test_a_unit_that_loses_a_deadlock_to_another_process_runs_again(
        database_url, second_connection):
    if not database_url.startswith("postgres"):
        pytest.skip("SQLite has one writer at a time: no deadlock between processes")
    second_connection.autocommit = False
    run_sql(second_connection, "SET deadlock_timeout = '5s'")  # so this unit detects it
    run_sql(second_connection, INSERT_BY_HAND.format(key="y"))

    def other_process():  # inserts x, which the unit holds, while holding y
        until_a_session_waits_on(second_connection)
        run_sql(second_connection, INSERT_BY_HAND.format(key="x") + " ON CONFLICT DO NOTHING")
        second_connection.commit()
    other = threading.Thread(target=other_process)
    other.start()
    attempts = []

    def unit():
        attempts.append(1)
        return new_event("x"), new_event("y")
    first_x, first_y = await GroupCommit().run(unit)
    other.join()
    # The first ended in the deadlock; it ran again (its turn with savepoints may meet the
    # same deadlock before the other process commits) until it went through.
    assert len(attempts) >= 2
    assert first_y is None  # the other process's y was committed first
    assert sorted(e.dedup_key for e in WebhookEvent.select()) == ["x", "y"]


LEDGER_BY_HAND = (
    "INSERT INTO ledger_entries (order_id, order_type, coin, movement_type, amount_coin, "
    "amount_usd_cents, provider, provider_ref, provider_status, state, idempotency_key, "
    "acquired_at, notes, created_at, updated_at) VALUES ('CO-7', 'compliance', 'BTC', "
    "'receive', 0.00012345, 780, 'crypto-processor', '0xdead', 'PAID', 'confirmed', "
    "'crypto-processor:CO-7:0xdead', now(), '', now(), now())")
TREASURY_JOB_BY_HAND = (
    "INSERT INTO treasury_jobs (order_id, order_type, state, coin, amount_coin, "
    "amount_usd_cents, idempotency_key, received_at, created_at, updated_at) VALUES "
    "('CO-7', 'compliance', 'received', 'BTC', 0.00012345, 780, "
    "'crypto-settle:CO-7:0xdead', now(), now(), now()) ON CONFLICT DO NOTHING")


def _undo_the_plain_run():
    raise ValueError("a unit before it failed")


@pytest.mark.gen_test(timeout=30)
@pytest.mark.parametrize("run", ["held writes", "with savepoints"])
async def test_a_deadlock_while_recording_a_crypto_receipt_is_not_swallowed(
        ctx, database_url, second_connection, run):
    if not database_url.startswith("postgres"):
        pytest.skip("SQLite has one writer at a time: no deadlock between processes")
    callback = treasury.Callback.parse(shkeeper.paid("CO-7", txid="0xdead"))
    second_connection.autocommit = False
    run_sql(second_connection, "SET deadlock_timeout = '5s'")
    run_sql(second_connection, LEDGER_BY_HAND)

    def other_process():  # records the same receipt, job second, as a second process would
        until_a_session_waits_on(second_connection)
        run_sql(second_connection, TREASURY_JOB_BY_HAND)
        second_connection.commit()
    other = threading.Thread(target=other_process)
    other.start()
    recorded = []
    commits = GroupCommit()
    # Held, the ledger's INSERT meets the other process's row at the COMMIT. After a unit
    # that fails, the turn runs with savepoints, which hold nothing: the INSERT meets it
    # inside record_receipt, whose handler must let the deadlock through.
    first = [commits.run(_undo_the_plain_run)] if run == "with savepoints" else []
    *_, recording = await asyncio.gather(*first, commits.run(lambda: recorded.append(
        treasury.record_receipt(ctx, Transaction(ctx), callback, ctx.clock()))),
        return_exceptions=True)
    other.join()
    assert not isinstance(recording, BaseException), recording
    # The try that lost the deadlock was undone and run again; caught as an ordinary
    # database error it would have recorded False, with no receipt written by this process.
    assert recorded[-1] is True and False not in recorded, recorded
    assert (TreasuryJob.select().count(), LedgerEntry.select().count()) == (1, 1)
