"""Strangers at the webhooks: guessing credentials, sending bodies without them, secrets
that are not plain ASCII. Sent as the attacker sends them, to the real handlers."""
import dataclasses
import json
import logging

import pytest

from app.logs import RedactingFormatter, secrets_of
from handlers.budget import BodyBudget
from models import WebhookEvent
from tests import shkeeper, stripe_events as se
from tests.conftest import WEBHOOK_SECRET
from tests.public_helpers import served
from tests.raw_http import exchange, port_of, status_of

WORKFLOW_URL = "/api/v1/webhooks/formation/ready"
BODY = {"order_name": "ORD-1", "order_number": "FO-1"}
LIMIT = 3


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def settings(settings):
    return se.with_payment_processors(settings, auth_failure_limit=LIMIT,
                                      auth_failure_window_seconds=60)


@pytest.fixture
def throttle_clock(ctx):
    ctx.auth_failures.clock = Clock()
    return ctx.auth_failures.clock


def workflow_call(secret):
    return WORKFLOW_URL, BODY, {"X-Webhook-Secret": secret}


def crypto_call(key):
    return shkeeper.URL, shkeeper.encode(shkeeper.unconfirmed("CA-1")), shkeeper.key_headers(key)


def card_call(secret, clock):
    raw = se.raw_of(se.event("balance.available", se.balance()))
    return se.CARD_URL, raw, {"Stripe-Signature": se.sign(raw, secret, int(clock().timestamp()))}


# --- guessing: failures from one address throttled, the right credentials never ---------------

@pytest.mark.parametrize("sender,refused,right_status", [
    ("workflow", 401, 200), ("crypto", 401, 202), ("card", 400, 200)])
@pytest.mark.gen_test
async def test_failed_authentications_are_throttled_and_the_right_ones_still_pass(
        post, clock, throttle_clock, worker, sender, refused, right_status):
    def call(good):
        if sender == "workflow":
            return workflow_call(WEBHOOK_SECRET if good else "guess")
        if sender == "crypto":
            return crypto_call(shkeeper.API_KEY if good else "guess")
        return card_call(se.SECRET if good else "whsec_guess", clock)

    for _ in range(LIMIT):
        assert (await post(*call(False)))[0] == refused
    status, reply, response = await post(*call(False))
    assert (status, reply) == (429, {"error": "too many requests"})
    assert 1 <= int(response.headers["Retry-After"]) <= 60
    # The sender itself, from the same address, in the middle of it: answered as ever.
    assert (await post(*call(True)))[0] == right_status
    assert (await post(*call(False)))[0] == 429
    throttle_clock.now += 60
    assert (await post(*call(False)))[0] == refused


@pytest.mark.gen_test(timeout=60)
async def test_a_guessing_flood_writes_a_few_lines_not_one_per_guess(post, caplog,
                                                                   throttle_clock):
    for _ in range(60):
        await post(*workflow_call("guess"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) <= 2 * LIMIT + 2
    assert sum("429" in line for line in lines) == 2  # the first 429, and its warning


# --- credentials in headers are checked before a body is read --------------------------------

@pytest.mark.parametrize("path,headers,status", [
    (WORKFLOW_URL, b"X-Webhook-Secret: guess\r\n", 401),
    (shkeeper.URL, b"X-Shkeeper-Api-Key: guess\r\n", 401),
    (shkeeper.URL, b"", 401),
    (se.CARD_URL, b"", 400),
], ids=["workflow-wrong-secret", "crypto-wrong-key", "crypto-no-key", "card-no-signature"])
@pytest.mark.gen_test
async def test_a_call_without_the_right_header_credentials_is_refused_before_its_body(
        app, ctx, io_loop, path, headers, status):
    # The body is announced and never sent: only an answer from the headers comes back.
    head = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + headers
            + b"Content-Length: 60000\r\n\r\n")
    with served(app, ctx.settings) as url:
        answer = await io_loop.run_in_executor(None, exchange, port_of(url), head)
    assert status_of(answer) == status
    assert ctx.bodies.held == 0


