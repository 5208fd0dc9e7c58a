"""The operator console: every page and action over HTTP as a browser sends them, the
login and session, and the refusals (no session, no xsrf token, too many attempts)."""
import dataclasses
import datetime
import decimal
import ipaddress
import json
import logging
import re
import subprocess
import sys
import time

import pytest

import handlers.console
from app.server import make_app
from domain.links import token_valid
from models import (
    ComplianceOrder, ConsoleAction, CrtcOrder, Outbox, SelfFiling, TreasuryJob,
    WebhookEvent,
)
from ops import console
from ops.operator import format_time
from ops.passwords import verify_password
from settings import ConfigurationError, Settings
from tests.door import through_the_door
from tests.console_helpers import (  # noqa: F401 (fixtures)
    COOKIE_SECRET, PASSWORD, PASSWORD_HASH, Operator, console_settings, logged_in, notice,
    operator, refused, text,
)
from tests.ops_helpers import ROOT
from tests.public_helpers import served
from tests.service_process import database_down
from tests.shkeeper import API_KEY, URL as CRYPTO_URL, encode, key_headers, paid
from tests.test_cli import at, outbox_row, stored_event

SUBMITTED = {"order_name": "ORD-1", "order_number": "FO-1", "state_code": "WY",
             "entity_name": "Acme LLC"}


@pytest.fixture
def settings(settings):
    return dataclasses.replace(console_settings(settings), crypto_processor_api_key=API_KEY)


def actions():
    return [(a.operator, a.action, a.target, a.outcome)
            for a in ConsoleAction.select().order_by(ConsoleAction.id)]


# --- off unless configured ----------------------------------------------------------------

@pytest.mark.gen_test(timeout=60)
async def test_without_a_password_hash_there_is_no_console(ctx, client):
    app = make_app(dataclasses.replace(ctx, settings=dataclasses.replace(
        ctx.settings, console_password_hash="")))
    with served(app, ctx.settings) as base:
        for path in ("/console/", "/console/login", "/console/events"):
            response = await client.fetch(base + path, follow_redirects=False)
            assert response.code == 404 and json.loads(response.body) == {"error": "not found"}


# --- login, session, logout ---------------------------------------------------------------

@pytest.mark.gen_test(timeout=60)
async def test_a_page_without_a_session_sends_to_the_login_page(operator):
    response = await operator.get("/console/events?status=failed")
    assert response.code == 302
    assert response.headers["Location"] == (
        "/console/login?next=%2Fconsole%2Fevents%3Fstatus%3Dfailed")


@pytest.mark.gen_test(timeout=60)
async def test_logging_in_sets_a_strict_http_only_expiring_session_and_returns_to_the_page(
        operator, clock):
    clock.set(2026, 11, 23, 10, 0)
    response = await operator.post("/console/login?next=%2Fconsole%2Fevents",
                                   {"name": "Dana", "password": PASSWORD})
    assert response.code == 302 and response.headers["Location"] == "/console/events"
    [session] = [h for h in operator.set_cookie_headers if h.startswith("console_session=")]
    assert "HttpOnly" in session and "SameSite=Strict" in session and "Path=/console" in session
    assert "expires=Mon, 23 Nov 2026 22:00:00 GMT" in session
    assert "Secure" not in session  # plain HTTP here; over HTTPS see the next test
    xsrf = next(h for h in operator.set_cookie_headers if h.startswith("_xsrf="))
    assert "SameSite=Strict" in xsrf and "Path=/console" in xsrf and "HttpOnly" in xsrf
    assert (await operator.get("/console/events")).code == 200
    assert actions() == [("Dana", "login", "", "ok")]


@pytest.mark.gen_test(timeout=60)
async def test_over_https_the_cookies_are_secure(ctx, client):
    """HTTPS as the trusted proxy (TRUSTED_PROXIES) reports it."""
    settings = dataclasses.replace(ctx.settings,
                                   trusted_proxies=(ipaddress.ip_network("127.0.0.1/32"),))
    app = make_app(dataclasses.replace(ctx, settings=settings))
    with served(app, settings) as base:
        operator = Operator(client, base)
        response = await operator.post("/console/login", {"name": "Dana", "password": PASSWORD},
                                       **{"X-Forwarded-Proto": "https"})
    assert response.code == 302
    assert all("Secure" in header for header in operator.set_cookie_headers
               if "console_session=" in header)
    assert any("console_session=" in header for header in operator.set_cookie_headers)


