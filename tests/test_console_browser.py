"""The operator console in a real browser against the running service: Debian's
Chromium driven through chromedriver (selenium), `receiver.py serve` in a subprocess on
the test database, the worker stand-in on loopback.

Selenium's calls block, so each runs in a thread while this test's event loop serves the
stand-ins. Screenshots at a phone and a desktop width go to tests/artifacts/console/."""
import asyncio
import functools
import os
import shutil
import struct

import pytest

from models import CrtcOrder, Outbox, WebhookEvent
from tests.console_helpers import COOKIE_SECRET, PASSWORD, PASSWORD_HASH
from tests.ops_helpers import ROOT, Service
from tests.shkeeper import API_KEY, URL as CRYPTO_URL, encode, key_headers, paid

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SCREENSHOTS = os.path.join(ROOT, "tests", "artifacts", "console")
SIZES = {"phone": (375, 812), "desktop": (1280, 800)}
WAIT_SECONDS = 20
SUBMITTED = {"order_name": "ORD-1", "order_number": "FO-1", "state_code": "WY",
             "entity_name": "Acme LLC"}

try:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - requirements-dev.txt installs it
    webdriver = None

if CHROMIUM is None or CHROMEDRIVER is None or webdriver is None:
    if os.environ.get("CI"):
        pytest.fail("chromium, chromium-driver and selenium are needed: .ci/run installs "
                    "them", pytrace=False)
    pytestmark = pytest.mark.skip(
        reason="needs apt-get install chromium chromium-driver, and selenium")


class Browser:
    """One headless Chromium; every call runs in a thread (selenium blocks)."""

    def __init__(self, profile):
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--disable-background-networking",
                     "--disable-component-update", "--no-first-run", "--hide-scrollbars",
                     f"--user-data-dir={profile}"):
            options.add_argument(flag)
        self.driver = webdriver.Chrome(
            options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
        # A click that submits a form returns before the next page is in: looking for an
        # element waits for it, up to this long (the machine is shared and can be slow).
        self.driver.implicitly_wait(WAIT_SECONDS)

    async def do(self, action, *args):
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(action, self.driver, *args))

    async def open(self, url):
        await self.do(lambda d: d.get(url))

    async def fill_and_submit(self, form_css, **fields):
        def run(driver):
            form = driver.find_element(By.CSS_SELECTOR, form_css)
            for name, value in fields.items():
                box = form.find_element(By.NAME, name)
                box.clear()
                box.send_keys(value)
            form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        await self.do(run)

    async def click(self, css):
        await self.do(lambda d: d.find_element(By.CSS_SELECTOR, css).click())

    async def text(self, css="body"):
        return await self.do(lambda d: d.find_element(By.CSS_SELECTOR, css).text)

    async def arrive(self, path):
        """Wait until the browser shows `path`, query aside (after a redirect or a form)."""
        await self.do(lambda d: WebDriverWait(d, WAIT_SECONDS).until(
            lambda driver: driver.current_url.split("/", 3)[3].split("?")[0] == path))

    async def screenshot(self, name, size):
        os.makedirs(SCREENSHOTS, exist_ok=True)
        path = os.path.join(SCREENSHOTS, f"{name}.png")

        def run(driver):
            driver.set_window_size(*size)
            driver.refresh()
            # The page's width as the browser laid it out: nothing wider than the window.
            width = driver.execute_script("return document.documentElement.scrollWidth")
            driver.save_screenshot(path)
            return width
        return path, await self.do(run)

    def quit(self):
        self.driver.quit()


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
            screenshot, width = await browser.screenshot(f"{page}-{device}", size)
            assert png_size(screenshot)[0] == size[0]
            assert width <= size[0], f"{page} is {width} px wide on a {size[0]} px {device}"
