"""Every route bounded before it reads: a body limit per route, counted in the body caps,
connections per address, eviction of requests whose body never starts, and the senders
never refused for a stranger's bytes. Sent as raw bytes on loopback, from several
loopback addresses (127.0.0.x are all this machine's)."""
import asyncio
import dataclasses
import ipaddress
import json
import logging
import socket

import pytest

from app.server import make_app, prepare_spool
from handlers.addresses import client_key, forwarded_for
from handlers.budget import BodyBudget
from settings import ConfigurationError, Settings
from tests import shkeeper, stripe_events as se
from tests.conftest import WEBHOOK_SECRET
from tests.console_helpers import console_settings
from tests.public_helpers import served
from tests.raw_http import exchange, port_of, status_of

BODY = json.dumps({"order_name": "ORD-1", "order_number": "FO-1"}).encode()


@pytest.fixture
def settings(settings):
    return se.with_payment_processors(console_settings(settings))


def head(method, path, length, extra=b""):
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\n".encode() + extra
            + b"Content-Length: %d\r\n\r\n" % length)


def webhook_from(port, source="127.0.0.1"):
    with socket.create_connection(("127.0.0.1", port), timeout=10,
                                  source_address=(source, 0)) as sock:
        sock.sendall(head("POST", "/api/v1/webhooks/crtc/domain-ready", len(BODY),
                          b"X-Webhook-Secret: " + WEBHOOK_SECRET.encode() + b"\r\n"
                          b"Connection: close\r\n") + BODY)
        return status_of(sock.recv(65536))


def bodiless(port, count, source="127.0.0.1"):
    """`count` requests whose headers are complete and whose body never comes (a card
    webhook announcing 1,000 bytes); the sockets, to keep them open."""
    held = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                        source_address=(source, 0))
        sock.sendall(head("POST", se.CARD_URL, 1000, b"Stripe-Signature: t=1,v1=00\r\n"))
        held.append(sock)
    return held


# --- 1. a body limit for every route, before a byte is read ----------------------------------

@pytest.mark.parametrize("method,path,length", [
    ("POST", "/console/login", 1_000_000),
    ("POST", "/console/events/1/replay", 1_000_000),
    ("GET", "/console/", 100),
    ("POST", "/metrics", 1_000_000),
    ("POST", "/api/v1/ifta/filed", 5000),
    ("GET", "/api/v1/openapi.yaml", 100),
    ("GET", "/healthz", 100),
    ("POST", "/console/nowhere", 1_000_000),
])
@pytest.mark.gen_test
async def test_a_body_over_the_routes_limit_is_refused_from_its_headers(
        app, ctx, io_loop, method, path, length):
    """Announced and never sent: only an answer from the headers comes back (the old code
    read the body first, up to MAX_BODY_BYTES, and this waited in vain)."""
    with served(app, ctx.settings) as url:
        answer = await io_loop.run_in_executor(None, exchange, port_of(url),
                                               head(method, path, length), (), 5)
    assert status_of(answer) == 413
    assert ctx.bodies.held == 0


@pytest.mark.gen_test
async def test_a_login_form_counts_in_its_addresss_body_cap(app, ctx, io_loop):
    """Within the route's limit, but past what the address may hold (the old code held
    page bodies outside both caps)."""
    ctx.bodies = BodyBudget(total_bytes=10**9, per_client_bytes=1000)
    with served(app, ctx.settings) as url:
        answer = await io_loop.run_in_executor(
            None, exchange, port_of(url),
            head("POST", "/console/login", 2000,
                 b"Content-Type: application/x-www-form-urlencoded\r\n"), (), 5)
    assert status_of(answer) == 429
    assert b"Retry-After: 5" in answer
    assert ctx.bodies.held == 0


@pytest.mark.gen_test
async def test_a_login_form_is_held_then_given_back(app, ctx, io_loop):
    """The form is read (an answer comes: 403, no xsrf token) and what it held is given
    back."""
    form = b"name=Dana&password=x"
    with served(app, ctx.settings) as url:
        answer = await io_loop.run_in_executor(
            None, exchange, port_of(url),
            head("POST", "/console/login", len(form),
                 b"Content-Type: application/x-www-form-urlencoded\r\n") + form, (), 5)
    assert status_of(answer) == 403
    assert ctx.bodies.held == 0 and not ctx.bodies.by_client