def test_the_body_budget_caps_one_client_and_all_of_them():
    budget = BodyBudget(total_bytes=100, per_client_bytes=60)
    assert budget.take("a", 60) is None
    assert budget.take("a", 1) == "client"
    assert budget.take("b", 41) == "total"
    assert budget.take("b", 40) is None
    budget.give_back("a", 60)
    budget.give_back("b", 40)
    assert (budget.held, dict(budget.by_client)) == (0, {})


@pytest.mark.parametrize("per_client,total,status", [(64 * 1024, 10**9, 429),
                                                     (10**9, 64 * 1024, 503)],
                         ids=["one-client", "all-clients"])
@pytest.mark.gen_test
async def test_a_body_past_what_may_be_held_is_refused_as_it_comes(
        app, ctx, io_loop, per_client, total, status):
    ctx.bodies = BodyBudget(total, per_client)
    size = 256 * 1024
    head = (b"POST " + se.CARD_URL.encode() + b" HTTP/1.1\r\nHost: x\r\n"
            b"Stripe-Signature: t=1,v1=00\r\nContent-Length: %d\r\n\r\n" % size)
    pieces = [b"x" * 16384] * (size // 16384)
    with served(app, ctx.settings) as url:
        answer = await io_loop.run_in_executor(None, exchange, port_of(url), head, pieces)
    assert status_of(answer) == status
    assert b"Retry-After: 5" in answer
    assert ctx.bodies.held == 0
    assert WebhookEvent.select().count() == 0


# --- secrets that are not plain ASCII -------------------------------------------------------

@pytest.mark.gen_test
async def test_a_non_ascii_api_key_sent_as_utf8_is_accepted(app, ctx, io_loop):
    key = "clé-ключ-secret"
    ctx.settings = dataclasses.replace(ctx.settings, crypto_processor_api_key=key)
    raw = shkeeper.encode(shkeeper.unconfirmed("CA-1"))
    head = (b"POST " + shkeeper.URL.encode() + b" HTTP/1.1\r\nHost: x\r\n"
            b"X-Shkeeper-Api-Key: " + key.encode("utf-8") + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(raw))
    with served(app, ctx.settings) as url:
        answer = await io_loop.run_in_executor(None, exchange, port_of(url), head, [raw])
    assert status_of(answer) == 202
    wrong = head.replace("ключ".encode("utf-8"), "клюк".encode("utf-8"))
    with served(app, ctx.settings) as url:
        answer = await io_loop.run_in_executor(None, exchange, port_of(url), wrong, [raw])
    assert status_of(answer) == 401


@pytest.mark.parametrize("secret", ["back\\slash-secret", "clé-ключ-secret"])
@pytest.mark.gen_test
async def test_a_secret_in_tornados_malformed_header_line_is_redacted(
        app, ctx, io_loop, caplog, secret):
    caplog.set_level(logging.INFO)
    settings = dataclasses.replace(ctx.settings, webhook_secret=secret)
    # A control character makes the header invalid: Tornado logs the value with %r.
    head = (b"POST " + WORKFLOW_URL.encode() + b" HTTP/1.1\r\nHost: x\r\n"
            b"X-Webhook-Secret: " + secret.encode("utf-8") + b"\x01\r\n"
            b"Content-Length: 2\r\n\r\n{}")
    with served(app, settings) as url:
        await io_loop.run_in_executor(None, exchange, port_of(url), head)
    [record] = [r for r in caplog.records if "Invalid header value" in r.getMessage()]
    for formatter in (logging.Formatter("%(message)s"), _json_formatter()):
        line = RedactingFormatter(formatter, secrets_of(settings)).format(record)
        assert "[redacted]" in line
        for fragment in ("slash-secret", "secret", "back"):
            assert fragment not in line.replace("[redacted]", "")


def _json_formatter():
    from app.logs import JsonLogFormatter
    return JsonLogFormatter()
