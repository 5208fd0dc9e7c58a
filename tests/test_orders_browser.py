"""An order created through the orders API, its webhook, and the console that shows it
handled, in a real browser (Chromium through chromedriver) against `receiver.py serve`;
and a call that came before its order, waiting on the console's overview until the order
comes in. Screenshots at a phone and a desktop width go to tests/artifacts/orders/."""
import json
import os

import pytest

from models import CrtcOrder, WebhookEvent
from tests.browser_helpers import browser, needs_selenium_chromium  # noqa: F401 (a fixture)
from tests.console_helpers import COOKIE_SECRET, PASSWORD, PASSWORD_HASH
from tests.ops_helpers import ROOT, Service
from tests.shkeeper import API_KEY, URL as CRYPTO_URL, encode, key_headers, paid
from tests.waits import eventually

SCREENSHOTS = os.path.join(ROOT, "tests", "artifacts", "orders")
SIZES = {"phone": (375, 812), "desktop": (1280, 800)}
ORDERS_KEY = "orders-api-key-for-the-browser-test-0123"

pytestmark = needs_selenium_chromium() or []


@pytest.fixture
def service(tmp_path, database_url, telegram, io_loop):
    running = Service(str(tmp_path / "service.log"), {
        "DATABASE_URL": database_url, "SPOOL_DIR": str(tmp_path / "spool"),
        "ORDERS_API_KEY": ORDERS_KEY, "CRYPTO_PROCESSOR_API_KEY": API_KEY,
        "TELEGRAM_API_URL": telegram.url, "TELEGRAM_BOT_TOKEN": "123:bot",
        "TELEGRAM_CHAT_ID": "-1", "CONSOLE_PASSWORD_HASH": PASSWORD_HASH,
        "COOKIE_SECRET": COOKIE_SECRET, "OUTBOUND_TIMEOUT_SECONDS": "3"})
    yield running
    running.kill()


async def put_order(client, service, number, **fields):
    response = await client.fetch(
        f"{service.url}/api/v1/orders/canada_crtc/{number}", method="PUT",
        body=json.dumps(fields), headers={"Authorization": f"Bearer {ORDERS_KEY}",
                                          "Content-Type": "application/json"})
    return response.code, json.loads(response.body)


async def get_order(client, service, number):
    response = await client.fetch(f"{service.url}/api/v1/orders/canada_crtc/{number}",
                                  headers={"Authorization": f"Bearer {ORDERS_KEY}"})
    assert response.code == 200
    return json.loads(response.body)


async def pay_in_crypto(client, service, number):
    response = await client.fetch(service.url + CRYPTO_URL, method="POST",
                                  body=encode(paid(number)), headers=key_headers())
    assert response.code == 202


async def screenshots(browser, name):
    os.makedirs(SCREENSHOTS, exist_ok=True)
    widths = []
    for device, size in SIZES.items():
        path = os.path.join(SCREENSHOTS, f"{name}-{device}.png")
        widths.append((await browser.screenshot(path, size), size[0]))
    return widths


@pytest.mark.gen_test(timeout=240)
async def test_an_order_made_through_the_api_is_paid_and_the_console_shows_it_handled(
        service, browser, client, telegram):
    await service.start()
    await service.wait_ready(client)
    status, order = await put_order(client, service, "CA-7", customer_name="Rae Radio Ltd",
                                    customer_email="rae@example.test", total_cents=780,
                                    service_name="CRTC registration")
    assert status == 201 and order["service"]["payment_status"] == "pending_payment"
    await pay_in_crypto(client, service, "CA-7")
    assert (await get_order(client, service, "CA-7"))["service"]["payment_status"] == "paid"

    await browser.open(service.url + "/console/login")
    await browser.fill_and_submit("main form", name="Dana", password=PASSWORD)
    await browser.arrive("console/")
    await browser.open(service.url + "/console/orders/CA-7")
    timeline = await browser.text("main")
    assert "Rae Radio Ltd" in timeline and "processed" in timeline
    await eventually(lambda: telegram.requests, timeout=30)
    assert "New paid order CA-7" in json.loads(telegram.requests[0].body)["text"]

    # A callback before its order: it waits, on the overview, until the order comes in.
    await pay_in_crypto(client, service, "CA-8")
    assert WebhookEvent.get(WebhookEvent.order_number == "CA-8").status == "failed"
    await browser.open(service.url + "/console/")
    waiting = await browser.text("#waiting-for-orders")
    assert waiting.startswith("Calls waiting for an order not there yet\n1\n")
    assert "CA-8 (1, since " in waiting
    for width, viewport in await screenshots(browser, "overview-waiting"):
        assert width <= viewport
    await browser.click('#waiting-for-orders a[href="/console/orders/CA-8"]')
    await browser.arrive("console/orders/CA-8")

    assert (await put_order(client, service, "CA-8", customer_name="Sol Signals"))[0] == 201
    await eventually(
        lambda: CrtcOrder.get(CrtcOrder.order_number == "CA-8").payment_status == "paid",
        timeout=30)
    await browser.open(service.url + "/console/")
    assert (await browser.text("#waiting-for-orders")).endswith("\n0\nnone")
    await browser.open(service.url + "/console/orders/CA-8")
    assert "processed" in await browser.text("main")
    for width, viewport in await screenshots(browser, "order-handled"):
        assert width <= viewport