# --- 2. connections per address; body-less requests evicted first -----------------------------

@pytest.fixture
def capped(ctx, app):
    """The service with room for 8 connections: 2 per address."""
    return app, dataclasses.replace(ctx.settings, max_connections=8)


@pytest.mark.gen_test(timeout=60)
async def test_one_address_cannot_fill_the_connection_cap_with_bodiless_requests(
        capped, io_loop):
    """The old code: 8 body-less requests from one address left the others 503 for the
    whole body deadline."""
    app, settings = capped
    with served(app, settings) as url:
        port = port_of(url)
        held = await io_loop.run_in_executor(None, bodiless, port, 8)
        try:
            statuses = [await io_loop.run_in_executor(None, webhook_from, port, "127.0.0.2")
                        for _ in range(3)]
        finally:
            for sock in held:
                sock.close()
    assert statuses == [200, 200, 200]


def closed(sock):
    sock.setblocking(False)
    try:
        return sock.recv(100) == b""
    except BlockingIOError:
        return False


async def newcomer_among(app, settings, io_loop, holders, newcomer):
    """Each (address, count) of `holders` holds that many body-less requests; once all are
    waiting for their bodies, a webhook from `newcomer`: its status, and the positions
    (in `holders`' order) of the held connections closed to make room for it."""
    with served(app, settings) as url:
        port = port_of(url)
        held = []
        for source, count in holders:
            held += await io_loop.run_in_executor(None, bodiless, port, count, source)
        try:
            for _ in range(500):
                if len(app.waiting_for_body) == len(held):
                    break
                await asyncio.sleep(0.01)
            status = await io_loop.run_in_executor(None, webhook_from, port, newcomer)
            for _ in range(500):
                evicted = [n for n, sock in enumerate(held) if closed(sock)]
                if evicted:
                    break
                await asyncio.sleep(0.01)
        finally:
            for sock in held:
                sock.close()
    return status, evicted


@pytest.mark.gen_test(timeout=60)
async def test_at_the_cap_a_bodiless_request_makes_room(capped, io_loop):
    """Four addresses hold two body-less requests each: the cap. A fifth address's
    webhook gets in, and one of them (no idle connection being there) is closed."""
    app, settings = capped
    status, evicted = await newcomer_among(
        app, settings, io_loop,
        [("127.0.0.1", 2), ("127.0.0.2", 2), ("127.0.0.3", 2), ("127.0.0.4", 2)],
        "127.0.0.5")
    assert status == 200
    assert len(evicted) == 1


@pytest.mark.gen_test(timeout=60)
async def test_the_room_is_made_at_the_address_holding_the_most(ctx, app, io_loop):
    """12 connections, 3 per address: two addresses hold 3 body-less requests each,
    three hold 2. A newcomer's room is taken from one of the two."""
    settings = dataclasses.replace(ctx.settings, max_connections=12)
    status, evicted = await newcomer_among(
        app, settings, io_loop,
        [("127.0.0.1", 3), ("127.0.0.2", 3), ("127.0.0.3", 2), ("127.0.0.4", 2),
         ("127.0.0.5", 2)],
        "127.0.0.6")
    assert status == 200
    assert len(evicted) == 1 and evicted[0] < 6


@pytest.mark.gen_test(timeout=60)
async def test_a_body_that_never_starts_is_cut_off_before_the_body_deadline(
        app, ctx, io_loop, caplog):
    caplog.set_level(logging.INFO, "receiver")
    app.body_start_timeout = 0.3
    with served(app, ctx.settings) as url:
        port = port_of(url)
        [silent] = await io_loop.run_in_executor(None, bodiless, port, 1)
        [started] = await io_loop.run_in_executor(None, bodiless, port, 1)
        started.sendall(b"{")
        silent.settimeout(10)
        closed = await io_loop.run_in_executor(None, silent.recv, 100)
        # The one whose body started is still waited for (until the 30 s deadline).
        started.setblocking(False)
        with pytest.raises(BlockingIOError):
            started.recv(100)
        silent.close()
        started.close()
    assert closed == b""
    assert "not started after 0.3 s; connection closed" in caplog.text


# --- 6. the senders are never refused for a stranger's bytes -----------------------------------

