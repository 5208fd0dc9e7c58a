"""SIGTERM while a request waits on a slow worker: the request completes, then the
process exits 0. The real service runs in a subprocess and tells a real notify socket
(systemd's Type=notify protocol) when it is ready and when it stops."""
import asyncio
import json
import signal
import socket
import time

import pytest

from ops import systemd
from tests.conftest import WEBHOOK_SECRET
from tests.ops_helpers import NotifySocket, Service
from tests.waits import eventually

BODY = {"order_name": "ORD-7", "order_number": "FO-7", "state_code": "WY",
        "entity_name": "Slow Worker LLC"}


@pytest.fixture
def notify_socket(tmp_path):
    sock = NotifySocket(str(tmp_path / "notify.sock"))
    yield sock
    sock.close()


@pytest.fixture
def service(tmp_path, database_url, worker, frappe, notify_socket):
    running = Service(tmp_path / "service.log", {
        "DATABASE_URL": database_url, "WEBHOOK_SECRET": WEBHOOK_SECRET,
        "WORKER_URL": worker.url, "WORKFLOW_URL": frappe.url,
        "SPOOL_DIR": str(tmp_path / "spool"), "NOTIFY_SOCKET": notify_socket.path,
        "WATCHDOG_USEC": "400000"})
    yield running
    running.kill()


def idle_keep_alive_connection(port):
    """A client that made one HTTP/1.1 request and keeps its connection open."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
    assert conn.recv(4096).startswith(b"HTTP/1.1 200")
    return conn


@pytest.mark.gen_test(timeout=60)
async def test_sigterm_lets_a_slow_request_finish_then_exits_0(service, client, worker,
                                                               notify_socket):
    worker.delay = 2.0
    await service.start()
    ready = await notify_socket.wait_for("READY=1")
    assert f"STATUS=listening on 127.0.0.1:{service.port}" in ready[-1]
    await notify_socket.wait_for("WATCHDOG=1", timeout=2)  # every 0.2 s (WATCHDOG_USEC / 2)
    idle = idle_keep_alive_connection(service.port)

    in_flight = asyncio.ensure_future(client.fetch(
        service.url + "/api/v1/webhooks/formation/submitted", method="POST",
        body=json.dumps(BODY), request_timeout=30,
        headers={"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}))
    await eventually(lambda: worker.requests, interval=0.02)  # it now waits on the worker
    service.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    await notify_socket.wait_for("STOPPING=1")

    with pytest.raises(ConnectionRefusedError):  # no new connections once stopping
        await client.fetch(service.url + "/healthz", request_timeout=5)

    response = await in_flight
    assert response.code == 200, service.log()
    assert json.loads(response.body) == {"received": True, "action": "name_search_dispatched"}
    assert await service.wait_exit() == 0
    took = time.monotonic() - signalled
    # The worker answered after 2 s; the idle keep-alive connection did not hold us up.
    assert 1.5 < took < 10, took
    assert idle.recv(4096) == b""  # cut once the requests in flight were done
    idle.close()
    assert "stopped" in service.log()


def test_notify_reaches_an_abstract_socket():
    name = f"receiver-test-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind("\0" + name)
        listener.settimeout(5)
        assert systemd.notify("READY=1", {"NOTIFY_SOCKET": "@" + name})
        assert listener.recv(100) == b"READY=1"


def test_notify_without_systemd_does_nothing():
    assert systemd.notify("READY=1", {}) is False


def test_notify_to_a_missing_socket_is_logged_not_raised(tmp_path, caplog):
    assert systemd.notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False
    assert "READY=1" in caplog.text and "not delivered" in caplog.text


def test_watchdog_interval_is_half_of_watchdog_sec():
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15
    assert systemd.watchdog_interval({}) is None
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000",
                                      "WATCHDOG_PID": "1"}) is None


@pytest.mark.gen_test(timeout=60)
async def test_an_upload_abandoned_mid_body_does_not_hold_up_the_stop(service, client,
                                                                     notify_socket, tmp_path):
    await service.start()
    await notify_socket.wait_for("READY=1")
    # SPOOL_DIR is made at start-up, before any call needs it, and /readyz checks it.
    assert (tmp_path / "spool").is_dir()
    ready = await client.fetch(service.url + "/readyz")
    assert ready.code == 200 and json.loads(ready.body)["checks"]["spool"] == "ok"
    for path in ("/api/v1/webhooks/formation/submitted", "/api/v1/survey"):
        upload = socket.create_connection(("127.0.0.1", service.port), timeout=10)
        upload.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: "
                       "application/json\r\nContent-Length: 1000\r\n\r\n{\"order".encode())
        # The service (another process, which shows nothing of it) has chosen a handler
        # and reads the body.
        await asyncio.sleep(0.3)
        upload.close()  # the client gives up mid-body
    # The service saw both connections go; a later request still works.
    assert (await client.fetch(service.url + "/healthz")).code == 200

    service.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert await service.wait_exit() == 0
    assert time.monotonic() - signalled < 5, service.log()
    assert "still running" not in service.log()


@pytest.mark.gen_test(timeout=120)
async def test_a_stop_while_a_peer_holds_a_send_ends_within_the_stop_budget(
        tmp_path, database_url, worker, frappe, client):
    """The worker never answers and may take 10 minutes to time out; the stop does not
    wait for it past STOP_TIMEOUT_SECONDS. The job stays leased, and goes again after the
    lease, as after a crash."""
    worker.hold = asyncio.Event()  # never set: the job's send waits on it
    service = Service(tmp_path / "service.log", {
        "DATABASE_URL": database_url, "WEBHOOK_SECRET": WEBHOOK_SECRET,
        "WORKER_URL": worker.url, "WORKFLOW_URL": frappe.url,
        "SPOOL_DIR": str(tmp_path / "spool"), "OUTBOUND_TIMEOUT_SECONDS": "600",
        "CLAIM_LEASE_SECONDS": "1200", "STOP_TIMEOUT_SECONDS": "6",
        "WORKFLOW_ANSWER_BUDGET_SECONDS": "0.5"})
    try:
        await service.start()
        await service.wait_ready(client)
        response = await client.fetch(
            service.url + "/api/v1/webhooks/formation/submitted", method="POST",
            body=json.dumps(BODY), request_timeout=30,
            headers={"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"})
        assert response.code == 200  # answered; the job's send goes on in the background
        assert len(worker.requests) == 1
        service.process.send_signal(signal.SIGTERM)
        assert await service.wait_exit(timeout=90) == 0
        assert "background task(s) still busy; cancelling them" in service.log()
    finally:
        worker.hold.set()
        service.kill()