@pytest.mark.gen_test(timeout=60)
async def test_a_wrong_password_is_refused_and_counted(operator, ctx):
    response = await operator.log_in(password="correct horse battery stapler")
    assert response.code == 403 and "Wrong password." in text(response)
    assert "console_session" not in operator.cookies
    assert actions() == []  # counted (tests/test_hostile_console.py), not recorded
    assert (await operator.get("/console/")).code == 302


@pytest.mark.gen_test(timeout=60)
async def test_a_slow_password_check_is_not_the_databases_time(operator, ctx, monkeypatch):
    """scrypt on a loaded machine may take longer than the call's database budget; the
    login goes on, the database is not taken for slow."""
    ctx.settings = dataclasses.replace(ctx.settings, database_call_budget_seconds=0.3)

    def slow_check(password, stored):
        time.sleep(0.6)  # a check slower than the budget, in real time: the behaviour
        return verify_password(password, stored)

    monkeypatch.setattr(handlers.console, "verify_password", slow_check)
    response = await operator.log_in()
    assert response.code == 302, text(response)
    assert (await operator.get("/console/")).code == 200


@pytest.mark.gen_test(timeout=60)
async def test_a_login_needs_a_name_for_the_record(operator):
    response = await operator.post("/console/login", {"name": " ", "password": PASSWORD})
    assert response.code == 400 and "Give your name" in text(response)


@pytest.mark.gen_test(timeout=60)
async def test_wrong_passwords_are_rate_limited_per_address(operator):
    for _ in range(5):
        assert (await operator.log_in(password="wrong wrong wrong")).code == 403
    refused = await operator.log_in(password="wrong wrong wrong")
    assert refused.code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert "console_session" not in operator.cookies


@pytest.mark.gen_test(timeout=60)
async def test_the_session_ends_after_twelve_hours(logged_in, clock):
    clock.set(2026, 11, 23, 10, 0)
    await logged_in.log_in()
    clock.set(2026, 11, 23, 21, 59)
    assert (await logged_in.get("/console/")).code == 200
    clock.set(2026, 11, 23, 22, 1)
    assert (await logged_in.get("/console/")).code == 302


@pytest.mark.gen_test(timeout=60)
async def test_a_forged_or_foreign_session_cookie_is_no_session(operator, logged_in):
    signed = logged_in.cookies["console_session"]
    forged = Operator(operator.client, operator.base_url)
    forged.cookies["console_session"] = signed.replace("Dana", "Eve") if "Dana" in signed \
        else signed[:-2] + "00"
    assert (await forged.get("/console/")).code == 302
    other = Settings(console_password_hash=PASSWORD_HASH, cookie_secret="x" * 40)
    assert other.cookie_secret != COOKIE_SECRET


@pytest.mark.gen_test(timeout=60)
async def test_logout_ends_the_session_and_is_recorded(logged_in):
    response = await logged_in.post("/console/logout")
    assert response.code == 302 and response.headers["Location"] == "/console/login"
    assert "console_session" not in logged_in.cookies
    assert (await logged_in.get("/console/")).code == 302
    assert actions()[-1] == ("Dana", "logout", "", "ok")


@pytest.mark.gen_test(timeout=60)
async def test_the_login_page_goes_back_only_to_a_console_page(operator):
    for wanted in ("https://evil.example/", "//evil.example/", "/api/v1/survey",
                   "/console/login"):
        response = await operator.post(
            "/console/login?next=" + wanted, {"name": "Dana", "password": PASSWORD})
        assert response.headers["Location"] == "/console/", wanted


# --- refusals: no token, no session ---------------------------------------------------------

ACTIONS = [("/console/events/1/replay", {}), ("/console/outbox/1/retry", {}),
           ("/console/outbox/1/give-up", {}),
           ("/console/outbox/retry-dead", {"destination": "worker"}),
           ("/console/outbox/due-now", {"destination": "worker"}),
           ("/console/links", {"kind": "ifta", "order": "CO-1", "cycle": "2026-Q3"}),
           ("/console/logout", {})]


@pytest.mark.parametrize("path,form", ACTIONS + [("/console/login", {"name": "Dana",
                                                                      "password": PASSWORD})])
@pytest.mark.gen_test(timeout=60)
async def test_every_post_without_the_xsrf_token_is_refused(logged_in, path, form):
    outbox_row(status="dead")
    response = await logged_in.post(path, form, xsrf=False)
    assert response.code == 403 and "did not come from this console" in text(response)
    assert Outbox.get().status == "dead"