@pytest.mark.gen_test(timeout=60)
async def test_calls_with_valid_header_credentials_pass_a_strangers_bytes(app, ctx, client,
                                                                         io_loop):
    """A stranger at the senders' address holds its whole share in unsigned card bodies;
    the workflow webhook and the crypto callback with their keys still get in (the old
    code: 429 for both)."""
    ctx.bodies = BodyBudget(total_bytes=10**9, per_client_bytes=64 * 1024)
    with served(app, ctx.settings) as url:
        port = port_of(url)
        stranger = socket.create_connection(("127.0.0.1", port), timeout=10)
        stranger.sendall(head("POST", se.CARD_URL, 200_000, b"Stripe-Signature: t=1,v1=00\r\n")
                         + b"x" * (64 * 1024))
        try:
            for _ in range(1000):
                if ctx.bodies.held >= 64 * 1024:
                    break
                await asyncio.sleep(0.01)
            workflow = await client.fetch(url + "/api/v1/webhooks/crtc/domain-ready",
                                          method="POST", body=BODY,
                                          headers={"X-Webhook-Secret": WEBHOOK_SECRET})
            crypto = await client.fetch(url + shkeeper.URL, method="POST",
                                        body=shkeeper.encode(shkeeper.unconfirmed("CA-1")),
                                        headers=shkeeper.key_headers(shkeeper.API_KEY))
            unsigned = await client.fetch(url + se.CARD_URL, method="POST", body=b"{}",
                                          headers={"Stripe-Signature": "t=1,v1=00"})
        finally:
            stranger.close()
    assert (workflow.code, crypto.code) == (200, 202)
    assert unsigned.code == 429  # the stranger's own kind is still held to the share


# --- 3. who a request comes from -----------------------------------------------------------

def test_trusted_proxies_are_read_from_the_environment():
    settings = Settings.from_env({"TRUSTED_PROXIES": "127.0.0.1, 10.0.0.0/8,::1"})
    assert [str(n) for n in settings.trusted_proxies] == ["127.0.0.1/32", "10.0.0.0/8",
                                                          "::1/128"]
    assert Settings.from_env({}).trusted_proxies == ()
    with pytest.raises(ConfigurationError, match="TRUSTED_PROXIES"):
        Settings.from_env({"TRUSTED_PROXIES": "localhost"})


def test_a_forwarded_address_is_believed_from_a_trusted_proxy_only():
    proxies = (ipaddress.ip_network("127.0.0.1/32"), ipaddress.ip_network("10.0.0.0/8"))
    chain = {"X-Forwarded-For": "198.51.100.9, 203.0.113.5, 10.1.2.3"}
    assert forwarded_for("127.0.0.1", chain, proxies) == "203.0.113.5"
    assert forwarded_for("127.0.0.1", {"X-Real-IP": "192.0.2.1", **chain}, proxies) \
        == "192.0.2.1"
    assert forwarded_for("192.0.2.200", {"X-Real-IP": "192.0.2.1"}, proxies) == "192.0.2.200"
    assert forwarded_for("127.0.0.1", {"X-Real-IP": "192.0.2.1"}, ()) == "127.0.0.1"
    assert forwarded_for("127.0.0.1", {"X-Real-IP": "not an address"}, proxies) == "127.0.0.1"


def test_an_ipv6_client_is_counted_by_its_64():
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::7") \
        == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:192.0.2.1") == "192.0.2.1"
    assert client_key("192.0.2.1") == "192.0.2.1"


# --- 9. /readyz and a full spool ---------------------------------------------------------------

@pytest.mark.gen_test(timeout=60)
async def test_readyz_says_the_spool_is_full_when_its_disk_is(ctx, client, small_filesystem):
    """The old code looked at the directory's mode only: "ok" while every spooled call
    failed with ENOSPC."""
    settings = dataclasses.replace(ctx.settings, spool_dir=str(small_filesystem / "spool"))
    prepare_spool(settings.spool_dir)
    app = make_app(dataclasses.replace(ctx, settings=settings))
    with served(app, settings) as base:
        before = json.loads((await client.fetch(base + "/readyz")).body)["checks"]["spool"]
        with open(small_filesystem / "filler", "wb") as filler:
            with pytest.raises(OSError):
                for _ in range(8):
                    filler.write(b"x" * 1024 * 1024)
                    filler.flush()
        full = await client.fetch(base + "/readyz")
    assert before == "ok"
    assert full.code == 503 and json.loads(full.body)["checks"]["spool"] == "full"
