"""Open connections: a crowd of idle ones neither starves real webhooks nor spins the
CPU on failed accepts. The real service, as a subprocess with a low `ulimit -n`."""
import asyncio
import json
import os
import resource
import socket
import sys
import time

import pytest
import tornado.netutil

from app.connections import ReceiverServer, connection_cap
from bench.run import cpu_seconds
from tests.conftest import WEBHOOK_SECRET
from tests.service_process import ServiceProcess

NOFILE = 200
IDLE = 400
BODY = json.dumps({"order_name": "ORD-1", "order_number": "FO-1"}).encode()


def open_idle(port, count):
    """`count` connections that never send a byte (or as many as get in)."""
    idle = []
    for _ in range(count):
        try:
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    return idle


def webhook(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /api/v1/webhooks/crtc/domain-ready HTTP/1.1\r\nHost: x\r\n"
                     b"X-Webhook-Secret: " + WEBHOOK_SECRET.encode() + b"\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(BODY) + BODY)
        return sock.recv(65536)


def test_the_cap_stays_below_the_descriptor_limit():
    assert connection_cap(4000, 1024) == 768
    assert connection_cap(4000, 200) == 150
    assert connection_cap(4000, 65536) == 4000
    assert connection_cap(100, 65536) == 100


@pytest.mark.gen_test(timeout=90)
async def test_idle_connections_past_the_limit_starve_nothing(tmp_path, database_url,
                                                               io_loop):
    service = ServiceProcess(tmp_path / "service.log", nofile=NOFILE,
                             DATABASE_URL=database_url, SPOOL_DIR=tmp_path / "spool")
    await service.start()
    try:
        before = cpu_seconds(service.process.pid)
        idle = await io_loop.run_in_executor(None, open_idle, service.port, IDLE)
        # Twice the limit are connected (the kernel's backlog takes what is not accepted)
        # and sit there; the service must still answer a real webhook, several times.
        answers = []
        for _ in range(5):
            answers.append(await io_loop.run_in_executor(None, webhook, service.port))
        await asyncio.sleep(1)  # the CPU the idle connections cost over a second: measured
        spent = cpu_seconds(service.process.pid) - before
        for sock in idle:
            sock.close()
    finally:
        await service.terminate()
    assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers), answers
    log = service.log()
    assert "Traceback" not in log and "Exception in callback" not in log
    assert len(log.splitlines()) < 40
    print(f"\n[idle flood] idle={len(idle)} nofile={NOFILE} cpu_seconds={spent:.2f} "
          f"log_lines={len(log.splitlines())}")


HOLD_CONNECTIONS = """
import socket, sys, time
sys.stdin.readline()
held = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(40)]
print("connected", flush=True)
time.sleep(float(sys.argv[2]))  # the connections held a while, then let go: the behaviour
"""


@pytest.mark.gen_test(timeout=60)
async def test_an_accept_without_descriptors_pauses_instead_of_spinning(app, ctx, caplog):
    [sock] = tornado.netutil.bind_sockets(0, "127.0.0.1")
    server = ReceiverServer(app, max_connections=10**6)
    server.add_sockets([sock])
    clients = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLD_CONNECTIONS, str(sock.getsockname()[1]), "1.5",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Room for 10 more descriptors in this process: the 11th connection cannot be taken.
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 10, hard))
    try:
        clients.stdin.write(b"go\n")
        assert await clients.stdout.readline() == b"connected\n"
        cpu = time.process_time()
        await asyncio.sleep(1)  # a second with the accept paused: a spin would spend it
        spent = time.process_time() - cpu
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    await clients.wait()
    server.stop()
    paused = [r for r in caplog.records if "cannot accept connections" in r.getMessage()]
    assert len(paused) == 1 and not paused[0].exc_info
    assert not [r for r in caplog.records if r.exc_info]
    print(f"\n[EMFILE] cpu_seconds_in_1s={spent:.2f}")