@pytest.mark.parametrize("path,form", ACTIONS)
@pytest.mark.gen_test(timeout=60)
async def test_every_action_without_a_session_is_refused(operator, path, form):
    row = outbox_row(status="dead")
    response = await operator.post(path.replace("/1/", f"/{row.id}/"), form)
    assert response.code == 403
    assert Outbox.get().status == "dead" and actions() == []


@pytest.mark.gen_test(timeout=60)
async def test_pages_forbid_scripts_and_framing(logged_in):
    for path in ("/console/", "/console/login", "/console/events"):
        response = await logged_in.get(path)
        policy = response.headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in policy and "default-src 'none'" in policy
        assert "script-src" not in policy and "<script" not in text(response)
        assert response.headers["X-Frame-Options"] == "DENY"
        assert response.headers["Cache-Control"] == "no-store"


@pytest.mark.gen_test(timeout=60)
async def test_the_webhooks_still_need_no_xsrf_token(post, worker, frappe):
    status, body, _ = await post("/api/v1/webhooks/formation/submitted", SUBMITTED,
                                 {"X-Webhook-Secret": "test-webhook-secret"})
    assert status == 200 and body["received"] is True


# --- overview -------------------------------------------------------------------------------

@pytest.mark.gen_test(timeout=60)
async def test_the_overview_counts_what_needs_attention(logged_in, clock, tmp_path, ctx):
    clock.set(2026, 11, 23, 12, 0)
    stored_event(received=at(2026, 11, 23, 11, 0), status="failed", last_error="boom")
    stored_event(received=at(2026, 11, 23, 9, 0), source="card", event_type="x",
                 order_number=None)
    stored_event(received=at(2026, 11, 20, 9, 0), status="dead")
    stored_event(received=at(2026, 11, 10, 9, 0))  # older than the chart
    outbox_row(status="dead", key="d1")
    waiting = outbox_row(status="pending", key="p1")
    Outbox.update(created_at=at(2026, 11, 23, 11, 30)).where(Outbox.id == waiting.id).execute()
    CrtcOrder.create(order_number="CA-1", payment_status="paid", payment_method="card",
                     paid_at=at(2026, 11, 20, 9, 0))
    CrtcOrder.create(order_number="CA-2", delivered_at=at(2026, 11, 1),
                     holdback_ends_at=at(2026, 12, 1))

    overview = through_the_door(console.overview, ctx, console.EventCounts())
    assert overview.events_by_day["workflow"] == [0, 0, 0, 1, 0, 0, 1]
    assert overview.last_day == {"card": 1, "crypto": 0, "workflow": 1}
    assert overview.event_failures == {"dead": 1, "failed": 1}
    assert overview.dead_effects == {"worker": 1}
    assert [(b.destination, b.status, b.count) for b in overview.backlog] == [
        ("worker", "pending", 1)]
    assert (overview.settlement_queue, overview.in_holdback) == (1, 1)

    page = text(await logged_in.get("/console/"))
    assert "<svg" in page and "workflow: 1" in page
    assert "30 min" in page  # the oldest pending effect's age
    assert '<meta http-equiv="refresh" content="60">' in page


@pytest.mark.gen_test(timeout=60)
async def test_the_overview_groups_the_failures_by_cause_most_first(logged_in, ctx):
    """Sidekiq's, Svix's and Hookdeck's failure views lead with the causes and their
    counts; the overview had only the totals."""
    for n in range(3):
        stored_event(status="failed", order_number=f"CO-{n}",
                     last_error=f"OrderNotFound: no compliance order CO-{n}")
    stored_event(status="dead", last_error="KeyError: 'order_number'")
    given_up = stored_event(status="dead", last_error="KeyError: 'x'")
    WebhookEvent.update(given_up_at=at(2026, 11, 23, 9, 0)).where(
        WebhookEvent.id == given_up.id).execute()
    stored_event(status="processed")
    outbox_row(status="dead", key="d1")
    outbox_row(status="dead", key="d2")
    causes = through_the_door(console.failures_by_cause)
    assert [(c.what, c.where, c.cause, c.count) for c in causes] == [
        ("events", "workflow", "OrderNotFound", 3),
        ("effects", "worker", "HTTP 400", 2),
        ("events", "workflow", "KeyError", 1)]
    page = text(await logged_in.get("/console/"))
    assert ('<a href="/console/events?source=workflow">events of workflow</a></td>\n'
            '      <td class="error"><span class="cell-label">Cause: </span>OrderNotFound</td>'
            ) in page


