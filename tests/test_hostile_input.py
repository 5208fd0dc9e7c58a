"""Hostile and odd input at the HTTP boundary: a byte-order mark, JSON nested past any
parser's depth, bodies too large in either framing. Every case is sent the way a sender
or an attacker sends it, to the real handlers."""
import json
import logging

import pytest

from models import CrtcOrder, FormationOrder, WebhookEvent
from ops import operator
from tests import shkeeper, stripe_events as se
from tests.conftest import WEBHOOK_SECRET
from tests.public_helpers import served
from tests.raw_http import exchange, port_of

BOM = b"\xef\xbb\xbf"
AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
WORKFLOW_URL = "/api/v1/webhooks/formation/submitted"
WORKFLOW_BODY = {"order_name": "ORD-1", "order_number": "FO-1", "state_code": "WY",
                 "entity_name": "Acme LLC"}
# 100,000 levels in 200 KB: far past the depth any JSON parser follows.
DEEP = b"[" * 100_000 + b"]" * 100_000
# Past it too, and within the smallest endpoint's body limit (a larger one is 413).
DEEP_AND_SMALL = b"[" * 7_000 + b"]" * 7_000


@pytest.fixture
def settings(settings):
    return se.with_payment_processors(settings)


async def replayed(ctx, event):
    return await operator.replay(ctx, event.id, force=True)


# --- a UTF-8 byte-order mark: accepted, handled, and replayed alike ------------------------

@pytest.mark.gen_test
async def test_a_workflow_body_with_a_byte_order_mark_is_handled_and_replays(
        post, ctx, worker, frappe):
    raw = BOM + json.dumps(WORKFLOW_BODY).encode()
    status, reply, _ = await post(WORKFLOW_URL, raw, AUTH)
    assert (status, reply) == (200, {"received": True, "action": "name_search_dispatched"})
    [event] = WebhookEvent.select()
    assert (event.status, event.last_error) == ("processed", None)
    assert await replayed(ctx, event) == "processed"
    assert worker.requests[0].json["order_number"] == "FO-1"


@pytest.mark.gen_test
async def test_a_card_event_with_a_byte_order_mark_is_handled_and_replays(post, ctx, clock):
    FormationOrder.create(order_number="FO-1")
    evt = se.event("checkout.session.completed", se.checkout_session("FO-1", "formation"))
    assert (await se.deliver(post, clock, raw=BOM + se.raw_of(evt)))[:2] == se.RECEIVED
    await ctx.drain_background()
    [event] = WebhookEvent.select()
    assert (event.status, event.last_error) == ("processed", None)
    assert FormationOrder.get().payment_status == "paid"
    assert await replayed(ctx, event) == "processed"


@pytest.mark.gen_test
async def test_a_crypto_callback_with_a_byte_order_mark_is_handled_and_replays(post, ctx):
    CrtcOrder.create(order_number="CA-1001")
    raw = BOM + shkeeper.encode(shkeeper.paid("CA-1001"))
    status, reply, _ = await post(shkeeper.URL, raw, shkeeper.key_headers())
    assert (status, reply) == (202, {"received": True})
    [event] = WebhookEvent.select()
    assert (event.status, event.last_error) == ("processed", None)
    assert CrtcOrder.get().payment_status == "paid"
    assert await replayed(ctx, event) == "processed"


# --- JSON nested past the parser's depth: 400 (or the sender's acknowledgement), one line --

def tracebacks(caplog):
    return [r for r in caplog.records if r.exc_info or r.exc_text]


@pytest.mark.parametrize("path,headers,answer", [
    (WORKFLOW_URL, AUTH, (400, {"error": "invalid JSON body"})),
    ("/api/v1/survey", {}, (400, {"error": "invalid JSON body"})),
    ("/api/v1/referral/check", {}, (400, {"error": "invalid JSON body"})),
], ids=["workflow", "survey", "referral-check"])
@pytest.mark.gen_test
async def test_deeply_nested_json_is_400_without_a_traceback(post, caplog, path, headers,
                                                             answer):
    status, reply, _ = await post(path, DEEP_AND_SMALL, headers)
    assert (status, reply) == answer
    assert tracebacks(caplog) == []
    assert WebhookEvent.select().count() == 0


@pytest.mark.gen_test
async def test_a_deeply_nested_card_event_is_checked_for_its_signature_first(
        post, clock, caplog):
    assert (await post(se.CARD_URL, DEEP, {"Stripe-Signature": "t=1,v1=00"}))[:2] == (
        400, {"error": "Webhook signature verification failed"})
    status, reply, _ = await se.deliver(post, clock, raw=DEEP)
    assert (status, reply) == se.RECEIVED
    [event] = WebhookEvent.select()
    assert event.status == "rejected"
    assert tracebacks(caplog) == []


@pytest.mark.gen_test
async def test_a_deeply_nested_crypto_callback_is_kept_as_rejected(post, caplog):
    status, reply, _ = await post(shkeeper.URL, DEEP, shkeeper.key_headers())
    assert (status, reply) == (202, {"received": True})
    [event] = WebhookEvent.select()
    assert (event.status, event.last_error) == ("rejected", "body is not JSON")
    assert tracebacks(caplog) == []


# --- bodies too large, in either framing: 413 with its JSON error, one log line --------------

def chunked(total, size=64 * 1024):
    for _ in range(total // size):
        yield b"%x\r\n" % size + b"x" * size + b"\r\n"
    yield b"0\r\n\r\n"


def fixed(total, size=64 * 1024):
    for _ in range(total // size):
        yield b"x" * size


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
@pytest.mark.gen_test
async def test_a_body_too_large_is_413_with_its_error_and_one_log_line(
        app, ctx, io_loop, caplog, framing):
    caplog.set_level(logging.INFO)
    total = 2 * 1024 * 1024
    if framing == "chunked":
        length, pieces = b"Transfer-Encoding: chunked", chunked(total)
    else:
        length, pieces = b"Content-Length: %d" % total, fixed(total)
    head = (b"POST /api/v1/webhooks/card-processor HTTP/1.1\r\nHost: x\r\n"
            b"Stripe-Signature: t=1,v1=00\r\n" + length + b"\r\n\r\n")
    with served(app, ctx.settings) as url:
        answer = await io_loop.run_in_executor(None, exchange, port_of(url), head, pieces)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 413 Request Entity Too Large"
    assert rest.endswith(b'{"error": "request body too large"}')
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "413" in line or "Malformed" in line] == [
        next(line for line in lines if line.startswith("413 POST"))]
    assert WebhookEvent.select().count() == 0


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
@pytest.mark.gen_test
async def test_head_on_the_probes_answers_like_get_without_a_body(http_client, base_url,
                                                                  path):
    get = await http_client.fetch(base_url + path, raise_error=False)
    head = await http_client.fetch(base_url + path, method="HEAD", raise_error=False)
    assert (head.code, head.body) == (get.code, b"")
    assert get.code in (200, 503) and get.body
