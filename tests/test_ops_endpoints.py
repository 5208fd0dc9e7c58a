"""GET /healthz, /readyz and /metrics against the real app, database and peers."""
import contextlib
import json
import os
import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.statements import StatementCount
from models import Outbox, WebhookEvent, database
from engine.connection import ReconnectingPostgresqlDatabase
from engine.errors import DatabaseDown
from app.server import prepare_spool
from engine import inbox
from engine.db import Circuit
from engine.spool import UNSTORABLE_NAME, append as append_to_spool
from scheduler import Scheduler
from app.context import Context
from tests.conftest import WEBHOOK_SECRET
from tests.service_process import database_down
from tests.waits import eventually

ALL_UP = {"worker": "up", "workflow": "up", "telegram": "up", "smtp": "up"}

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
SUBMITTED = {"order_name": "ORD-1", "order_number": "FO-1", "state_code": "WY",
             "entity_name": "Acme LLC"}
SUBMITTED_PATH = "/api/v1/webhooks/formation/submitted"


@pytest.fixture
def get(http_server, base_url, client):
    async def fetch(path):
        response = await client.fetch(base_url + path)
        return response.code, response
    return fetch


@contextlib.contextmanager
def unreachable_database():
    """Point the models at a PostgreSQL port nobody listens on, then back."""
    real = database.obj
    database.initialize(ReconnectingPostgresqlDatabase(
        "receiver", host="127.0.0.1", port=1, user="nobody", password="db-password-x",
        connect_timeout=1))
    try:
        yield
    finally:
        database.initialize(real)


async def start_scheduler(ctx):
    """The service's scheduler, without periodic jobs: only whether it runs matters."""
    ctx.scheduler = Scheduler(ctx, jobs=())
    await ctx.scheduler.start()
    return ctx.scheduler


@pytest.fixture
def scheduled(ctx, io_loop):
    """Stops the scheduler a test started, whatever the test's outcome."""
    yield
    if ctx.scheduler is not None:
        io_loop.run_sync(ctx.scheduler.stop)


def samples(body):
    """{(name, frozenset(labels)): value} of a Prometheus text exposition."""
    found = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found, name, **labels):
    return found.get((name, frozenset(labels.items())))


@pytest.mark.gen_test
async def test_healthz_answers_ok(get):
    code, response = await get("/healthz")
    assert code == 200 and json.loads(response.body) == {"status": "ok"}


@pytest.fixture
def spool(settings):
    """SPOOL_DIR as `serve` leaves it at start-up."""
    prepare_spool(settings.spool_dir)
    return settings.spool_dir


@pytest.mark.gen_test
async def test_readyz_is_ready_with_database_scheduler_and_spool(get, ctx, scheduled, spool):
    await start_scheduler(ctx)
    code, response = await get("/readyz")
    assert code == 200
    assert json.loads(response.body) == {
        "status": "ready", "checks": {"database": "ok", "scheduler": "ok", "spool": "ok",
                                     "spool_drain": "ok"},
        "destinations": ALL_UP,
        "reconciled": {"CRTC Order": None, "Formation Order": None}}


@pytest.mark.gen_test
async def test_readyz_without_a_scheduler_is_not_ready(get, spool):
    code, response = await get("/readyz")
    assert code == 503
    assert json.loads(response.body)["checks"] == {
        "database": "ok", "scheduler": "not started", "spool": "ok", "spool_drain": "ok"}


@pytest.mark.gen_test
async def test_readyz_says_what_is_wrong_with_the_spool(get, ctx, scheduled, settings):
    await start_scheduler(ctx)
    code, response = await get("/readyz")  # nobody created SPOOL_DIR
    assert code == 503 and json.loads(response.body)["checks"]["spool"] == "missing"
    with open(settings.spool_dir, "w"):  # a file where the directory should be
        pass
    code, response = await get("/readyz")
    assert code == 503 and json.loads(response.body)["checks"]["spool"] == "not a directory"
    os.remove(settings.spool_dir)
    prepare_spool(settings.spool_dir)
    os.chmod(settings.spool_dir, 0o500)
    code, response = await get("/readyz")
    if os.geteuid() != 0:  # root may write whatever the mode says
        assert code == 503 and json.loads(response.body)["checks"]["spool"] == "not writable"
    os.chmod(settings.spool_dir, 0o700)
    code, response = await get("/readyz")
    assert code == 200 and json.loads(response.body)["checks"]["spool"] == "ok"


