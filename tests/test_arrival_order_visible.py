"""A held event is visible: the console's lists, event page and order timeline, the
command line's `events list` and `events show`, /metrics, and one e-mail to the
administrator once an order has waited longer than INBOX_HOLD_ALERT_MINUTES."""
import dataclasses

import pytest

from engine import inbox, outbox
from models import WebhookEvent
from ops import operator as ops_operator
from tests.console_helpers import (  # noqa: F401 (fixtures)
    console_settings, logged_in, operator, text)
from tests.test_arrival_order import report
from tests.test_cli import run
from tests.test_ops_endpoints import samples, value


@pytest.fixture
def settings(settings):
    return console_settings(settings)


@pytest.fixture
def held(io_loop, post, clock):
    """CO-1's first report fails (the order is not in); its second is held behind it.
    Returns (the failed event, the held one)."""
    clock.set(2026, 11, 20, 9, 0)

    async def two_reports():
        await report(post, "authorization_required")
        clock.advance(minutes=1)
        await report(post, "authorization_signed")
    io_loop.run_sync(two_reports)
    first, second = WebhookEvent.select().order_by(WebhookEvent.id)
    assert (first.status, second.status) == ("failed", "received")
    return first, second


def why(first):
    return f"held behind event #{first.id} (failed: OrderNotFound: no compliance order CO-1)"


@pytest.mark.gen_test
async def test_the_console_says_what_an_event_is_held_behind(held, logged_in):
    first, second = held
    listing = text(await logged_in.get("/console/events"))
    assert why(first) in listing and ">held</td>" in listing.replace("Status: </span>", "")
    page = text(await logged_in.get(f"/console/events/{second.id}"))
    assert why(first) in page
    assert "held behind" not in text(await logged_in.get(f"/console/events/{first.id}"))
    timeline = text(await logged_in.get("/console/orders/CO-1"))
    assert why(first) in timeline


def test_the_command_line_says_what_an_event_is_held_behind(held, database_url):
    first, second = held
    listing = run(database_url, "events", "list")
    assert listing.returncode == 0, listing.stderr
    [line] = [line for line in listing.stdout.splitlines()
              if line.startswith(f"{second.id} ")]
    assert " held " in line and f"held behind event #{first.id} (failed" in line
    shown = run(database_url, "events", "show", str(second.id))
    assert f"held:         {why(first)}" in shown.stdout


@pytest.mark.gen_test
async def test_held_is_a_status_to_filter_on_and_the_event_page_says_it(held, logged_in,
                                                                        database_url):
    """Lists said "held", the event's page "received", and neither the console nor the
    command line could filter on it."""
    first, second = held
    page = text(await logged_in.get(f"/console/events/{second.id}"))
    assert '<dd id="event-status" class="">held</dd>' in page
    shown = text(await logged_in.get("/console/events?status=held"))
    assert f'href="/console/events/{second.id}"' in shown
    assert f'href="/console/events/{first.id}"' not in shown
    received = text(await logged_in.get("/console/events?status=received"))
    assert f'href="/console/events/{second.id}"' not in received
    listing = run(database_url, "events", "list", "--status", "held")
    assert listing.returncode == 0, listing.stderr
    assert [line.split()[0] for line in listing.stdout.splitlines()[1:]] == [str(second.id)]


def test_every_status_the_inbox_writes_has_its_meaning_in_the_legend():
    assert set(ops_operator.EVENT_STATUSES) == {*inbox.FINAL_STATUSES, *inbox.AWAITING_HANDLING,
                                            inbox.WAITING, ops_operator.HELD}
    assert list(ops_operator.EVENT_STATUS_MEANINGS) == list(ops_operator.EVENT_STATUSES)


@pytest.mark.gen_test
async def test_the_events_page_has_the_legend_of_every_status(logged_in):
    page = text(await logged_in.get("/console/events"))
    for status, meaning in ops_operator.EVENT_STATUS_MEANINGS.items():
        assert f"<dt>{status}</dt><dd>{meaning.replace(chr(39), '&#39;')}</dd>" in page, status


@pytest.mark.gen_test
async def test_metrics_count_the_held_events_and_the_age_of_the_oldest(
        held, http_server, base_url, client, clock):
    clock.advance(minutes=9)
    found = samples((await client.fetch(base_url + "/metrics")).body)
    assert value(found, "receiver_events_held") == 1
    assert value(found, "receiver_events_oldest_held_age_seconds") == 9 * 60


@pytest.mark.gen_test
async def test_an_order_held_past_the_setting_is_told_to_the_administrator_once(
        held, ctx, clock, smtp):
    first, _ = held
    ctx.settings = dataclasses.replace(ctx.settings, inbox_hold_alert_minutes=30)
    # The first report's retries fail (the order is still not in); the second waits on.
    clock.advance(minutes=29)
    await inbox.retry_due(ctx)
    await outbox.send_due(ctx)
    assert smtp.messages == []
    clock.advance(minutes=2)
    await inbox.retry_due(ctx)
    await inbox.retry_due(ctx)
    await outbox.send_due(ctx)
    [(recipients, message)] = smtp.messages
    assert recipients == ["admin@example.test"]
    assert message["Subject"] == f"Order CO-1: events wait behind event #{first.id}"
    body = message.get_body(("plain",)).get_content()
    assert "1 event(s) of order CO-1 have waited since 2026-11-20T09:01:00+00:00" in body
    assert "no compliance order CO-1" in body
