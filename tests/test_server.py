"""The server around the handlers: a client too slow with its body, and what the service
has done by the time it tells systemd it is ready."""
import asyncio
import json
import logging
import os
import subprocess
import sys
import time

import pytest

from models import WebhookEvent
from tests.conftest import WEBHOOK_SECRET
from tests.ops_helpers import ROOT
from tests.waits import eventually

BODY_TIMEOUT = 0.5
WEBHOOK = "/api/v1/webhooks/formation/submitted"


def order(number):
    return json.dumps({"order_name": f"ORD-{number}", "order_number": f"FO-{number}",
                       "state_code": "WY", "entity_name": "Slow Worker LLC"}).encode()


def request_head(path, content_length):
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"X-Webhook-Secret: {WEBHOOK_SECRET}\r\n"
            f"Content-Length: {content_length}\r\n\r\n").encode()


async def read_response(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return status, json.loads(await reader.readexactly(length))


@pytest.mark.gen_test(timeout=30)
async def test_a_body_not_in_within_the_timeout_is_cut_off(app, http_server, http_port, caplog):
    app.body_timeout = BODY_TIMEOUT
    caplog.set_level(logging.INFO, "receiver")
    reader, writer = await asyncio.open_connection("127.0.0.1", http_port)
    writer.write(request_head(WEBHOOK, 1000) + b'{"order')
    sent = time.monotonic()

    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing answered
    assert time.monotonic() - sent >= BODY_TIMEOUT * 0.9
    writer.close()
    assert app.in_flight == 0
    assert "not in after 0.5 s; connection closed" in caplog.text


@pytest.mark.gen_test(timeout=30)
async def test_a_body_completed_as_the_deadline_runs_out_is_not_handled(
        app, http_server, http_port, worker):
    """The last bytes read in the same turn of the loop as the deadline runs out: the
    connection is closed, so the request is not handled either; nobody would get the
    answer."""
    app.body_timeout = BODY_TIMEOUT
    body = order(9)
    reader, writer = await asyncio.open_connection("127.0.0.1", http_port)
    writer.write(request_head(WEBHOOK, len(body)) + body[:5])
    await eventually(lambda: app.in_flight, interval=0.01)  # the headers in: the deadline runs
    writer.write(body[5:])
    time.sleep(BODY_TIMEOUT * 1.5)  # the loop busy (on purpose) until both are due at once

    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    assert app.in_flight == 0
    assert WebhookEvent.select().count() == 0
    assert worker.requests == []


@pytest.mark.gen_test(timeout=30)
async def test_a_handler_slower_than_the_body_timeout_still_answers(app, http_server, http_port,
                                                                   worker):
    """The deadline is for reading the body only: once it is in, the handler may take
    longer (here waiting on a slow worker), and the kept-alive connection stays usable."""
    app.body_timeout = BODY_TIMEOUT
    worker.delay = 3 * BODY_TIMEOUT
    reader, writer = await asyncio.open_connection("127.0.0.1", http_port)
    for number in (7, 8):  # the second on the same connection
        body = order(number)
        writer.write(request_head(WEBHOOK, len(body)) + body)
        assert await read_response(reader) == (
            200, {"received": True, "action": "name_search_dispatched"})
    assert len(worker.requests) == 2
    writer.close()


# The real `receiver.py serve`, reporting how many objects the garbage collector has set
# aside at the moment the service says READY=1, then leaving.
REPORT_AT_READY = """
import gc, os, sys
import receiver
from ops import systemd

def notify(state):
    if state.startswith("READY=1"):
        print(gc.get_freeze_count(), flush=True)
        os._exit(0)

systemd.notify = notify
sys.exit(receiver.main(["serve"]))
"""


def test_what_exists_at_startup_is_set_aside_from_the_garbage_collector(tmp_path,
                                                                        database_url):
    env = {**os.environ, "DATABASE_URL": database_url, "WEBHOOK_SECRET": WEBHOOK_SECRET,
           "RECEIVER_HOST": "127.0.0.1", "RECEIVER_PORT": "0",
           "SPOOL_DIR": str(tmp_path / "spool")}
    result = subprocess.run([sys.executable, "-c", REPORT_AT_READY], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # Modules, classes, the application and its routes: tens of thousands of objects.
    assert int(result.stdout) > 10_000, result.stdout
