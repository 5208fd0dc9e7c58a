"""The "I already filed" pages, and the reminder e-mail, in a real browser: Debian's
headless Chromium, driven by its own command line (--dump-dom for the DOM after load,
--screenshot for a PNG), at a phone width and a desktop width. Screenshots are written to tests/artifacts/browser/."""
import asyncio
import dataclasses
import os
import shutil
import struct

import pytest
import tornado.web
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.ui import WebDriverWait

from app.server import make_app
from domain.links import already_filed, record_self_filed
from engine.transaction import Transaction
from tests.browser_helpers import WAIT_SECONDS, Browser, needs_selenium_chromium
from tests.door import through_the_door
from tests.public_helpers import compliance_order, served, signed_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCREENSHOTS = os.path.join(ROOT, "tests", "artifacts", "browser")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SIZES = {"phone": (375, 812), "desktop": (1280, 800)}
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--hide-scrollbars", "--disable-dev-shm-usage")

if CHROMIUM is None:
    if os.environ.get("CI"):
        pytest.fail("chromium is not installed: .ci/run installs it", pytrace=False)
    pytestmark = pytest.mark.skip(reason="chromium not installed (apt-get install chromium)")


class Chromium:
    def __init__(self, profiles):
        self.profiles = profiles
        self.runs = 0

    async def run(self, url, size, *action):
        """Run one headless Chromium with a fresh profile; returns its stdout."""
        self.runs += 1
        profile = self.profiles / f"profile-{self.runs}"
        width, height = size
        process = await asyncio.create_subprocess_exec(
            CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
            "--virtual-time-budget=3000", *action, url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(process.communicate(), timeout=60)
        assert process.returncode == 0, err.decode(errors="replace")[-2000:]
        return out.decode("utf-8")

    async def dom(self, url, size):
        return await self.run(url, size, "--dump-dom")

    async def screenshot(self, url, size, name):
        os.makedirs(SCREENSHOTS, exist_ok=True)
        path = os.path.join(SCREENSHOTS, f"{name}.png")
        if os.path.exists(path):
            os.remove(path)
        await self.run(url, size, f"--screenshot={path}")
        return path


def png_size(path):
    with open(path, "rb") as png:
        header = png.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


@pytest.fixture
def browser(tmp_path):
    return Chromium(tmp_path)


@pytest.fixture
def driven(tmp_path):
    """A Chromium driven through chromedriver, to measure a page as laid out."""
    marked = needs_selenium_chromium()
    if marked:
        pytest.skip(marked.kwargs["reason"])
    chromium = Browser(tmp_path / "driven-profile")
    yield chromium
    chromium.quit()


@pytest.fixture
def site(ctx, clock):
    """The service behind its own HTTPServer."""
    compliance_order("CO-20001", "Dana Trucking LLC")
    clock.set(2026, 10, 5, 8, 30)
    through_the_door(record_self_filed, Transaction(ctx), "ifta", "CO-20001", "2026-Q2", clock())
    clock.set(2026, 11, 20, 9, 15)
    return make_app(ctx)


PAGES = {
    "question": ("yourself, Dana Trucking LLC?", "Yes, I filed"),
    "already-recorded": ("Already recorded, Dana Trucking LLC", "5 October 2026 at 08:30 UTC"),
    "invalid-link": ("This link is not valid", "Nothing was recorded."),
}


def page_path(ctx, page, width):
    if page == "question":
        # A quarter of its own per width (a year far off): a link not pressed yet.
        return signed_path(ctx, "ifta", "CO-20001", f"{2026 + width}-Q3")
    if page == "already-recorded":
        return signed_path(ctx, "ifta", "CO-20001", "2026-Q2")
    good = signed_path(ctx, "ifta", "CO-20001", "2026-Q3")
    return good[:-4]


@pytest.mark.parametrize("device", SIZES)
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.gen_test(timeout=120)
async def test_the_page_reads_right_in_chromium(site, ctx, browser, page, device):
    width, height = SIZES[device]
    heading, detail = PAGES[page]
    with served(site, ctx.settings) as base:
        dom = await browser.dom(base + page_path(ctx, page, width), SIZES[device])
        screenshot = await browser.screenshot(base + page_path(ctx, page, width + 1),
                                              SIZES[device], f"{page}-{device}")
    assert heading in dom and detail in dom
    assert "<script" not in dom
    assert png_size(screenshot) == (width, height)


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.gen_test(timeout=120)
async def test_no_page_is_wider_than_a_375_px_phone(site, ctx, driven, page):
    long_number = "CO-" + "9" * 90
    compliance_order(long_number, service_slug="ucr")
    path = (signed_path(ctx, "ucr", long_number, "2027") if page == "question"
            else page_path(ctx, page, 375))
    with served(site, ctx.settings) as base:
        assert await driven.widths(base + path, SIZES["phone"]) == (375, 375)


@pytest.mark.gen_test(timeout=120)
async def test_html_in_the_name_stays_text_in_the_browser(ctx, browser, clock):
    """(A cycle is refused unless written as its kind's cycles are: no HTML reaches it.)"""
    compliance_order("CO-30001", '<b id="injected">Bold</b> & Co', service_slug="ucr")
    app = make_app(ctx)
    path = signed_path(ctx, "ucr", "CO-30001", "2027")
    with served(app, ctx.settings) as base:
        dom = await browser.dom(base + path, SIZES["phone"])
        await browser.screenshot(base + path, SIZES["phone"], "escaped-name-phone")
    assert '<b id="injected">' not in dom
    assert "&lt;b id=\"injected\"&gt;Bold&lt;/b&gt; &amp; Co" in dom


@pytest.mark.parametrize("device", SIZES)
@pytest.mark.gen_test(timeout=120)
async def test_the_customer_presses_the_button_and_the_filing_is_recorded(
        site, ctx, driven, device):
    """Opening the link (what a mail scanner does too) records nothing; the page's one
    button POSTs, and the page it leads to says the filing is recorded. Both pages fit
    the width, and are saved as screenshots."""
    size = SIZES[device]
    path = signed_path(ctx, "ifta", "CO-20001", "2026-Q3")

    def open_question(driver, url):
        driver.set_window_size(*size)
        driver.get(url)
        driver.save_screenshot(os.path.join(SCREENSHOTS, f"question-{device}.png"))
        return driver.execute_script("return document.documentElement.scrollWidth")

    def press(driver):
        [button] = driver.find_elements(By.CSS_SELECTOR, "form button[type=submit]")
        label = button.text
        button.click()
        # The click returns before the next page is in: wait until the question is gone,
        # and the next page's heading is read from the page once it is loaded (one read
        # while the old document goes finds a node no longer in it).
        WebDriverWait(driver, WAIT_SECONDS).until(staleness_of(button))
        WebDriverWait(driver, WAIT_SECONDS).until(
            lambda d: d.execute_script("return document.readyState") == "complete")
        heading = WebDriverWait(driver, WAIT_SECONDS, ignored_exceptions=(
            WebDriverException,)).until(
                lambda d: d.find_element(By.CSS_SELECTOR, "h1").text)
        driver.save_screenshot(os.path.join(SCREENSHOTS, f"confirmation-{device}.png"))
        return label, heading, driver.find_element(By.CSS_SELECTOR, "body").text, \
            driver.execute_script("return document.documentElement.scrollWidth")

    os.makedirs(SCREENSHOTS, exist_ok=True)
    with served(site, ctx.settings) as base:
        question_width = await driven.do(open_question, base + path)
        assert await driven.text("h1") == "Did you file 2026-Q3 yourself, Dana Trucking LLC?"
        assert not through_the_door(already_filed, Transaction(ctx), "ifta", "CO-20001", "2026-Q3")
        label, heading, body, confirmation_width = await driven.do(press)
    assert label == "Yes, I filed 2026-Q3 myself"
    assert heading == "Thank you, Dana Trucking LLC: we have recorded that you filed"
    assert "20 November 2026 at 09:15 UTC" in body
    assert (question_width, confirmation_width) == (size[0], size[0])
    assert through_the_door(already_filed, Transaction(ctx), "ifta", "CO-20001", "2026-Q3")


class MailPage(tornado.web.RequestHandler):
    """A test-only page serving the HTML part of an e-mail as received."""

    def initialize(self, html):
        self.html = html

    def get(self):
        self.finish(self.html)


@pytest.mark.gen_test(timeout=120)
async def test_the_reminder_e_mail_fits_a_375_px_phone(ctx, clock, browser, driven, smtp):
    from domain.reminders import send_reminders
    from models import ComplianceOrder
    for number, slug in (("CO-40001", "ifta"), ("CO-40002", "ucr")):
        ComplianceOrder.create(order_number=number, service_slug=slug, payment_status="paid",
                               customer_email="dana@example.test",
                               customer_name="Dana Trucking LLC",
                               service_name=f"{slug.upper()} filing for a long fleet name")
    ComplianceOrder.create(order_number="CO-40003", customer_email="dana@example.test",
                           fulfillment_status="awaiting_intake", service_name="BOI report")
    ctx.settings = dataclasses.replace(ctx.settings, filing_reminder_days=(31,))
    clock.set(2026, 12, 31, 9, 0)  # the UCR due date, and 31 days before IFTA Q4's
    await send_reminders(ctx)
    [(_, message)] = smtp.messages
    app = make_app(ctx)
    app.add_handlers(r".*", [
        (r"/test-only/mail", MailPage, {"html": message.get_body(("html",)).get_content()})])
    with served(app, ctx.settings) as base:
        widths = await driven.widths(base + "/test-only/mail", SIZES["phone"])
        await browser.screenshot(base + "/test-only/mail", SIZES["phone"], "reminder-mail-phone")
    assert widths == (375, 375)
