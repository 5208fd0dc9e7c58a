"""A database that stops answering must not stop the service (issue 19): the circuit
that keeps a database found down from being tried on every call, and /readyz's own
bound. Under load, with the service as a subprocess: tests/test_faults.py."""
import json
import sqlite3

import pytest

from models import WebhookEvent, database
from engine.connection import ClassifiedSqliteDatabase, ReconnectingPostgresqlDatabase
from engine.errors import DatabaseDown
from engine.db import UNAVAILABLE, Circuit
from tests.service_process import TcpProxy, postgres_only
from tests.waits import eventually


def probes_of(circuit):
    """The answers of `circuit`'s probes, in order, as they come."""
    answers = []
    probe = circuit.probe

    async def recorded():
        answers.append(await probe())
        return answers[-1]
    circuit.probe = recorded
    return answers


@pytest.fixture
def locked_sqlite(tmp_path):
    """A SQLite file whose write lock another connection holds, and that connection."""
    path = str(tmp_path / "locked.sqlite3")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    yield path, holder
    holder.close()


@pytest.mark.gen_test
async def test_a_database_found_down_is_not_tried_again_until_a_probe_finds_it_back(
        locked_sqlite):
    path, holder = locked_sqlite
    db = ClassifiedSqliteDatabase(path, pragmas={"busy_timeout": 50})
    circuit = Circuit(db, interval=0.05)
    probes = probes_of(circuit)
    circuit.attach()
    try:
        with pytest.raises(UNAVAILABLE):
            db.execute_sql("INSERT INTO t VALUES (1)")  # waits out the busy timeout
        assert circuit.is_open and "locked" in circuit.reason
        # Not tried at all now: not even what would work.
        with pytest.raises(DatabaseDown, match="not tried until a probe finds it back"):
            db.execute_sql("SELECT 1")
        await eventually(lambda: probes, timeout=10, interval=0.02)
        assert probes[0] is False and circuit.is_open  # the probe's write waits on the lock

        holder.execute("ROLLBACK")
        await eventually(lambda: not circuit.is_open, timeout=10, interval=0.02)
        db.execute_sql("INSERT INTO t VALUES (2)")
    finally:
        await circuit.detach()
        db.close()
    assert db.circuit is None


@pytest.mark.gen_test
async def test_a_refused_statement_leaves_the_circuit_closed(tmp_path):
    db = ClassifiedSqliteDatabase(str(tmp_path / "ok.sqlite3"))
    circuit = Circuit(db)
    circuit.attach()
    try:
        with pytest.raises(Exception) as refused:
            db.execute_sql("SELECT * FROM no_such_table")
        assert not isinstance(refused.value, UNAVAILABLE) and not circuit.is_open
    finally:
        await circuit.detach()
        db.close()


@pytest.fixture
def get(http_server, base_url, client):
    async def fetch(path):
        response = await client.fetch(base_url + path, request_timeout=30)
        return response.code, json.loads(response.body)
    return fetch


@postgres_only
@pytest.mark.gen_test(timeout=30)
async def test_readyz_reports_a_frozen_database_unreachable_within_its_own_timeout(
        get, database_url, db):
    proxy, proxied_url = TcpProxy.in_front_of(database_url)
    frozen = ReconnectingPostgresqlDatabase(
        proxied_url.rsplit("/", 1)[1], host="127.0.0.1", port=proxy.port, user="postgres")
    database.initialize(frozen)
    try:
        WebhookEvent.select().count()  # the service's own connection, open
        proxy.freeze()
        code, body = await get("/readyz")
        assert (code, body["checks"]["database"]) == (503, "unreachable")
    finally:
        database.initialize(db)
        proxy.close()
        frozen.close()


@pytest.mark.gen_test
async def test_readyz_does_not_wait_on_a_database_known_to_be_down(get, db, ctx):
    circuit = Circuit(db)
    circuit.attach()
    circuit.trip(DatabaseDown("connection refused"))
    try:
        code, body = await get("/readyz")
        assert (code, body["checks"]["database"]) == (503, "unreachable")
    finally:
        await circuit.detach()
        circuit.reason = None


@pytest.mark.gen_test
async def test_a_circuit_held_for_work_the_database_refuses_stays_open_and_says_so_once(
        locked_sqlite, caplog):
    """A service started with its database down runs its migrations when a probe finds the
    database back; a migration the database refuses keeps the circuit open (calls go on
    to the spool) and is logged once, not at every probe."""
    path, holder = locked_sqlite
    holder.execute("ROLLBACK")
    db = ClassifiedSqliteDatabase(path, pragmas={"busy_timeout": 50})
    circuit = Circuit(db, interval=0.05)
    circuit.attach()
    tries, back = [], []
    circuit.when_back(lambda: back.append(True))

    def migrate():
        tries.append(True)
        if len(tries) < 4:
            db.execute_sql("SELECT no_such_column FROM t")  # refused, not down
        db.execute_sql("INSERT INTO t VALUES (1)")  # let through while the circuit is open
    try:
        circuit.hold_until(migrate, "migrations wait for it", DatabaseDown("down at start"))
        assert circuit.is_open and circuit.held_for == "migrations wait for it"
        with pytest.raises(DatabaseDown):
            db.execute_sql("SELECT 1")  # anything else is refused meanwhile
        await eventually(lambda: not circuit.is_open, timeout=10, interval=0.02)
        assert len(tries) == 4 and back == [True] and circuit.held_for is None
        assert db.execute_sql("SELECT count(*) FROM t").fetchone() == (1,)
    finally:
        await circuit.detach()
        db.close()
    assert caplog.text.count("the database answers, but the work the service waits for") == 1
