"""Several service processes on one PostgreSQL (the way users outgrow one VM): the same
deliveries racing into both cause one effect each, a scheduled job runs in one process
at a time, and calls about the same hot orders through a database cut are all stored and
handled, with no false outage. Real subprocesses, real PostgreSQL; run with -s for the
figures."""
import asyncio
import collections
import datetime
import json
import os
import re
import time

import pytest
from tornado.simple_httpclient import HTTPStreamClosedError

from models import ORDER_MODELS, CrtcOrder, Outbox, WebhookEvent, utcnow
from tests import shkeeper
from tests.conftest import WEBHOOK_SECRET
from tests.test_faults import figures, send, submitted
from tests.waits import eventually
from tests.service_process import ServiceProcess, TcpProxy, postgres_only

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}

pytestmark = postgres_only


@pytest.fixture
def two_services(database_url, worker, frappe, tmp_path):
    # No process dies here, so no row waits for a lease to run out; a lease well past a
    # send and the record of its outcome on a loaded machine (3 s did not always last
    # them in CI) keeps the other process from sending a job again whose first send was
    # still going on: at-least-once delivery, by design, but not what these tests count.
    env = {"DATABASE_URL": database_url, "WORKER_URL": worker.url,
           "WORKFLOW_URL": frappe.url, "SPOOL_DIR": tmp_path / "spool",
           "CLAIM_LEASE_SECONDS": 15}
    services = [ServiceProcess(tmp_path / f"{name}.log", **env) for name in "ab"]
    yield services
    for service in services:
        service.stop_now()


@pytest.mark.gen_test(timeout=60)
async def test_the_same_50_deliveries_to_two_processes_cause_one_effect_each(
        two_services, client, worker, frappe):
    a, b = two_services
    await asyncio.gather(a.start(), b.start())
    deliveries = []
    for number in range(50):
        first, second = (a, b) if number % 2 else (b, a)
        deliveries += [send(client, first, "formation/submitted", submitted(number)),
                       send(client, second, "formation/submitted", submitted(number))]
    codes = await asyncio.gather(*deliveries)
    await eventually(lambda: len(worker.requests) >= 50 and len(frappe.posts) >= 50)
    await a.a_lease_later()  # nothing else goes out

    keys = collections.Counter(r.headers["Idempotency-Key"] for r in worker.requests)
    actions = collections.Counter(json.loads(r.json["doc"])["name"] for r in frappe.posts)
    assert codes == [200] * 100
    assert WebhookEvent.select().count() == 50
    assert len(keys) == 50 and set(keys.values()) == {1}
    assert len(actions) == 50 and set(actions.values()) == {1}
    assert Outbox.select().where(Outbox.status == "sent").count() == 100
    figures("two processes, same 50 events", sent=100, acknowledged=codes.count(200),
            handled=WebhookEvent.select().count(), jobs=len(keys),
            duplicated=sum(keys.values()) - len(keys), lost=50 - len(keys))
    assert await asyncio.gather(a.terminate(), b.terminate()) == [0, 0]


@pytest.mark.gen_test(timeout=60)
async def test_the_settlement_job_runs_in_one_process_at_a_time(two_services, frappe):
    paid = utcnow() - datetime.timedelta(days=10)
    for number in range(3):
        CrtcOrder.create(order_number=f"CR-{number}", payment_status="paid",
                         payment_method="card", paid_at=paid)
    frappe.delay = 1.2  # a run takes 3.6 s: both processes start within it

    await asyncio.gather(*(service.start() for service in two_services))
    assert len(frappe.posts) < 3  # the first run is still going on
    await eventually(lambda: len(frappe.posts) == 3)
    await ServiceProcess.a_lease_later()

    names = sorted(json.loads(r.json["doc"])["name"] for r in frappe.posts)
    assert names == ["CR-0", "CR-1", "CR-2"]
    assert CrtcOrder.select().where(CrtcOrder.funds_available == True).count() == 3  # noqa: E712
    settled_in = [s for s in two_services if "funds settled" in s.log()]
    assert len(settled_in) == 1
    figures("settlement in two processes", orders=3, frappe_calls=len(names),
            processes_that_ran_it=len(settled_in))


# --- two instances, hot orders, a short database cut ---------------------------------------

# A few orders of three kinds that every call is about: their rows are what two
# processes' turns lock, crossed (renames, payments, fulfilment moves).
HOT_ORDERS = {"formation": ("FO-H1", "FO-H2"), "compliance": ("CO-H1", "CO-H2"),
              "canada_crtc": ("CA-H1", "CA-H2")}
# Fulfilment gates a compliance order may move between, back and forth, for good.
GATES = ("awaiting_customer_delegation", "awaiting_secure_credentials")
CALLS = 2000
SENDERS = 48
# The database is cut once this share of the calls is acknowledged, for this long.
CUT_AFTER = 0.75
CUT_SECONDS = 2
# How long the spools and the inbox are given to settle after the last call.
SETTLE_SECONDS = 60
# What a cut of the database (the proxy drops every connection) looks like to psycopg2,
# as opposed to a database that answers: a timeout, a deadlock, a lock, a call's budget.
NOT_THE_CUT = re.compile(r"timeout|did not answer|deadlock|lock|budget", re.IGNORECASE)
LOGGED_AT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) WARNING receiver\.db "
                       r"database down \((.*)\): calls go to the spool", re.MULTILINE)


