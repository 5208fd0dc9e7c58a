"""Accepted means durable, under real faults: the service as a subprocess killed with
SIGKILL and restarted, its PostgreSQL cut off by a proxy, its downstreams off the
network. Each test prints its figures (run with -s to see them)."""
import asyncio
import collections
import json
import time

import pytest
from tornado.simple_httpclient import HTTPStreamClosedError

from models import ComplianceOrder, Outbox, WebhookEvent
from engine import outbox
from domain.reminders import send_reminders
from tests.conftest import WEBHOOK_SECRET
from tests.service_process import (
    ON_POSTGRES, RestartablePeer, ServiceProcess, TcpProxy, postgres_only)

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}


def submitted(number):
    return {"order_name": f"ORD-{number}", "order_number": f"FO-{number}",
            "state_code": "WY", "entity_name": f"Acme {number} LLC"}


async def send(client, service, path, body):
    """POST a webhook as its sender would; the status, or None when no answer came."""
    try:
        response = await client.fetch(f"{service.url}/api/v1/webhooks/{path}",
                                      method="POST", body=json.dumps(body), headers=AUTH,
                                      request_timeout=30)
    except (HTTPStreamClosedError, OSError):
        return None
    return response.code


async def eventually(condition, timeout=20):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.1)


def figures(name, **numbers):
    print(f"\n[{name}] " + ", ".join(f"{key}={value}" for key, value in numbers.items()))


def jobs_by_key(worker):
    return collections.Counter(r.headers["Idempotency-Key"] for r in worker.requests)


@pytest.fixture
def services(tmp_path):
    started = []

    def make(name, **env):
        service = ServiceProcess(tmp_path / f"{name}.log", **env)
        started.append(service)
        return service
    yield make
    for service in started:
        service.stop_now()


@pytest.fixture
def service_env(database_url, worker, frappe, tmp_path):
    return {"DATABASE_URL": database_url, "WORKER_URL": worker.url,
            "WORKFLOW_URL": frappe.url, "SPOOL_DIR": tmp_path / "spool"}


@pytest.mark.gen_test(timeout=60)
async def test_killed_mid_send_and_restarted_the_effect_goes_out_once(
        services, service_env, client, worker, frappe):
    service = await services("a", **service_env).start()
    worker.delay = 60  # takes the job and does not answer before the kill
    sending = asyncio.ensure_future(send(client, service, "formation/submitted", submitted(1)))
    await eventually(lambda: len(worker.requests) == 1)
    assert await service.kill() == -9
    assert await sending is None  # cut off: not acknowledged, so the sender will retry

    worker.delay = 0
    await service.start()
    assert await send(client, service, "formation/submitted", submitted(1)) == 200
    await eventually(lambda: len(worker.requests) == 2)
    await service.a_lease_later()  # nothing else goes out

    keys = jobs_by_key(worker)
    [event] = WebhookEvent.select()
    job = Outbox.get(Outbox.kind == "job")
    assert event.status == "processed" and job.status == "sent"
    assert list(keys.values()) == [2]  # one cut off by the kill, one delivered
    assert [r.json["action"] for r in frappe.requests] == ["Start Name Check"]
    figures("kill -9 mid-send", sent=2, acknowledged=1, handled=WebhookEvent.select().count(),
            distinct_jobs=len(keys), duplicated=0, lost=0)
    assert await service.terminate() == 0


@postgres_only
@pytest.mark.gen_test(timeout=90)
async def test_database_unreachable_calls_are_spooled_then_handled_once(
        services, service_env, database_url, client, worker):
    proxy, proxied_url = TcpProxy.in_front_of(database_url)
    try:
        service = await services("a", **{**service_env, "DATABASE_URL": proxied_url}).start()
        assert await send(client, service, "formation/submitted", submitted(0)) == 200

        proxy.cut()
        codes = [await send(client, service, "formation/submitted", submitted(n))
                 for n in range(1, 21)]
        codes += [await send(client, service, "formation/submitted", submitted(n))
                  for n in range(1, 6)]  # the senders' retries
        assert codes == [200] * 25
        assert len(worker.requests) == 1

        proxy.restore()
        await eventually(lambda: len(worker.requests) == 21)

        # Again, and this time the process dies before the database is back.
        proxy.cut()
        codes = [await send(client, service, "formation/submitted", submitted(n))
                 for n in range(21, 31)]
        assert codes == [200] * 10
        await service.kill()
        proxy.restore()
        await service.start()
        await eventually(lambda: len(worker.requests) == 31)
        await service.a_lease_later()
    finally:
        proxy.close()

    keys = jobs_by_key(worker)
    handled = WebhookEvent.select().where(WebhookEvent.status == "processed").count()
    assert handled == 31 and len(keys) == 31 and set(keys.values()) == {1}
    assert sorted(r.json["order_number"] for r in worker.requests) == sorted(
        f"FO-{n}" for n in range(31))
    figures("database unreachable", sent=36, acknowledged=36, handled=handled,
            duplicated=sum(keys.values()) - len(keys), lost=31 - len(keys))
    assert "spooled" in service.log()
    assert await service.terminate() == 0