@pytest.mark.gen_test
async def test_readyz_with_a_stopped_scheduler_is_not_ready(get, ctx, scheduled):
    await (await start_scheduler(ctx)).stop()
    code, response = await get("/readyz")
    assert code == 503 and json.loads(response.body)["checks"]["scheduler"] == "stopped"


@pytest.mark.gen_test
async def test_readyz_names_an_unreachable_database_without_its_secrets(get, ctx, scheduled,
                                                                        spool):
    await start_scheduler(ctx)
    with unreachable_database():
        code, response = await get("/readyz")
    assert code == 503
    assert json.loads(response.body) == {"status": "not ready", "checks": {
        "database": "unreachable", "scheduler": "ok", "spool": "ok", "spool_drain": "ok"},
        "destinations": ALL_UP}
    assert b"db-password-x" not in response.body and b"nobody" not in response.body


@pytest.mark.gen_test
async def test_metrics_count_events_by_source_type_and_outcome(get, post):
    await post("/api/v1/webhooks/formation/submitted", SUBMITTED, AUTH)
    await post("/api/v1/webhooks/formation/submitted", SUBMITTED, AUTH)  # a redelivery
    code, response = await get("/metrics")
    assert code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    found = samples(response.body)
    kind = {"source": "workflow", "type": "formation/submitted"}
    assert value(found, "receiver_events_total", outcome="processed", **kind) == 1
    assert value(found, "receiver_events_total", outcome="duplicate", **kind) == 1
    assert value(found, "receiver_event_handling_seconds_count", source="workflow") == 1
    assert value(found, "receiver_outbox_sends_total", destination="worker", result="sent") == 1
    assert value(found, "receiver_outbox_pending") == 0
    assert value(found, "receiver_database_up") == 1


@pytest.mark.gen_test
async def test_metrics_show_the_backlog_and_its_oldest_age(get, post, worker, clock):
    clock.set(2026, 11, 20, 9, 0, 0)
    worker.fail_with(503)
    await post("/api/v1/webhooks/formation/submitted", SUBMITTED, AUTH)
    clock.advance(seconds=90)
    found = samples((await get("/metrics"))[1].body)
    assert value(found, "receiver_outbox_pending") == 1
    assert value(found, "receiver_outbox_oldest_pending_age_seconds") == 90
    assert value(found, "receiver_outbox_sends_total", destination="worker", result="retry") == 1


@pytest.mark.gen_test
async def test_metrics_count_dead_rows_and_failed_events(get, post, worker):
    worker.fail_with(400)
    await post("/api/v1/webhooks/formation/submitted", SUBMITTED, AUTH)
    found = samples((await get("/metrics"))[1].body)
    assert Outbox.select().where(Outbox.status == "dead").count() == 1
    assert value(found, "receiver_outbox_dead") == 1
    assert value(found, "receiver_events_failed") == 0
    assert value(found, "receiver_events_dead") == 0


@pytest.mark.gen_test
async def test_metrics_count_failed_and_dead_events(get):
    for n, status in enumerate(("failed", "failed", "dead", "processed")):
        WebhookEvent.create(source="card", event_type="x", dedup_key=f"k{n}", payload="{}",
                            status=status)
    found = samples((await get("/metrics"))[1].body)
    assert value(found, "receiver_events_failed") == 2
    assert value(found, "receiver_events_dead") == 1


@pytest.mark.gen_test
async def test_metrics_measure_the_spool(get, settings):
    os.makedirs(settings.spool_dir, exist_ok=True)
    with open(os.path.join(settings.spool_dir, "inbox.jsonl"), "wb") as spooled:
        spooled.write(b"x" * 1234)
    found = samples((await get("/metrics"))[1].body)
    assert value(found, "receiver_spool_files") == 1
    assert value(found, "receiver_spool_bytes") == 1234


