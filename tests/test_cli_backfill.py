"""`receiver.py backfill --since`: the stripe library, pointed by STRIPE_API_BASE at a local
Tornado server playing Stripe's Events API, feeds undelivered events through the inbox."""
import datetime
import json
import re
import urllib.parse

import pytest
import tornado.httpserver
import tornado.testing
import tornado.web

from models import UTC, FormationOrder, Outbox, WebhookEvent
from domain import card_events
from tests import stripe_events as stripe_shaped
from tests.stripe_events import SECRET_KEY
from tests.terminal import OnATerminal
from tests.test_cli import cli_env, run_async

SINCE = datetime.datetime(2026, 11, 20, tzinfo=UTC)
# Smaller than the page the CLI asks for, so that pagination is exercised.
PAGE_CAP = 2


class _Events(tornado.web.RequestHandler):
    """GET /v1/events as Stripe answers it: newest first, `created[gte]`,
    `delivery_success`, `limit`, `starting_after`, and `has_more`."""

    def initialize(self, stripe):
        self.stripe = stripe

    def get(self):
        self.stripe.requests.append(self.request)
        self.set_header("Content-Type", "application/json")
        if self.request.headers.get("Authorization") != f"Bearer {self.stripe.api_key}":
            self.set_status(401)
            self.finish({"error": {"type": "invalid_request_error",
                                   "message": "Invalid API Key provided: sk_test_****"}})
            return
        query = urllib.parse.parse_qs(self.request.query)
        since = int(query["created[gte]"][0])
        listed = [e for e in self.stripe.events
                  if e["created"] >= since and query["delivery_success"] == ["false"]]
        listed.sort(key=lambda e: e["created"], reverse=True)
        if "starting_after" in query:
            ids = [e["id"] for e in listed]
            listed = listed[ids.index(query["starting_after"][0]) + 1:]
        page = listed[:min(int(query["limit"][0]), PAGE_CAP)]
        self.finish({"object": "list", "url": "/v1/events", "data": page,
                     "has_more": len(listed) > len(page)})


class FakeStripe:
    def __init__(self, api_key):
        self.api_key = api_key
        self.events = []
        self.requests = []
        sock, self.port = tornado.testing.bind_unused_port()
        self.server = tornado.httpserver.HTTPServer(
            tornado.web.Application([(r"/v1/events", _Events, {"stripe": self})]))
        self.server.add_sockets([sock])

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def stripe_api(io_loop):
    server = FakeStripe(SECRET_KEY)
    yield server
    server.server.stop()


@pytest.fixture
def env(database_url, settings, stripe_api):
    return {**cli_env(database_url, settings), "STRIPE_SECRET_KEY": SECRET_KEY,
            "STRIPE_API_BASE": stripe_api.url}


def created(hours_after_since):
    return int((SINCE + datetime.timedelta(hours=hours_after_since)).timestamp())


def undelivered(stripe_api):
    """Five events Stripe could not deliver since SINCE, and one from before it."""
    FormationOrder.create(order_number="FO-1")
    FormationOrder.create(order_number="FO-2")
    FormationOrder.create(order_number="FO-3")
    stripe_api.events = [
        stripe_shaped.event("checkout.session.completed",
                            stripe_shaped.checkout_session("FO-1", "formation"),
                            created=created(1)),
        stripe_shaped.event("checkout.session.completed",
                            stripe_shaped.checkout_session("FO-2", "formation"),
                            created=created(2)),
        stripe_shaped.event("payment_intent.payment_failed", stripe_shaped.payment_intent(
            "FO-3", "formation", status="requires_payment_method",
            last_payment_error=stripe_shaped.card_declined()), created=created(3)),
        stripe_shaped.event("customer.created", {"id": "cus_1", "object": "customer"},
                            created=created(4)),
        stripe_shaped.event("balance.available", stripe_shaped.balance(),
                            created=created(5)),
        stripe_shaped.event("checkout.session.completed",
                            stripe_shaped.checkout_session("FO-2", "formation"),
                            created=created(-1)),
    ]


def effects():
    return sorted(Outbox.select(Outbox.idempotency_key, Outbox.status).tuples())