@pytest.mark.skipif(ON_POSTGRES, reason="on PostgreSQL the test above cuts the database")
@pytest.mark.gen_test(timeout=60)
async def test_acknowledged_from_the_spool_killed_then_restarted_it_is_handled_once(
        services, service_env, db, client, worker):
    service = await services("a", **service_env).start()
    # Another process holds the write lock longer than the service waits for it.
    db.execute_sql("BEGIN EXCLUSIVE")
    try:
        assert await send(client, service, "formation/submitted", submitted(1)) == 200
        await service.kill()  # before any drain could store it
    finally:
        db.rollback()
    assert "spooled" in service.log() and worker.requests == []

    await service.start()
    await eventually(lambda: len(worker.requests) == 1)
    await service.a_lease_later()
    [event] = WebhookEvent.select()
    assert event.status == "processed" and len(worker.requests) == 1
    figures("acknowledged, kill -9 before handling", sent=1, acknowledged=1, handled=1,
            duplicated=0, lost=0)
    assert await service.terminate() == 0


STEPS = [("formation/submitted", "name_search", "Start Name Check"),
         ("formation/name-available", "file_entity", "Start Filing"),
         ("formation/filed-skip-ein", "generate_docs", "Skip EIN")]


@pytest.fixture
def worker(io_loop):
    """The worker of this module can go off the network and come back."""
    peer = RestartablePeer("worker", body={"ok": True})
    yield peer
    peer.stop()


@pytest.mark.gen_test(timeout=60)
async def test_downstreams_down_then_back_every_effect_once_in_order_per_order(
        post, ctx, clock, worker, frappe, smtp):
    clock.set(2026, 11, 20, 9, 0)
    worker.down()
    frappe.fail_with(503)
    smtp.box.refuse_with = "421 closing, try later"
    orders = [f"FO-{n}" for n in range(1, 6)]
    for path, _, _ in STEPS:
        for number in range(1, 6):
            status, _, _ = await post(f"/api/v1/webhooks/{path}", submitted(number), AUTH)
            assert status == 200
    for number in (1, 2):
        ComplianceOrder.create(order_number=f"CO-{number}", fulfillment_status="awaiting_intake",
                               customer_email=f"customer{number}@example.test")
    await send_reminders(ctx)
    assert Outbox.select().where(Outbox.status == "pending").count() == 32
    assert worker.requests == [] and smtp.messages == []

    worker.up()
    frappe.fail_with(200, {"message": {}})
    frappe.responses.append((417, {"exc_type": "WorkflowTransitionError"}))  # refused for good
    smtp.box.refuse_with = None
    back = len(frappe.requests)
    for _ in range(30):
        clock.advance(hours=7)
        await outbox.send_due(ctx)
        if not Outbox.select().where(Outbox.status == "pending").exists():
            break

    keys = jobs_by_key(worker)
    assert len(keys) == 15 and set(keys.values()) == {1}
    for number in orders:
        assert [r.json["action"] for r in worker.requests
                if r.json["order_number"] == number] == [job for _, job, _ in STEPS]
    # (The refused action's document is read back: GETs, not actions.)
    actions = [(json.loads(r.json["doc"])["name"], r.json["action"])
               for r in frappe.requests[back:] if r.method == "POST"]
    assert len(actions) == len(set(actions)) == 15
    [dead] = Outbox.select().where(Outbox.status == "dead")
    refused = (f"ORD-{dead.order_number[3:]}", json.loads(dead.payload)["action"])
    assert dead.kind == "workflow_action" and refused in actions
    for number in range(1, 6):
        assert [a for name, a in actions if name == f"ORD-{number}"] == [
            action for _, _, action in STEPS]
    mail = collections.Counter(rcpt[0] for rcpt, _ in smtp.messages)
    assert mail == {"customer1@example.test": 1, "customer2@example.test": 1,
                    "admin@example.test": 1}
    sent = Outbox.select().where(Outbox.status == "sent").count()
    assert sent == 32  # 31 effects and the admin's mail
    figures("downstreams down then back", events_sent=15, acknowledged=15, handled=15,
            effects=32, delivered=sent - 1, dead=1, admin_mails=1, duplicated=0, lost=0)