def hot_call(number):
    """Call `number`: (path, body, headers, identity), the identity what its stored
    event is found by (the workflow calls' Idempotency-Key, a payment's txid)."""
    orders = [order for kind in HOT_ORDERS.values() for order in kind]
    order = orders[number // 3 % len(orders)]
    if number % 3 == 0:
        key = f"rename-{number}"
        return ("webhooks/crtc/domain-ready", {"order_name": f"NAME-{number}",
                                               "order_number": order},
                {**AUTH, "Idempotency-Key": key}, key)
    if number % 3 == 1:
        txid = f"tx-hot-{number}"
        return ("webhooks/crypto-processor", shkeeper.paid(order, txid=txid),
                shkeeper.key_headers(), txid)
    key = f"move-{number}"
    compliance = HOT_ORDERS["compliance"][number // 3 % 2]
    return (f"webhooks/fulfillment/{GATES[number // 6 % 2]}", {"order_number": compliance},
            {**AUTH, "Idempotency-Key": key}, key)


async def post_to(client, service, path, body, headers):
    try:
        response = await client.fetch(f"{service.url}/api/v1/{path}", method="POST",
                                      body=json.dumps(body), headers=headers,
                                      request_timeout=30)
    except (HTTPStreamClosedError, OSError):
        return None
    return response.code


def stored_identities():
    """The identities (as `hot_call` names them) of the calls stored, and how many
    events are stored but not finished."""
    found, unfinished = set(), 0
    for event in WebhookEvent.select():
        if event.source == "crypto":
            found.add(json.loads(event.payload)["transactions"][0]["txid"])
        else:
            found.add(event.dedup_key.rsplit(":key:", 1)[-1])
        unfinished += event.status in ("received", "failed")
    return found, unfinished


def spooled_lines(folders):
    lines = 0
    for folder in folders:
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            if name.endswith((".jsonl", ".draining")) and name != "unstorable.jsonl":
                with open(os.path.join(folder, name), "rb") as spooled:
                    lines += sum(1 for _ in spooled)
    return lines


def outages(log, cut_from, cut_to):
    """(the outages taken while the database was cut, those taken while it answered:
    each a (time, reason) of a `database down` line of a service's log)."""
    true, false = [], []
    for logged_at, reason in LOGGED_AT.findall(log):
        at = datetime.datetime.strptime(logged_at, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        cut = cut_from <= at <= cut_to and not NOT_THE_CUT.search(reason)
        (true if cut else false).append((round(at - cut_from, 2), reason[:120]))
    return true, false


@pytest.mark.gen_test(timeout=240)
async def test_two_instances_on_hot_orders_through_a_database_cut_lose_nothing(
        database_url, worker, frappe, tmp_path, client):
    """Two service processes on one PostgreSQL (each its own spool, as on two hosts), at
    the default DATABASE_TIMEOUT_MS (1 s: PostgreSQL's deadlock_timeout), share calls
    about a few hot orders of three kinds (renames, payments, fulfilment moves: their
    turns lock the same orders), a quarter of them sent to both (a sender's retry) in
    either order, and their database is cut for a moment. Every call acknowledged is
    stored and handled, both spools drain, and neither process takes the database for
    down but while it was cut."""
    for kind, numbers in HOT_ORDERS.items():
        for number in numbers:
            ORDER_MODELS[kind].create(order_number=number, order_name=f"{number}-0")
    proxy, proxied_url = TcpProxy.in_front_of(database_url)
    spools = [tmp_path / "spool-a", tmp_path / "spool-b"]
    services = [ServiceProcess(tmp_path / f"{name}.log", DATABASE_URL=proxied_url,
                               DATABASE_TIMEOUT_MS=1000, WORKER_URL=worker.url,
                               WORKFLOW_URL=frappe.url, SPOOL_DIR=folder,
                               CRYPTO_PROCESSOR_API_KEY=shkeeper.API_KEY,
                               CLAIM_LEASE_SECONDS=15)
                for name, folder in zip("ab", spools)]
    try:
        await asyncio.gather(*(service.start() for service in services))
        calls = iter(range(CALLS))
        acknowledged, answers = set(), collections.Counter()

        async def sender():
            for number in calls:
                path, body, headers, identity = hot_call(number)
                # One instance or the other, as a load balancer spreads calls; every
                # fourth to both (a sender's retry), in either order.
                pair = services if number % 2 else services[::-1]
                codes = await asyncio.gather(*(post_to(client, service, path, body, headers)
                                               for service in pair[:1 + (number % 4 == 0)]))
                answers.update(codes)
                if any(code in (200, 202) for code in codes):
                    acknowledged.add(identity)

        senders = asyncio.gather(*(sender() for _ in range(SENDERS)))
        while len(acknowledged) < CALLS * CUT_AFTER:
            await asyncio.sleep(0.05)
        cut_from = time.time()
        proxy.cut()
        await asyncio.sleep(CUT_SECONDS)  # the cut lasts this long: the fault under test
        proxy.restore()
        cut_to = time.time()
        await senders
        settled_by = time.monotonic() + SETTLE_SECONDS
        while spooled_lines(spools) and time.monotonic() < settled_by:
            await asyncio.sleep(0.1)
        drained_in = time.time() - cut_to
        while stored_identities()[1] and time.monotonic() < settled_by:
            await asyncio.sleep(0.1)
        found, unfinished = stored_identities()
        ready = [(await client.fetch(f"{service.url}/readyz")).code for service in services]
        # The log writes its times in milliseconds, cut off.
        counted = [outages(service.log(), cut_from - 0.1, cut_to + 1.5)
                   for service in services]
        figures("two instances, hot orders, a database cut", calls=CALLS,
                requests=sum(answers.values()), answers=dict(answers),
                acknowledged=len(acknowledged), lost=len(acknowledged - found),
                stuck_in_a_spool=spooled_lines(spools), unfinished=unfinished,
                spools_drained_s=round(drained_in, 1),
                outages_during_the_cut=[len(true) for true, _ in counted],
                false_outages=[false for _, false in counted], ready=ready)
        assert set(answers) <= {200, 202}
        assert acknowledged == {hot_call(number)[3] for number in range(CALLS)}
        assert acknowledged <= found and not spooled_lines(spools) and not unfinished
        assert [false for _, false in counted] == [[], []]
        assert ready == [200, 200]
        assert await asyncio.gather(*(service.terminate() for service in services)) == [0, 0]
    finally:
        for service in services:
            service.stop_now()
        proxy.close()


STREAMS = 40


def change_of(number, modified):
    """A Formation Order's `submitted` change as Frappe's webhook names it: its save's
    `modified`, in the site's time zone (WORKFLOW_TIME_ZONE=UTC below)."""
    return {**submitted(number), "modified": modified.strftime("%Y-%m-%d %H:%M:%S.%f")}


@pytest.mark.gen_test(timeout=90)
async def test_two_processes_handle_one_documents_changes_one_after_another(
        database_url, worker, frappe, tmp_path, client):
    """Two changes of one document (its second save after the first), the first sent to
    one process and the second to the other at the same moment, for 40 documents: each
    process may store its change before the other's is committed, so neither would see
    the other's by reading alone. Whichever is handled first, the other is handled after
    it has committed: the earlier change then acted on before the later one, or (the later
    one handled first) recorded as history. Never both acted on as if alone, the earlier
    change's job sent after the later one's."""
    env = {"DATABASE_URL": database_url, "WORKER_URL": worker.url,
           "WORKFLOW_URL": frappe.url, "SPOOL_DIR": tmp_path / "spool",
           "WORKFLOW_TIME_ZONE": "UTC", "CLAIM_LEASE_SECONDS": 15}
    services = [ServiceProcess(tmp_path / f"{name}.log", **env) for name in "ab"]
    try:
        await asyncio.gather(*(service.start() for service in services))
        saved = datetime.datetime.now(datetime.timezone.utc)
        for number in range(STREAMS):
            first, second = services if number % 2 else services[::-1]
            codes = await asyncio.gather(
                send(client, first, "formation/submitted", change_of(number, saved)),
                send(client, second, "formation/submitted",
                     change_of(number, saved + datetime.timedelta(milliseconds=1))))
            assert codes == [200, 200]
        await eventually(lambda: not WebhookEvent.select().where(
            WebhookEvent.status.in_(("received", "failed"))).exists())
        await services[0].a_lease_later()

        in_turn, history = 0, 0
        for number in range(STREAMS):
            earlier, later = WebhookEvent.select().where(
                WebhookEvent.order_number == f"FO-{number}").order_by(WebhookEvent.version)
            jobs = list(Outbox.select().where(Outbox.order_number == f"FO-{number}",
                                              Outbox.kind == "job").order_by(Outbox.id))
            if earlier.status == "ignored":
                # The later change handled first: the earlier one is history, after it.
                assert "older than the state change" in earlier.last_error, number
                assert later.status == "processed" and len(jobs) == 1, number
                assert earlier.processed_at > later.processed_at, number
                history += 1
            else:
                assert (earlier.status, later.status) == ("processed", "processed"), number
                assert earlier.processed_at < later.processed_at, number
                assert [job.event_id for job in jobs] == [earlier.id, later.id], number
                in_turn += 1
        sent = [r.json["order_number"] for r in worker.requests]
        figures("one document's two changes in two processes", documents=STREAMS,
                in_turn=in_turn, history=history, jobs=len(sent))
        assert len(sent) == 2 * in_turn + history
    finally:
        for service in services:
            service.stop_now()