@pytest.mark.gen_test
async def test_metrics_still_answer_when_the_database_is_down(get):
    with unreachable_database():
        code, response = await get("/metrics")
    found = samples(response.body)
    assert code == 200
    assert value(found, "receiver_database_up") == 0
    assert value(found, "receiver_outbox_pending") is None
    assert value(found, "receiver_spool_files") == 0


def test_each_context_counts_on_its_own(settings, clock):
    first, second = Context.create(settings, clock), Context.create(settings, clock)
    first.metrics.event_duplicate("card", "balance.available")
    counted = {"source": "card", "type": "balance.available", "outcome": "duplicate"}
    assert value(samples(generate_latest(first.metrics.registry)),
                 "receiver_events_total", **counted) == 1
    assert value(samples(generate_latest(second.metrics.registry)),
                 "receiver_events_total", **counted) is None


@pytest.mark.gen_test
async def test_quarantined_spooled_calls_show_in_readyz_and_metrics(get, ctx, scheduled, spool):
    await start_scheduler(ctx)
    refused = {"source": "workflow", "event_type": "formation/submitted",
               "dedup_key": "poison", "unstorable": "StatementRefused: index row too big"}
    append_to_spool(spool, refused, name=UNSTORABLE_NAME)
    code, response = await get("/readyz")
    assert code == 200 and json.loads(response.body) == {
        "status": "ready", "checks": {"database": "ok", "scheduler": "ok", "spool": "ok",
                                     "spool_drain": "ok"},
        "destinations": ALL_UP, "spool_quarantined": 1,
        "reconciled": {"CRTC Order": None, "Formation Order": None}}
    code, response = await get("/metrics")
    assert value(samples(response.body), "receiver_spool_quarantined") == 1


def spool_wait(found):
    """What /metrics says of the calls waiting in the spool: (the oldest one's age, how
    long they have waited with the database answering)."""
    return (value(found, "receiver_spool_oldest_age_seconds"),
            value(found, "receiver_spool_waiting_seconds"))


@pytest.mark.gen_test
async def test_calls_the_spool_keeps_while_the_database_answers_make_the_service_unready(
        get, post, ctx, db, scheduled, spool, clock):
    """A call acknowledged into the spool that no drain stores while the database
    answers (another process held the drain's lock, say): up to SPOOL_WAIT_LIMIT_SECONDS
    on /readyz is ready and says how old it is; past it, not ready, and /metrics says
    how long it has waited. Drained, ready again."""
    await start_scheduler(ctx)  # its drain at start ran before the call came
    clock.set(2026, 11, 20, 9, 0, 0)
    with database_down(db):
        assert (await post(SUBMITTED_PATH, SUBMITTED, AUTH))[0] == 200
    limit = ctx.settings.spool_wait_limit_seconds
    clock.advance(seconds=limit)
    code, response = await get("/readyz")
    ready = json.loads(response.body)
    assert (code, ready["checks"]["spool_drain"], ready["spool_oldest_seconds"]) == (
        200, "ok", limit)
    assert spool_wait(samples((await get("/metrics"))[1].body)) == (limit, limit)

    clock.advance(seconds=1)
    code, response = await get("/readyz")
    assert (code, json.loads(response.body)["checks"]["spool_drain"]) == (503, "behind")
    clock.advance(seconds=ctx.settings.metrics_cache_seconds)
    waited = limit + 1 + ctx.settings.metrics_cache_seconds
    assert spool_wait(samples((await get("/metrics"))[1].body)) == (waited, waited)

    assert await inbox.drain_spool(ctx) == 1
    code, response = await get("/readyz")
    ready = json.loads(response.body)
    assert (code, ready["checks"]["spool_drain"], "spool_oldest_seconds" in ready) == (
        200, "ok", False)
    clock.advance(seconds=ctx.settings.metrics_cache_seconds)
    assert spool_wait(samples((await get("/metrics"))[1].body)) == (0, 0)


