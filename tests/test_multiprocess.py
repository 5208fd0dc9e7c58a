"""Several service processes on one PostgreSQL (the way users outgrow one VM): the same
deliveries racing into both cause one effect each, and a scheduled job runs in one
process at a time. Real subprocesses, real PostgreSQL; run with -s for the figures."""
import asyncio
import collections
import datetime
import json

import pytest

from models import CrtcOrder, Outbox, WebhookEvent, utcnow
from tests.test_faults import eventually, figures, send, submitted
from tests.service_process import ServiceProcess, postgres_only

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
