"""A real Chromium driven through chromedriver (selenium), shared by the page tests and
the console's. Selenium's calls block, so each runs in a thread while the test's event
loop serves the service and its stand-ins.

A script run through the driver is not subject to the page's Content-Security-Policy,
so pages that allow no script (and no framing) can still be measured as laid out."""
import asyncio
import functools
import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
WAIT_SECONDS = 20

try:
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.expected_conditions import staleness_of
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - requirements-dev.txt installs it
    webdriver = None


def needs_selenium_chromium():
    """Call at a test module's top: fails in CI, skips elsewhere, when a part is missing."""
    if CHROMIUM is None or CHROMEDRIVER is None or webdriver is None:
        if os.environ.get("CI"):
            pytest.fail("chromium, chromium-driver and selenium are needed: .ci/run "
                        "installs them", pytrace=False)
        return pytest.mark.skip(
            reason="needs apt-get install chromium chromium-driver, and selenium")
    return None


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

    async def click_and_leave(self, css):
        """Click what sends the page away (a form's button), and wait until the page it
        was on is gone: a read right after the click may find the old page's elements."""
        def run(driver):
            element = driver.find_element(By.CSS_SELECTOR, css)
            element.click()
            WebDriverWait(driver, WAIT_SECONDS).until(staleness_of(element))
        await self.do(run)

    async def shows(self, css, text):
        """Wait until the element at `css` says `text` (the page that says it may still be
        on its way: the old one's element goes stale, or is not there yet)."""
        def run(driver):
            WebDriverWait(driver, WAIT_SECONDS, ignored_exceptions=(WebDriverException,)).until(
                lambda d: text in d.find_element(By.CSS_SELECTOR, css).text)
        await self.do(run)

    async def text(self, css="body"):
        return await self.do(lambda d: d.find_element(By.CSS_SELECTOR, css).text)

    async def arrive(self, path):
        """Wait until the browser shows `path`, query aside (after a redirect or a form)."""
        await self.do(lambda d: WebDriverWait(d, WAIT_SECONDS).until(
            lambda driver: driver.current_url.split("/", 3)[3].split("?")[0] == path))

    async def widths(self, url, size):
        """(scrollWidth, clientWidth) of `url` laid out in a window of `size`: the content's
        width against the viewport's."""
        def run(driver):
            driver.set_window_size(*size)
            driver.get(url)
            return tuple(driver.execute_script(
                "const root = document.documentElement;"
                "return [root.scrollWidth, root.clientWidth];"))
        return await self.do(run)

    async def screenshot(self, path, size, reload=True):
        """Save the open page at `size` to `path`; returns its laid-out scrollWidth.
        `reload=False`: as it stands (a page shown once, after an action), laid out
        afresh at the new size without asking the server again."""
        def run(driver):
            driver.set_window_size(*size)
            if reload:
                driver.refresh()
            width = driver.execute_script("return document.documentElement.scrollWidth")
            driver.save_screenshot(path)
            return width
        return await self.do(run)

    def quit(self):
        self.driver.quit()


@pytest.fixture
def browser(tmp_path):
    """A Browser for the test, quit after it (import it into a test module to use it)."""
    chromium = Browser(tmp_path / "profile")
    yield chromium
    chromium.quit()
