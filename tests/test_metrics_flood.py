"""/metrics under a scrape flood: the database gauges come from a cache, and the
operator can require a bearer token."""
import dataclasses

import pytest

from models import WebhookEvent
from tests.test_ops_endpoints import samples, value


def failed_event(number):
    WebhookEvent.create(source="workflow", event_type="formation/ready",
                        dedup_key=f"k{number}", payload="{}", status="failed")


@pytest.fixture
def scrape(http_server, base_url, client):
    async def fetch(headers=None):
        return await client.fetch(base_url + "/metrics", headers=headers or {})
    return fetch


@pytest.mark.gen_test
async def test_a_scrape_flood_reads_the_database_once_per_cache_period(scrape, ctx, clock, db):
    clock.set(2026, 11, 20, 9, 0, 0)
    failed_event(1)
    assert value(samples((await scrape()).body), "receiver_events_failed") == 1
    failed_event(2)
    # 20 scrapers within the period: the gauges of the first, the database left alone.
    for _ in range(20):
        found = samples((await scrape()).body)
        assert value(found, "receiver_events_failed") == 1
    clock.advance(seconds=ctx.settings.metrics_cache_seconds)
    assert value(samples((await scrape()).body), "receiver_events_failed") == 2


@pytest.mark.gen_test
async def test_the_counters_are_never_cached(scrape, ctx, clock):
    clock.set(2026, 11, 20, 9, 0, 0)
    await scrape()
    ctx.metrics.event_duplicate("card", "balance.available")
    found = samples((await scrape()).body)
    assert value(found, "receiver_events_total", source="card", type="balance.available",
                 outcome="duplicate") == 1


@pytest.mark.parametrize("headers,status", [
    ({}, 401), ({"Authorization": "Bearer wrong-metrics-token"}, 401),
    ({"Authorization": "Basic bWV0cmljcy10b2tlbi0xMjM="}, 401),
    ({"Authorization": "Bearer metrics-token-123"}, 200),
    ({"Authorization": "bearer  metrics-token-123"}, 200),
], ids=["none", "wrong", "basic", "right", "lowercase-scheme"])
@pytest.mark.gen_test
async def test_with_metrics_token_set_only_its_bearer_is_answered(scrape, ctx, headers, status):
    ctx.settings = dataclasses.replace(ctx.settings, metrics_token="metrics-token-123")
    response = await scrape(headers)
    assert response.code == status
    if status == 401:
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="metrics"'
        assert b"receiver_" not in response.body
    else:
        assert b"receiver_events_failed" in response.body