@pytest.mark.gen_test(timeout=30)
async def test_a_spool_an_outage_left_waits_from_the_database_return_not_its_first_call(
        get, post, ctx, db, scheduled, spool, clock):
    """Calls spooled through a ten-minute outage are older than the limit when the
    database is back: on their way (the drain starts at once), not stuck, so the
    service stays ready; /metrics has their age, and a wait counted from the return."""
    await start_scheduler(ctx)
    circuit = Circuit(db, interval=0.05)
    circuit.attach()
    try:
        clock.set(2026, 11, 20, 9, 0, 0)
        with database_down(db):
            assert (await post(SUBMITTED_PATH, SUBMITTED, AUTH))[0] == 200
        circuit.trip(DatabaseDown("the database did not answer within 1 s"))
        clock.advance(minutes=10)
        await eventually(lambda: not circuit.is_open, interval=0.05)  # its probe finds it back
        code, response = await get("/readyz")
        ready = json.loads(response.body)
        assert (code, ready["checks"]["spool_drain"], ready["spool_oldest_seconds"]) == (
            200, "ok", 600)
        age, waiting = spool_wait(samples((await get("/metrics"))[1].body))
        assert age == 600 and waiting < ctx.settings.spool_wait_limit_seconds
    finally:
        await circuit.detach()


@pytest.mark.gen_test
async def test_metrics_count_the_statements_and_round_trips_of_the_database(
        get, post, database_url):
    """What `make bench` divides by the webhooks of a run: every statement, BEGIN and
    COMMIT included, whichever thread sent it; and the round trips they cost."""
    async def sent():
        body = samples((await get("/metrics"))[1].body)
        return (value(body, "receiver_database_statements_total"),
                value(body, "receiver_database_round_trips_total"))
    await sent()  # the gauges' own queries, counted from the next scrape on (then cached)
    before = await sent()
    with StatementCount().open() as count:
        await post("/api/v1/webhooks/formation/submitted", SUBMITTED, AUTH)
    after = await sent()
    assert count.total > 0
    assert (after[0] - before[0], after[1] - before[1]) == (count.total, count.round_trips)
    if database_url.startswith("postgres"):  # its BEGINs went with other statements
        assert count.round_trips < count.total


@pytest.mark.gen_test
async def test_metrics_count_the_group_commit_turns(get, post):
    """`make bench` divides the statements by this for its round trips per turn: one
    webhook alone is stored and handled in at least one turn of its own."""
    async def turns():
        return value(samples((await get("/metrics"))[1].body), "receiver_database_turns_total")
    before = await turns()
    code, _, _ = await post("/api/v1/webhooks/formation/submitted", SUBMITTED, AUTH)
    assert code == 200
    assert await turns() - before >= 1


DEPLOY_MD = os.path.join(os.path.dirname(os.path.dirname(__file__)), "deploy", "DEPLOY.md")


def documented_families():
    """The metric families deploy/DEPLOY.md's table names (a row may name two)."""
    with open(DEPLOY_MD, encoding="utf-8") as doc:
        rows = [line for line in doc if line.startswith("| `receiver_")]
    return {name for row in rows for name in re.findall(r"`(receiver_\w+)", row.split(" | ")[0])}


@pytest.mark.gen_test
async def test_deploy_md_names_every_family_metrics_serves_and_no_other(get):
    """Its table lacked 13 of the families /metrics serves."""
    code, response = await get("/metrics")
    # (`_created`: the client library's own gauge of when each counter was made.)
    served = {family.name for family in text_string_to_metric_families(response.body.decode())
              if family.name.startswith("receiver_") and not family.name.endswith("_created")}
    # A counter's family is named without its `_total`; the table names its sample.
    documented = {name.removesuffix("_total") for name in documented_families()}
    assert (sorted(served - documented), sorted(documented - served)) == ([], [])
    # And each with the labels the table gives it.
    labelled = {}
    for family in text_string_to_metric_families(response.body.decode()):
        for sample in family.samples:
            labelled.setdefault(family.name, set()).update(sample.labels)
    with open(DEPLOY_MD, encoding="utf-8") as doc:
        for name, labels in re.findall(r"`(receiver_\w+?)(?:_total)?\{([^}]*)\}`", doc.read()):
            if labelled.get(name):
                assert labelled[name] - {"le"} == set(labels.split(",")), name