def test_the_chart_counts_its_older_windows_once_an_hour(ctx, clock):
    counts = console.EventCounts()
    clock.set(2026, 11, 23, 12, 10)
    stored_event(received=at(2026, 11, 21, 9, 0))
    assert through_the_door(counts.by_day, ctx, clock())["workflow"] == [0, 0, 0, 0, 1, 0, 0]
    stored_event(received=at(2026, 11, 21, 10, 0))  # stored late, with an old time
    stored_event(received=at(2026, 11, 23, 12, 5))  # the last window is counted each time
    clock.set(2026, 11, 23, 12, 59)
    assert through_the_door(counts.by_day, ctx, clock())["workflow"] == [0, 0, 0, 0, 1, 0, 1]
    clock.set(2026, 11, 23, 13, 0)
    assert through_the_door(counts.by_day, ctx, clock())["workflow"] == [0, 0, 0, 0, 2, 0, 1]


# --- events ---------------------------------------------------------------------------------

@pytest.mark.gen_test(timeout=60)
async def test_the_event_list_filters_and_pages_by_keyset(logged_in):
    base = at(2026, 11, 23, 8, 0)
    for n in range(120):
        # Pairs share a received_at: the cursor's id must break the tie.
        stored_event(received=base + datetime.timedelta(seconds=n // 2),
                     status="failed" if n % 3 == 0 else "processed",
                     order_number=f"FO-{n}", external_id=f"ext-{n}")
    seen, path = [], "/console/events?status=failed"
    while path:
        page = text(await logged_in.get(path))
        seen += [int(n) for n in re.findall(r'href="/console/events/(\d+)"', page)]
        found = re.search(r'href="([^"]+)" rel="next"', page)
        path = found and found.group(1).replace("&amp;", "&")
    failed = [e.id for e in WebhookEvent.select().where(WebhookEvent.status == "failed")
              .order_by(WebhookEvent.received_at.desc(), WebhookEvent.id.desc())]
    assert seen == failed and len(seen) == 40

    found = text(await logged_in.get("/console/events?q=ext-7"))
    assert re.findall(r'href="/console/events/(\d+)"', found) == [
        str(WebhookEvent.get(WebhookEvent.external_id == "ext-7").id)]
    found = text(await logged_in.get("/console/events?q=FO-8&source=workflow"))
    assert len(re.findall(r'href="/console/events/(\d+)"', found)) == 1
    window = text(await logged_in.get(
        "/console/events?since=2026-11-23T08:00:10&until=2026-11-23T08:00:12"))
    assert len(re.findall(r'href="/console/events/(\d+)"', window)) == 4


@pytest.mark.parametrize("query", ["since=yesterday", "after=nonsense", "until=2026-13-01"])
@pytest.mark.gen_test(timeout=60)
async def test_a_bad_filter_or_cursor_is_a_400_page(logged_in, query):
    response = await logged_in.get("/console/events?" + query)
    assert response.code == 400 and "not understood" in text(response)


@pytest.mark.gen_test(timeout=60)
async def test_the_event_page_shows_the_payload_without_secrets_and_its_effects(logged_in):
    event = stored_event(payload={"order_number": "FO-1", "api_key": "k-123",
                                  "nested": {"Stripe-Signature": "t=1,v1=abc"}},
                         status="failed", last_error="KeyError: state_code")
    outbox_row(status="dead", event=event)
    page = text(await logged_in.get(f"/console/events/{event.id}"))
    assert "k-123" not in page and "v1=abc" not in page and "[hidden]" in page
    assert "&#34;order_number&#34;: &#34;FO-1&#34;" in page
    assert "KeyError: state_code" in page and "HTTP 400: bad job" in page
    assert 'name="confirm"' not in page  # a failed event replays without confirmation
    assert (await logged_in.get("/console/events/999999")).code == 404


@pytest.mark.gen_test(timeout=60)
async def test_replaying_a_failed_event_handles_it_and_records_who(logged_in, ctx):
    status, *_ = await logged_in.client.fetch(
        logged_in.base_url + CRYPTO_URL, method="POST", body=encode(paid("CA-7")),
        headers=key_headers()), None
    event = WebhookEvent.get()
    assert event.status == "failed"  # the order was not there yet
    CrtcOrder.create(order_number="CA-7", total_cents=780)

    response, page = await logged_in.act(f"/console/events/{event.id}/replay")
    assert response.headers["Location"] == f"/console/events/{event.id}"
    assert notice(page).startswith(f"Event #{event.id} replayed: it is now processed.")
    assert WebhookEvent.get_by_id(event.id).status == "processed"
    assert CrtcOrder.get().payment_status == "paid"
    assert actions()[-1] == ("Dana", "replay event", str(event.id), "processed")


@pytest.mark.gen_test(timeout=60)
async def test_a_processed_event_replays_only_with_the_confirmation(logged_in, worker, frappe):
    event = stored_event(status="failed")
    await logged_in.post(f"/console/events/{event.id}/replay")
    assert len(worker.requests) == 1

    _, again = await logged_in.act(f"/console/events/{event.id}/replay")
    assert refused(again) and "Tick the confirmation" in notice(again)
    _, confirmed = await logged_in.act(f"/console/events/{event.id}/replay", {"confirm": "yes"})
    assert not refused(confirmed) and "it is now processed" in notice(confirmed)
    assert len(worker.requests) == 1 and Outbox.select().count() == 2  # nothing sent twice
    assert [a[3] for a in actions()[1:]] == ["processed", "refused: not confirmed",
                                             "processed"]


# --- outbox ---------------------------------------------------------------------------------

@pytest.mark.gen_test(timeout=60)
async def test_retrying_a_dead_effect_sends_it_now_to_a_peer_that_answers(logged_in, worker):
    row = outbox_row(status="dead")
    _, page = await logged_in.act(f"/console/outbox/{row.id}/retry",
                                  {"back": "/console/outbox?status=dead"})
    assert notice(page).startswith(f"Effect #{row.id} (worker job deliver) sent at ")
    assert Outbox.get_by_id(row.id).status == "sent"
    assert [r.json["action"] for r in worker.requests] == ["deliver"]
    assert actions()[-1] == ("Dana", "retry effect", str(row.id), "sent")


@pytest.mark.gen_test(timeout=60)
async def test_a_retry_that_fails_again_says_why(logged_in, worker):
    worker.fail_with(503)
    row = outbox_row(status="dead")
    _, page = await logged_in.act(f"/console/outbox/{row.id}/retry")
    assert notice(page).startswith(f"Effect #{row.id} (worker job deliver) tried now: HTTP 503")
    next_try = format_time(Outbox.get_by_id(row.id).next_attempt_at)
    assert f"It stays in line and is tried again by itself, next at {next_try} UTC." \
        in notice(page)
    assert Outbox.get_by_id(row.id).attempts == 1


@pytest.mark.gen_test(timeout=60)
async def test_a_sent_effect_is_not_retried(logged_in, worker):
    row = outbox_row(status="sent")
    _, page = await logged_in.act(f"/console/outbox/{row.id}/retry")
    assert refused(page) and "was sent at" in notice(page)
    assert worker.requests == [] and actions()[-1][3].startswith(f"refused: outbox row #{row.id} was sent at")
    assert (await logged_in.post("/console/outbox/999999/retry")).code == 404


@pytest.mark.gen_test(timeout=60)
async def test_retry_all_dead_of_one_destination(logged_in, clock):
    clock.set(2026, 11, 23, 12, 0)
    outbox_row(status="dead", key="a")
    outbox_row(status="dead", key="b")
    other = outbox_row(status="dead", key="c")
    Outbox.update(kind="email").where(Outbox.id == other.id).execute()
    _, page = await logged_in.act("/console/outbox/retry-dead", {"destination": "worker"})
    assert notice(page).startswith("2 worker effect(s) given up on are back in line, due now")
    assert sorted((r.kind, r.status) for r in Outbox.select()) == [
        ("email", "dead"), ("job", "pending"), ("job", "pending")]
    assert all(r.next_attempt_at == clock() for r in Outbox.select().where(Outbox.kind == "job"))
    # Each effect's timeline has the retry as its own line, with who made it.
    retried = through_the_door(console.retries_of, [row.id for row in Outbox.select()])
    assert sorted((target, [(a.operator, a.action, a.created_at) for a in actions])
                  for target, actions in retried.items() if actions) == sorted(
        (row.id, [("Dana", "retry effect", clock())])
        for row in Outbox.select().where(Outbox.kind == "job"))
    assert retried[other.id] == []


@pytest.mark.gen_test(timeout=60)
async def test_making_effects_due_now_leaves_those_on_their_way_out(logged_in, clock):
    clock.set(2026, 11, 23, 12, 0)
    later = outbox_row(status="pending", key="later", attempts=4)
    leased = outbox_row(status="pending", key="leased")
    Outbox.update(next_attempt_at=at(2026, 11, 23, 18, 0)).where(Outbox.id == later.id).execute()
    Outbox.update(next_attempt_at=at(2026, 11, 23, 12, 0, 50)).where(
        Outbox.id == leased.id).execute()
    unconfigured = outbox_row(status="waiting", key="unconfigured")
    _, page = await logged_in.act("/console/outbox/due-now", {"destination": "worker"})
    assert notice(page).startswith("1 worker effect(s) that waited for a later try are due "
                                   "now: the scheduler sends them at its next run")
    assert (Outbox.get_by_id(later.id).next_attempt_at, Outbox.get_by_id(later.id).attempts) \
        == (clock(), 4)
    assert Outbox.get_by_id(leased.id).next_attempt_at == at(2026, 11, 23, 12, 0, 50)
    # Waiting for its destination's setting, not for a try: it goes once that is set.
    assert Outbox.get_by_id(unconfigured.id).status == "waiting"


@pytest.mark.gen_test(timeout=60)
async def test_make_due_now_is_offered_only_where_effects_wait_for_a_later_try(logged_in, clock):
    clock.set(2026, 11, 23, 12, 0)
    outbox_row(status="dead", key="dead")
    outbox_row(status="waiting", key="unconfigured")
    leased = outbox_row(status="pending", key="leased")
    Outbox.update(next_attempt_at=at(2026, 11, 23, 12, 0, 50)).where(
        Outbox.id == leased.id).execute()
    page = text(await logged_in.get("/console/outbox"))
    assert "Retry all dead" in page and "due now</button>" not in page
    later = outbox_row(status="pending", key="later")
    Outbox.update(next_attempt_at=at(2026, 11, 23, 18, 0)).where(Outbox.id == later.id).execute()
    page = text(await logged_in.get("/console/outbox"))
    assert page.count("due now</button>") == 1 and "Make 1 due now</button>" in page


@pytest.mark.gen_test(timeout=60)
async def test_the_outbox_page_groups_by_destination_and_status(logged_in):
    for n in range(3):
        outbox_row(status="dead", key=f"d{n}")
    outbox_row(status="sent", key="s")
    page = text(await logged_in.get("/console/outbox"))
    assert "Retry all dead" in page and page.count("HTTP 400: bad job") == 3
    sent = text(await logged_in.get("/console/outbox?status=sent&destination=worker"))
    assert sent.count("Retry now") == 0 and 'class="status good"><span class="cell-label">Status: </span>sent</td>' in sent
    assert (await logged_in.get("/console/outbox?status=lost")).code == 400
    assert (await logged_in.get("/console/outbox?destination=job")).code == 400


# --- order timeline, settlement, links, actions --------------------------------------------

@pytest.mark.gen_test(timeout=60)
async def test_the_order_timeline_puts_everything_about_an_order_in_time_order(logged_in, clock):
    clock.set(2026, 11, 23, 12, 0)
    CrtcOrder.create(order_number="CA-9", customer_name="Rae <Radio> Ltd",
                     customer_email="rae@example.test", payment_status="paid",
                     payment_method="card", paid_at=at(2026, 11, 2, 9, 0),
                     funds_available=True, funds_available_at=at(2026, 11, 5, 10, 0),
                     delivered_at=at(2026, 11, 6), holdback_ends_at=at(2026, 12, 6),
                     created_at=at(2026, 11, 1, 8, 0))
    stored_event(order_number="CA-9", event_type="crtc/delivered", status="processed",
                 received=at(2026, 11, 6, 0, 0, 1))
    row = outbox_row(status="sent", key="t1")
    Outbox.update(order_number="CA-9", sent_at=at(2026, 11, 6, 0, 0, 2),
                  created_at=at(2026, 11, 6, 0, 0, 1)).where(Outbox.id == row.id).execute()
    TreasuryJob.create(order_id="CA-9", order_type="canada_crtc", coin="BTC",
                       amount_coin=decimal.Decimal("0.0123"), amount_fiat_cents=123456,
                       amount_usd_cents=123456,
                       idempotency_key="tj-1", received_at=at(2026, 11, 2, 9, 0))
    page = text(await logged_in.get("/console/orders/CA-9"))
    facts, timeline = page.split("Timeline")
    assert "0.0123 BTC ($1234.56), received" in timeline
    assert "Rae &lt;Radio&gt; Ltd" in facts and "rae@example.test" in facts
    order_of = [what for what in ("canada_crtc order created", "paid", "funds settled",
                                  "delivered; commission holdback starts",
                                  "workflow event crtc/delivered", "worker job deliver",
                                  "holdback ends") if what in timeline]
    assert order_of == sorted(order_of, key=timeline.index) and len(order_of) == 7


@pytest.mark.gen_test(timeout=60)
async def test_finding_an_order_by_number(logged_in):
    ComplianceOrder.create(order_number="CO 1/2", customer_name="Slash Co")
    response = await logged_in.get("/console/orders?number=CO%201%2F2")
    assert response.code == 302 and response.headers["Location"] == "/console/orders/CO%201%2F2"
    missing = await logged_in.get("/console/orders/NOPE-1")
    assert missing.code == 404 and "Nothing is known" in text(missing)


@pytest.mark.gen_test(timeout=60)
async def test_customer_data_is_shown_to_a_logged_in_operator_only(operator):
    CrtcOrder.create(order_number="CA-5", customer_name="Private Person")
    response = await operator.get("/console/orders/CA-5")
    assert response.code == 302 and b"Private Person" not in response.body


@pytest.mark.gen_test(timeout=60)
async def test_the_settlement_page_shows_business_days_and_due_dates(logged_in, clock):
    clock.set(2026, 11, 23, 12, 0)  # a Monday
    CrtcOrder.create(order_number="CA-ACH", payment_status="paid", payment_method="ach",
                     paid_at=at(2026, 11, 19, 15, 0))  # Thursday: Fri, Mon elapsed
    CrtcOrder.create(order_number="CA-HB", delivered_at=at(2026, 11, 1),
                     holdback_ends_at=at(2026, 12, 1), commission_forfeited_at=at(2026, 11, 9),
                     commission_forfeit_reason="dispute du_1")
    page = text(await logged_in.get("/console/settlement"))
    assert "2 of 4" in page and "2026-11-25" in page
    assert "forfeited 2026-11-09 00:00:00: dispute du_1" in page


def test_the_due_date_counts_business_days_only():
    assert console.business_day_after(datetime.date(2026, 11, 20), 2) == datetime.date(2026, 11, 24)
    assert console.business_day_after(datetime.date(2026, 11, 23), 4) == datetime.date(2026, 11, 27)


@pytest.mark.gen_test(timeout=60)
async def test_signing_a_link_as_the_command_line_does(logged_in, ctx):
    from tests.public_helpers import compliance_order
    compliance_order("CO-20001", service_slug="ucr")
    _, page = await logged_in.act("/console/links", {"kind": "ucr", "order": "CO-20001",
                                                     "cycle": "2027"})
    assert notice(page) == "Link for UCR CO-20001 2027 signed, below: send it to the customer."
    link = re.search(r'<code id="notice-code">([^<]+)</code>', text(page)).group(1)
    token = re.search(r"token=([^&]+)", link.replace("&amp;", "&")).group(1)
    assert token_valid(ctx.settings.link_secret, "ucr", "CO-20001", "2027", token)
    assert actions()[-1] == ("Dana", "sign link", "ucr CO-20001 2027", "ok")
    refused = await logged_in.post("/console/links", {"kind": "ucr", "order": "CO|1",
                                                      "cycle": "2027"})
    assert refused.code == 400 and "without" in text(refused)
    for form, problem in (({"kind": "ifta", "order": "CO-20001", "cycle": "2026-Q3"},
                           "order CO-20001 gets no IFTA reminders"),
                          ({"kind": "ucr", "order": "CO-404", "cycle": "2027"},
                           "no compliance order CO-404"),
                          ({"kind": "ucr", "order": "CO-20001", "cycle": "2026-Q3"},
                           "the ucr period must be a registration year")):
        refused = await logged_in.post("/console/links", form)
        assert refused.code == 400 and problem in text(refused), form
    assert SelfFiling.select().count() == 0


@pytest.mark.gen_test(timeout=60)
async def test_every_action_is_on_the_actions_page_and_in_the_log(logged_in, caplog):
    caplog.set_level(logging.INFO, logger="receiver.console")
    row = outbox_row(status="sent")
    await logged_in.post(f"/console/outbox/{row.id}/retry")
    page = text(await logged_in.get("/console/actions"))
    assert "retry effect" in page and "refused: outbox row" in page and "127.0.0.1" in page
    assert any("Dana from 127.0.0.1: retry effect" in r.getMessage() for r in caplog.records)


@pytest.mark.gen_test(timeout=60)
async def test_what_customers_and_senders_wrote_stays_text(logged_in):
    event = stored_event(order_number='<img src=x onerror="alert(1)">',
                         payload={"name": "<script>alert(2)</script>"},
                         last_error="<b>bold</b>")
    for path in (f"/console/events/{event.id}", "/console/events"):
        page = text(await logged_in.get(path))
        assert "<img src=x" not in page and "<script>" not in page and "<b>bold" not in page
        assert "&lt;b&gt;bold&lt;/b&gt;" in page


# --- settings and the command line ----------------------------------------------------------

def hash_password(stdin):
    return subprocess.run([sys.executable, "receiver.py", "console", "hash-password"],
                          cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60)


def test_hash_password_reads_the_password_twice_from_a_pipe():
    made = hash_password(f"{PASSWORD}\n{PASSWORD}\n")
    assert made.returncode == 0, made.stderr
    assert verify_password(PASSWORD, made.stdout.strip())
    assert PASSWORD not in made.stdout and PASSWORD not in made.stderr
    assert made.stdout.strip() != PASSWORD_HASH  # a fresh salt every time


@pytest.mark.parametrize("stdin,problem", [
    (f"{PASSWORD}\n{PASSWORD}x\n", "the two passwords differ"),
    ("short\nshort\n", "at least 12 characters"),
])
def test_hash_password_refuses_a_mismatch_or_a_short_password(stdin, problem):
    made = hash_password(stdin)
    assert made.returncode == 2 and problem in made.stderr and made.stdout == ""


PRODUCTION = {
    "RECEIVER_ENV": "production", "WEBHOOK_SECRET": "workflow-secret-for-the-tests-0123456789", "LINK_SECRET": "link-secret-for-the-tests-0123456789abc",
    "ADMIN_EMAIL": "ops@example.com",
    "STRIPE_SECRET_KEY": "sk_live_a", "STRIPE_WEBHOOK_SECRET": "whsec_a",
    "CRYPTO_PROCESSOR_API_KEY": "k", "CONSOLE_PASSWORD_HASH": PASSWORD_HASH,
    "COOKIE_SECRET": COOKIE_SECRET,
}


def test_production_runs_the_console_with_a_real_hash_and_cookie_secret():
    assert Settings.from_env(PRODUCTION).console_enabled


@pytest.mark.parametrize("changes,named", [
    ({"CONSOLE_PASSWORD_HASH": PASSWORD_HASH.replace("scrypt$15$", "scrypt$10$", 1)},
     "weak CONSOLE_PASSWORD_HASH"),
    ({"COOKIE_SECRET": ""}, "COOKIE_SECRET"),
    ({"COOKIE_SECRET": "short"}, "COOKIE_SECRET"),
    ({"COOKIE_SECRET": "change-me-cookie-secret-0123456789abcdef"}, "COOKIE_SECRET"),
])
def test_production_refuses_a_weak_or_placeholder_console_setting(changes, named):
    with pytest.raises(ConfigurationError, match=named):
        Settings.from_env({**PRODUCTION, **changes})


@pytest.mark.parametrize("value", ["change-me", PASSWORD, "scrypt$15$8$1$short$short"])
def test_a_console_password_hash_that_is_not_one_is_refused_anywhere(value):
    with pytest.raises(ConfigurationError, match="CONSOLE_PASSWORD_HASH") as refused:
        Settings.from_env({"CONSOLE_PASSWORD_HASH": value})
    assert value not in str(refused.value)


def test_no_password_checks_against_a_malformed_hash():
    assert not verify_password(PASSWORD, "scrypt$15$8$1$x$y")
    assert not verify_password("", PASSWORD_HASH)


@pytest.mark.gen_test(timeout=60)
async def test_the_stylesheet_is_served_to_the_login_page_too(operator):
    response = await operator.get("/console/console.css")
    assert response.code == 200 and response.headers["Content-Type"].startswith("text/css")
    assert b"box-sizing" in response.body


@pytest.mark.parametrize("path", ["/console/events/1/replay", "/console/outbox/1/retry",
                                  "/console/outbox/1/give-up", "/console/outbox/retry-dead", "/console/outbox/due-now",
                                  "/console/logout"])
@pytest.mark.gen_test(timeout=60)
async def test_an_action_is_never_a_get(logged_in, path):
    stored_event(status="failed")
    outbox_row(status="dead")
    assert (await logged_in.get(path)).code == 405
    assert WebhookEvent.get().status == "failed" and Outbox.get().status == "dead"


@pytest.mark.gen_test(timeout=60)
async def test_with_the_database_down_a_page_is_a_503_with_retry_after(logged_in, db):
    with database_down(db):
        response = await logged_in.get("/console/events")
    assert response.code == 503 and response.headers["Retry-After"] == "30"
    assert "The database is not answering" in text(response)
