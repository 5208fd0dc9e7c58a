"""Every console page answers: an operator logs in, opens every page the navigation links
to, and every page linked from those (event and order details, filters, later pages),
and none is a 5xx or logs an error. Run on SQLite and, with TEST_DATABASE_URL, on
PostgreSQL."""
import dataclasses
import html
import logging
import re
import urllib.parse

import pytest

from models import CrtcOrder, Outbox
from tests.console_helpers import (  # noqa: F401 (fixture)
    console_settings, logged_in, operator, text,
)
from tests.shkeeper import API_KEY, URL as CRYPTO_URL, encode, key_headers, paid
from tests.test_cli import at, stored_event

SUBMITTED = {"order_name": "ORD-1", "order_number": "FO-1", "state_code": "WY",
             "entity_name": "Acme LLC"}
LINK = re.compile(r'href="(/console/[^"]*)"')
# Pages reached from the navigation, then from those, and so on this many times.
DEPTH = 3


@pytest.fixture
def settings(settings):
    return dataclasses.replace(console_settings(settings), crypto_processor_api_key=API_KEY)


def console_links(page):
    """The console pages a page links to, without the fragment; the stylesheet aside."""
    found = set()
    for href in LINK.findall(page):
        path = urllib.parse.urldefrag(html.unescape(href))[0]
        if path != "/console/console.css":
            found.add(path)
    return found


async def something_of_every_kind(post, worker, clock):
    """An order with a paid event, one failed (no order yet), a dead and a sent effect, a
    CRTC order awaiting its funds and one in its holdback."""
    clock.set(2026, 11, 23, 12, 0)
    CrtcOrder.create(order_number="CA-1", customer_name="Rae Radio Ltd", total_cents=78000,
                     payment_status="paid", payment_method="ach",
                     paid_at=at(2026, 11, 19, 15, 0), delivered_at=at(2026, 11, 20),
                     holdback_ends_at=at(2026, 12, 20))
    await post(CRYPTO_URL, encode(paid("CA-1")), key_headers())
    await post(CRYPTO_URL, encode(paid("CA-404")), key_headers())
    worker.fail_with(400)
    await post("/api/v1/webhooks/formation/submitted", SUBMITTED,
               {"X-Webhook-Secret": "test-webhook-secret"})
    worker.status, worker.body = 200, {"ok": True}
    await post("/api/v1/webhooks/formation/submitted", {**SUBMITTED, "order_number": "FO-2"},
               {"X-Webhook-Secret": "test-webhook-secret"})
    stored_event(order_number="FO-3", status="rejected", last_error="no such order")
    assert Outbox.select().where(Outbox.status == "dead").count() >= 1


@pytest.mark.gen_test(timeout=120)
async def test_every_page_reachable_from_the_navigation_answers_without_an_error(
        logged_in, post, worker, clock, caplog):
    await something_of_every_kind(post, worker, clock)
    caplog.clear()
    caplog.set_level(logging.ERROR)
    seen, broken = {}, []
    frontier = console_links(text(await logged_in.get("/console/")))
    assert {"/console/links", "/console/events", "/console/outbox"} <= frontier
    for _ in range(DEPTH):
        found = set()
        for path in sorted(frontier - set(seen)):
            response = await logged_in.get(path)
            seen[path] = response.code
            if response.code >= 500:
                broken.append((path, response.code))
            elif response.code == 200:
                found |= console_links(text(response))
        frontier = found
    assert not broken, broken
    assert not [record.getMessage() for record in caplog.records
                if record.levelno >= logging.ERROR]
    # Detail pages were reached, not only the lists.
    assert any(re.fullmatch(r"/console/events/\d+", path) for path in seen)
    assert any(path.startswith("/console/orders/") for path in seen)
