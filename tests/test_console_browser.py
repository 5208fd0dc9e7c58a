"""The operator console in a real browser against the running service: Debian's
Chromium driven through chromedriver (selenium), `receiver.py serve` in a subprocess on
the test database, the worker stand-in on loopback.

Selenium's calls block, so each runs in a thread while this test's event loop serves the
stand-ins. Screenshots at a phone and a desktop width go to tests/artifacts/console/."""
import os
import struct

import pytest

from models import CrtcOrder, Outbox, WebhookEvent
from tests.browser_helpers import Browser, needs_selenium_chromium
from tests.console_helpers import COOKIE_SECRET, PASSWORD, PASSWORD_HASH
from tests.ops_helpers import ROOT, Service
from tests.shkeeper import API_KEY, URL as CRYPTO_URL, encode, key_headers, paid

SCREENSHOTS = os.path.join(ROOT, "tests", "artifacts", "console")
SIZES = {"phone": (375, 812), "desktop": (1280, 800)}
SUBMITTED = {"order_name": "ORD-1", "order_number": "FO-1", "state_code": "WY",
             "entity_name": "Acme LLC"}

pytestmark = needs_selenium_chromium() or []


async def save_screenshot(browser, name, size):
    os.makedirs(SCREENSHOTS, exist_ok=True)
    path = os.path.join(SCREENSHOTS, f"{name}.png")
    return path, await browser.screenshot(path, size)


@pytest.fixture
def browser(tmp_path):
    chromium = Browser(tmp_path / "profile")
    yield chromium
    chromium.quit()


@pytest.fixture
def service(tmp_path, database_url, worker, frappe, io_loop):
    running = Service(str(tmp_path / "service.log"), {
        "DATABASE_URL": database_url, "SPOOL_DIR": str(tmp_path / "spool"),
        "WEBHOOK_SECRET": "test-webhook-secret", "WORKER_URL": worker.url,
        "WORKFLOW_URL": frappe.url, "WORKFLOW_API_KEY": "k", "WORKFLOW_API_SECRET": "s",
        "CRYPTO_PROCESSOR_API_KEY": API_KEY, "CONSOLE_PASSWORD_HASH": PASSWORD_HASH,
        "COOKIE_SECRET": COOKIE_SECRET, "OUTBOUND_TIMEOUT_SECONDS": "3"})
    yield running
    running.kill()


def png_size(path):
    with open(path, "rb") as png:
        header = png.read(24)
    return struct.unpack(">II", header[16:24])


@pytest.mark.gen_test(timeout=180)
async def test_an_operator_replays_a_failed_event_and_retries_a_dead_effect(
        service, browser, client, worker):
    await service.start()
    await service.wait_ready(client)
    # A payment for an order that is not there yet: kept, failed, to be replayed.
    await client.fetch(service.url + CRYPTO_URL, method="POST", body=encode(paid("CA-7")),
                       headers=key_headers())
    failed = WebhookEvent.get(WebhookEvent.order_number == "CA-7")
    assert failed.status == "failed"
    CrtcOrder.create(order_number="CA-7", customer_name="Rae Radio Ltd", total_cents=780)
    # A job the worker refused: dead, to be retried once the worker answers again.
    worker.fail_with(400)
    await client.fetch(service.url + "/api/v1/webhooks/formation/submitted", method="POST",
                       body=encode(SUBMITTED), headers={"X-Webhook-Secret": "test-webhook-secret"})
    dead = Outbox.get(Outbox.kind == "job")
    assert dead.status == "dead"
    worker.status, worker.body = 200, {"ok": True}

    await browser.open(service.url + "/console/")
    await browser.arrive("console/login")
    await browser.fill_and_submit("main form", name="Dana", password=PASSWORD)
    await browser.arrive("console/")

    await browser.fill_and_submit("header form[role=search]", number="CA-7")
    await browser.arrive("console/orders/CA-7")
    assert "Rae Radio Ltd" in await browser.text("main")
    await browser.click(f'a[href="/console/events/{failed.id}"]')
    await browser.arrive(f"console/events/{failed.id}")
    assert await browser.text("#event-status") == "failed"
    await browser.click('form[action$="/replay"] button')
    assert "Replayed: the event is now processed." in await browser.text(".notice")
    assert await browser.text("#event-status") == "processed"
    assert WebhookEvent.get_by_id(failed.id).status == "processed"
    assert CrtcOrder.get(CrtcOrder.order_number == "CA-7").payment_status == "paid"

    await browser.open(service.url + "/console/outbox?status=dead")
    await browser.click(f'form[action="/console/outbox/{dead.id}/retry"] button')
    assert f"Effect #{dead.id} (job) retried: now sent." in await browser.text(".notice")
    assert Outbox.get_by_id(dead.id).status == "sent"
    assert [r.json["action"] for r in worker.requests][-1] == "name_search"

    await browser.open(service.url + "/console/actions")
    recorded = await browser.text("main")
    assert "replay event" in recorded and "retry effect" in recorded and "Dana" in recorded

    for page, path in (("overview", "/console/"), ("order", "/console/orders/CA-7"),
                       ("event", f"/console/events/{failed.id}")):
        await browser.open(service.url + path)
        for device, size in SIZES.items():
            screenshot, width = await save_screenshot(browser, f"{page}-{device}", size)
            assert png_size(screenshot)[0] == size[0]
            assert width <= size[0], f"{page} is {width} px wide on a {size[0]} px {device}"