@pytest.mark.gen_test(timeout=90)
async def test_backfill_stores_each_event_once_and_a_second_run_changes_nothing(
        env, stripe_api, telegram, smtp):
    undelivered(stripe_api)

    first = await run_async(env, "backfill", "--since", "2026-11-20T00:00:00Z")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == (
        "listed 5 undelivered event(s) since 2026-11-20 00:00:00 UTC: 5 stored and handled,"
        " 0 already in the inbox, 0 unreadable")
    assert len(stripe_api.requests) == 3  # pages of 2, 2 and 1
    stored = list(WebhookEvent.select().order_by(WebhookEvent.id))
    assert [e.external_id for e in stored] == [e["id"] for e in stripe_api.events[:5]]
    assert {e.status for e in stored} == {"processed", "ignored"}
    assert [FormationOrder.get(FormationOrder.order_number == n).payment_status
            for n in ("FO-1", "FO-2", "FO-3")] == ["paid", "paid", "failed"]
    assert len(telegram.requests) == 2 and len(smtp.messages) == 1
    before = effects()

    second = await run_async(env, "backfill", "--since", "2026-11-20T00:00:00Z")
    assert second.returncode == 0, second.stderr
    assert "0 stored and handled, 5 already in the inbox" in second.stdout
    assert WebhookEvent.select().count() == 5 and effects() == before
    assert len(telegram.requests) == 2 and len(smtp.messages) == 1
    assert "event/s" not in first.stderr + second.stderr  # not a terminal: no progress


@pytest.mark.gen_test(timeout=90)
async def test_backfill_shows_its_progress_on_a_terminal(env, stripe_api, telegram, smtp):
    undelivered(stripe_api)
    async with OnATerminal("backfill", "--since", "2026-11-20T00:00:00Z", env=env) as terminal:
        await terminal.finish()
    assert terminal.returncode == 0, terminal.shown
    assert re.search(r"listing from Stripe: 5event", terminal.shown), terminal.shown
    assert re.search(r"handling: +100%\|.*\| 5/5 \[", terminal.shown), terminal.shown
    assert terminal.stdout.startswith("listed 5 undelivered event(s)")


@pytest.mark.gen_test(timeout=90)
async def test_backfill_asks_stripe_for_undelivered_events_since_the_time_given(
        env, stripe_api):
    result = await run_async(env, "backfill", "--since", "2026-11-20T01:00:00+01:00")
    assert result.returncode == 0 and "listed 0 undelivered event(s)" in result.stdout
    request = stripe_api.requests[0]
    query = urllib.parse.parse_qs(request.query)
    assert query["delivery_success"] == ["false"]
    assert query["created[gte]"] == [str(int(SINCE.timestamp()))]
    assert request.headers["Stripe-Version"] == stripe_shaped.API_VERSION


@pytest.mark.gen_test(timeout=90)
async def test_an_event_the_webhook_already_stored_is_not_stored_again(env, ctx, stripe_api):
    undelivered(stripe_api)
    delivered = stripe_api.events[0]
    WebhookEvent.create(source="card", event_type=delivered["type"],
                        dedup_key=card_events.fact_key(ctx, delivered),
                        external_id=delivered["id"], payload=json.dumps(delivered),
                        status="processed")
    result = await run_async(env, "backfill", "--since", "2026-11-20")
    assert "4 stored and handled, 1 already in the inbox" in result.stdout
    assert WebhookEvent.select().where(WebhookEvent.external_id == delivered["id"]).count() == 1


@pytest.mark.gen_test(timeout=90)
async def test_a_refused_key_exits_1_without_showing_it(env, stripe_api):
    result = await run_async({**env, "STRIPE_SECRET_KEY": "sk_test_wrong_key_abc"},
                             "backfill", "--since", "2026-11-20")
    assert result.returncode == 1
    assert "Stripe refused or could not be reached" in result.stderr
    assert "sk_test_wrong_key_abc" not in result.stderr + result.stdout
    assert WebhookEvent.select().count() == 0


@pytest.mark.gen_test(timeout=90)
async def test_without_a_secret_key_backfill_says_so_and_exits_2_as_settings_errors_do(env):
    result = await run_async({**env, "STRIPE_SECRET_KEY": ""}, "backfill", "--since",
                             "2026-11-20")
    assert result.returncode == 2
    assert result.stderr == "receiver: STRIPE_SECRET_KEY is not set\n"


@pytest.mark.gen_test(timeout=90)
async def test_stripe_unreachable_exits_1(env):
    result = await run_async({**env, "STRIPE_API_BASE": "http://127.0.0.1:1"},
                             "backfill", "--since", "2026-11-20")
    assert result.returncode == 1 and "could not be reached" in result.stderr


@pytest.mark.gen_test(timeout=90)
async def test_an_event_that_is_not_a_stripe_event_is_counted_and_exits_1(env, stripe_api):
    stripe_api.events = [{"id": "evt_broken", "object": "event", "type": "charge.updated",
                          "created": created(1), "data": {}}]
    result = await run_async(env, "backfill", "--since", "2026-11-20")
    assert result.returncode == 1
    assert "0 stored and handled, 0 already in the inbox, 1 unreadable" in result.stdout
    assert WebhookEvent.select().count() == 0
