"""The operator console in a real browser against the running service: Debian's
Chromium driven through chromedriver (selenium), `receiver.py serve` in a subprocess on
the test database, the worker stand-in on loopback.

Selenium's calls block, so each runs in a thread while this test's event loop serves the
stand-ins. Screenshots at a phone and a desktop width go to tests/artifacts/console/."""
import datetime
import json
import os
import re
import struct

import pytest

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from models import (
    ComplianceOrder, ConsoleAction, CrtcOrder, FormationOrder, Outbox, TreasuryJob, WebhookEvent,
)
from tests import stripe_events as se
from tests.browser_helpers import browser, needs_selenium_chromium  # noqa: F401 (a fixture)
from tests.console_helpers import COOKIE_SECRET, PASSWORD, PASSWORD_HASH
from tests.public_helpers import compliance_order
from tests.ops_helpers import ROOT, Service
from tests.shkeeper import API_KEY, URL as CRYPTO_URL, encode, key_headers, paid

SCREENSHOTS = os.path.join(ROOT, "tests", "artifacts", "console")
SIZES = {"phone": (375, 812), "desktop": (1280, 800)}
ORDERS_API_KEY = "orders-api-key-for-the-browser-0123456789"
SUBMITTED = {"order_name": "ORD-1", "order_number": "FO-1", "state_code": "WY",
             "entity_name": "Acme LLC"}

pytestmark = needs_selenium_chromium() or []


async def save_screenshot(browser, name, size, reload=True):
    os.makedirs(SCREENSHOTS, exist_ok=True)
    path = os.path.join(SCREENSHOTS, f"{name}.png")
    return path, await browser.screenshot(path, size, reload)


@pytest.fixture
def service(tmp_path, database_url, worker, frappe, io_loop):
    running = Service(str(tmp_path / "service.log"), {
        "DATABASE_URL": database_url, "SPOOL_DIR": str(tmp_path / "spool"),
        "WEBHOOK_SECRET": "test-webhook-secret", "WORKER_URL": worker.url,
        "WORKFLOW_URL": frappe.url, "WORKFLOW_API_KEY": "k", "WORKFLOW_API_SECRET": "s",
        "CRYPTO_PROCESSOR_API_KEY": API_KEY, "CONSOLE_PASSWORD_HASH": PASSWORD_HASH,
        "COOKIE_SECRET": COOKIE_SECRET, "OUTBOUND_TIMEOUT_SECONDS": "3",
        "ORDERS_API_KEY": ORDERS_API_KEY,
        # Shorter than an effect's first wait after a failed try (15 to 30 s): a failed
        # effect is then soon off its send's lease, and can be retried from its page.
        "CLAIM_LEASE_SECONDS": "5"})
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
    assert f"Event #{failed.id} replayed: it is now processed." in await browser.text(".notice")
    assert await browser.text("#event-status") == "processed"
    assert WebhookEvent.get_by_id(failed.id).status == "processed"
    assert CrtcOrder.get(CrtcOrder.order_number == "CA-7").payment_status == "paid"

    await browser.open(service.url + "/console/outbox?status=dead")
    await browser.click(f'form[action="/console/outbox/{dead.id}/retry"] button')
    assert f"Effect #{dead.id} (worker job name_search) sent at" in await browser.text(".notice")
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


def waiting_renewal(subscription, invoice_id):
    """A renewal stored waiting for the order of its subscription, looked at again in an
    hour: no scheduler run takes it while the operator acts."""
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    evt = se.event("invoice.paid", se.invoice(subscription, invoice_id=invoice_id))
    return WebhookEvent.create(
        source="card", event_type="invoice.paid", dedup_key=f"invoice.paid:{invoice_id}",
        external_id=evt["id"], payload=json.dumps(evt), status="waiting",
        waiting_for=f"subscription:{subscription}", next_attempt_at=later,
        received_at=datetime.datetime.now(datetime.timezone.utc),
        last_error=f"invoice {invoice_id}: no compliance order has subscription "
                   f"{subscription} yet")


@pytest.mark.gen_test(timeout=180)
async def test_an_operator_looks_again_for_a_waiting_facts_order_or_gives_it_up(
        service, browser, client, worker):
    await service.start()
    await service.wait_ready(client)
    compliance_order("CO-1", service_slug="registered-agent")
    renewal = waiting_renewal("sub_test_1", "in_test_r1")
    lost = waiting_renewal("sub_test_9", "in_test_r9")

    await browser.open(service.url + "/console/")
    await browser.arrive("console/login")
    await browser.fill_and_submit("main form", name="Dana", password=PASSWORD)
    await browser.arrive("console/")
    await browser.click("#facts-waiting-list")
    await browser.arrive("console/events")
    assert "2 fact(s) waiting for their order" in await browser.text("#bulk")
    await shots_of(browser, "waiting-facts")

    await browser.open(f"{service.url}/console/events/{renewal.id}")
    assert await browser.text("#event-status") == "waiting"
    assert not await browser.do(lambda d: d.find_elements(By.NAME, "confirm"))
    await shots_of(browser, "waiting-fact")
    await browser.click_and_leave('form[action$="/replay"] button')
    assert "it is now waiting. Its order is still not known" in await browser.text("#notice")
    assert await browser.text("#event-status") == "waiting"
    # The operator links the subscription to its order by hand, and looks again.
    ComplianceOrder.update(stripe_subscription_id="sub_test_1").execute()
    await browser.click_and_leave('form[action$="/replay"] button')
    assert f"Event #{renewal.id} replayed: it is now processed." in await browser.text(
        "#notice")
    assert await browser.text("#event-status") == "processed"
    assert [r.json["invoice_id"] for r in worker.requests] == ["in_test_r1"]

    await browser.open(f"{service.url}/console/events/{lost.id}")
    await browser.fill_and_submit("form.give-up", reason="order deleted in the shop")
    await browser.arrive(f"console/events/{lost.id}")
    await browser.shows("#notice", "given up, with your reason")
    assert await browser.text("#event-status") == "dead"
    assert "order deleted in the shop" in await browser.text("#event-given-up")
    await shots_of(browser, "waiting-fact-given-up", reload=False)
    assert WebhookEvent.get_by_id(lost.id).given_up_by == "Dana"


# What must be in sight on a phone: each list's labels, and the buttons.
PHONE = SIZES["phone"]
LINKS = ("return Array.from(document.querySelectorAll('a[href^=\"/console/\"]'))"
         ".map(a => a.getAttribute('href'))")
# The rectangles a piece of text is laid out in: more than one line's means it broke.
LINES_OF_TEXT = """
const wanted = arguments[0];
const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
const lines = [];
while (walker.nextNode()) {
  const at = walker.currentNode.data.indexOf(wanted);
  if (at < 0) continue;
  const range = document.createRange();
  range.setStart(walker.currentNode, at);
  range.setEnd(walker.currentNode, at + wanted.length);
  lines.push(new Set(Array.from(range.getClientRects()).map(r => Math.round(r.top))).size);
}
return lines;"""
# Elements whose text is `wanted` (case aside), shown and inside the viewport's width.
IN_SIGHT = """
const wanted = arguments[0].toLowerCase();
return Array.from(document.querySelectorAll('main *')).filter(e => {
  if (e.children.length || e.innerText.trim().replace(/:$/, '').toLowerCase() !== wanted)
    return false;
  const r = e.getBoundingClientRect();
  return r.width > 0 && r.height > 0 && r.left >= 0 && r.right <= window.innerWidth;
}).length;"""


async def seen_at(browser, size, script, *args):
    def run(driver):
        driver.set_window_size(*size)
        return driver.execute_script(script, *args)
    return await browser.do(run)


async def a_job_failing_and_a_job_refused(service, client, worker):
    """FO-1's worker job fails (503: pending, tried again later); FO-2's is refused (400:
    dead)."""
    headers = {"X-Webhook-Secret": "test-webhook-secret"}
    worker.fail_with(503, {"error": "worker restarting"})
    await client.fetch(service.url + "/api/v1/webhooks/formation/submitted", method="POST",
                       body=encode(SUBMITTED), headers=headers)
    worker.fail_with(400, {"error": "unknown state code"})
    await client.fetch(service.url + "/api/v1/webhooks/formation/submitted", method="POST",
                       body=encode({**SUBMITTED, "order_number": "FO-2",
                                    "order_name": "ORD-2"}), headers=headers)


async def a_failed_and_retried_effect(service, client, worker, browser):
    """FO-1's worker job fails (503), then an operator retries it from its page and it
    is sent; FO-2's is refused (400) and dead; CA-7 is paid in crypto."""
    FormationOrder.create(order_number="FO-1", customer_name="Ada Lovelace",
                          customer_email="ada@example.test", service_name="Wyoming LLC",
                          order_name="ORD-1")
    await a_job_failing_and_a_job_refused(service, client, worker)
    CrtcOrder.create(order_number="CA-7", customer_name="Rae Radio Ltd", total_cents=123456)
    await client.fetch(service.url + CRYPTO_URL, method="POST",
                       body=encode(paid("CA-7", balance_fiat="1234.56")), headers=key_headers())
    assert TreasuryJob.get().amount_fiat_cents == 123456
    job = Outbox.get(Outbox.kind == "job", Outbox.order_number == "FO-1")
    assert job.status == "pending"
    worker.status, worker.body = 200, {"ok": True, "job_id": "job-1"}
    await browser.open(f"{service.url}/console/outbox/{job.id}")
    await browser.click('form[action$="/retry"] button')
    assert "(worker job name_search) sent at" in await browser.text(".notice")
    return job


@pytest.mark.gen_test(timeout=300)
async def test_every_page_at_desktop_and_phone_width(service, browser, client, worker):
    await service.start()
    await service.wait_ready(client)
    await browser.open(service.url + "/console/login")
    await browser.fill_and_submit("main form", name="Dana", password=PASSWORD)
    await browser.arrive("console/")
    job = await a_failed_and_retried_effect(service, client, worker, browser)

    # Every page the navigation links to, and every page those link to.
    seen, frontier = set(), {"/console/"}
    while frontier:
        path = sorted(frontier)[0]
        frontier.discard(path)
        seen.add(path)
        await browser.open(service.url + path)
        assert "Something went wrong" not in await browser.text("main"), path
        name = re.sub(r"[^a-z0-9]+", "-", path[len("/console/"):].lower()).strip("-")
        for device, size in SIZES.items():
            shot, width = await save_screenshot(browser, f"{name or 'overview'}-{device}", size)
            assert png_size(shot)[0] == size[0]
            assert width <= size[0], f"{path} is {width} px wide on a {size[0]} px {device}"
        if path.count("/") <= 2 or path.startswith("/console/orders/"):
            links = await browser.do(lambda d: d.execute_script(LINKS))
            frontier |= {link for link in links if link not in seen
                         and not link.endswith(".css") and "before=" not in link}
    assert {"/console/links", f"/console/outbox/{job.id}", "/console/orders/FO-1",
            "/console/settlement", "/console/actions"} <= seen

    # On a phone, a list's labels and buttons are in sight, not scrolled away.
    await browser.open(service.url + "/console/events")
    for label in ("status", "tries", "order", "last error"):
        assert await seen_at(browser, PHONE, IN_SIGHT, label), f"{label} out of sight"
    await browser.open(service.url + "/console/outbox?status=dead")
    assert await seen_at(browser, PHONE, IN_SIGHT, "retry all dead")
    assert await seen_at(browser, PHONE, IN_SIGHT, "retry now")
    events = await browser.do(lambda d: d.find_element(By.CSS_SELECTOR, "main").text)
    assert "STATUS: DEAD" in events.upper()
    await browser.open(service.url + "/console/orders/CA-7")
    # The order's total and the amount paid (its facts, and the created line) and the
    # crypto payment's fiat amount, each on one line.
    assert await seen_at(browser, PHONE, LINES_OF_TEXT, "1234.56") == [1, 1, 1, 1]

    # The timeline of an order with a failed and retried effect, for the docs.
    await browser.open(service.url + "/console/orders/FO-1")
    timeline = await browser.text("main")
    assert "worker job name_search" in timeline and "HTTP 503" in timeline
    assert "retry effect by Dana" in timeline and "HTTP 200" in timeline
    await save_screenshot(browser, "timeline-docs", (1280, 900))
    await browser.open(service.url + "/console/")
    await save_screenshot(browser, "overview-docs", (1280, 1000))


async def put_order(client, service, number, body, query=""):
    response = await client.fetch(
        f"{service.url}/api/v1/orders/canada_crtc/{number}{query}", method="PUT",
        body=json.dumps(body),
        headers={"Authorization": f"Bearer {ORDERS_API_KEY}"})
    return response.code, json.loads(response.body)


@pytest.mark.gen_test(timeout=180)
async def test_a_paid_order_changed_on_purpose_shows_its_change_on_the_timeline(
        service, browser, client):
    """A CRTC order made through the orders API and paid 129.00 CAD in crypto; a PUT that
    moves it to 999.99 USD is refused, then sent with amend_paid=1: the order's page shows
    the payment's amount, the created line the order as it was created, and the change
    (each field's old and new value, who, when), at both widths."""
    await service.start()
    await service.wait_ready(client)
    fay = {"customer_name": "Fay Radio Ltd", "customer_email": "fay@example.com",
           "service_name": "CRTC registration", "total_cents": 12900, "currency": "CAD"}
    assert (await put_order(client, service, "CA-0042", fay))[0] == 201
    await client.fetch(service.url + CRYPTO_URL, method="POST", headers=key_headers(),
                       body=encode(paid("CA-0042", balance_fiat="129.00", fiat="CAD")))
    moved = {"total_cents": 99999, "currency": "USD"}
    status, refused = await put_order(client, service, "CA-0042", moved)
    assert (status, refused["field"]) == (409, "total_cents")
    status, changed = await put_order(client, service, "CA-0042", moved, "?amend_paid=1")
    assert (status, changed["outcome"]) == (200, "updated")

    await browser.open(service.url + "/console/login")
    await browser.fill_and_submit("main form", name="Dana", password=PASSWORD)
    await browser.arrive("console/")
    await browser.open(service.url + "/console/orders/CA-0042")
    assert await browser.text("#amount-paid") == "CAD 129.00"
    assert await browser.text("#order-total") == "$999.99"
    timeline = await browser.text("table.timeline")
    assert ("canada_crtc order created by orders API from 127.0.0.1 Fay Radio Ltd, "
            "<fay@example.com>, CRTC registration, CAD 129.00\n") in timeline
    assert "order changed by orders API from 127.0.0.1" in timeline
    assert "12900 -> 99999" in timeline and "CAD -> USD" in timeline
    assert "payment_status" in timeline and "pending_payment -> paid" in timeline
    # Each field's change is on one line of its own, on a phone too.
    for size in SIZES.values():
        assert await seen_at(browser, size, LINES_OF_TEXT, "12900 -> 99999") == [1]
    await shots_of(browser, "order-history")
    # The whole timeline, its changes below the fold at the usual heights, to look at.
    for device, (width, _) in SIZES.items():
        await save_screenshot(browser, f"order-history-whole-{device}", (width, 2400))


async def shots_of(browser, name, reload=True):
    """The open page at both widths, kept as `name`-desktop/-phone.png; each within its
    width."""
    for device, size in SIZES.items():
        shot, width = await save_screenshot(browser, f"{name}-{device}", size, reload)
        assert png_size(shot)[0] == size[0]
        assert width <= size[0], f"{name} is {width} px wide on a {size[0]} px {device}"


@pytest.mark.gen_test(timeout=300)
async def test_the_operators_actions_say_what_they_did_and_a_reload_does_not_repeat_them(
        service, browser, client, worker):
    """Give up one event, retry the others of a filter, make the waiting effects due and
    retry a dead one, sign a link: each POST leads back to its page with what it did and
    what comes next; the page reloaded asks nothing again. Every page so changed is kept
    at both widths."""
    await service.start()
    await service.wait_ready(client)
    for order in ("CA-7", "CA-8", "CA-9"):  # payments for orders not there yet: failed
        await client.fetch(service.url + CRYPTO_URL, method="POST", body=encode(paid(order)),
                           headers=key_headers())
    await a_job_failing_and_a_job_refused(service, client, worker)
    dead = Outbox.get(Outbox.kind == "job", Outbox.order_number == "FO-2")
    assert dead.status == "dead"
    worker.status, worker.body = 200, {"ok": True, "job_id": "job-2"}
    given_up = WebhookEvent.get(WebhookEvent.order_number == "CA-7")
    assert given_up.status == "failed"
    # Their next tries an hour away, as after a few failures: no scheduler run takes one
    # while the operator looks.
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    assert WebhookEvent.update(next_attempt_at=later).where(
        WebhookEvent.status == "failed").execute() == 3
    assert Outbox.update(next_attempt_at=later).where(Outbox.status == "pending",
                                                      Outbox.kind == "job").execute() == 1

    await browser.open(service.url + "/console/login")
    await browser.fill_and_submit("main form", name="Dana", password=PASSWORD)
    await browser.arrive("console/")

    await browser.open(service.url + "/console/events?status=failed")
    assert "3 failed event(s) this filter finds" in await browser.text("#bulk")
    await shots_of(browser, "actions-events-bulk")

    await browser.open(f"{service.url}/console/events/{given_up.id}")
    await shots_of(browser, "actions-event-give-up-form")
    await browser.fill_and_submit("form.give-up", reason="test payment, no such order")
    await browser.arrive(f"console/events/{given_up.id}")
    assert "given up, with your reason" in await browser.text("#notice")
    assert "by Dana at" in await browser.text("#event-given-up")
    await shots_of(browser, "actions-event-given-up", reload=False)
    await browser.do(lambda driver: driver.refresh())
    assert not await browser.do(lambda d: d.find_elements(By.ID, "notice"))
    assert ConsoleAction.select().where(ConsoleAction.action == "give up event").count() == 1

    await browser.open(service.url + "/console/events?status=failed&source=crypto")
    await browser.click('#bulk form[action="/console/events/retry"] button')
    await browser.arrive("console/events")
    assert (await browser.text("#notice")).startswith("2 event(s) back in line, due now")
    await shots_of(browser, "actions-events-retried", reload=False)

    await browser.open(service.url + "/console/outbox")
    await shots_of(browser, "actions-outbox")
    await browser.click('form[action="/console/outbox/due-now"] button')
    await browser.arrive("console/outbox")
    assert (await browser.text("#notice")).startswith(
        "1 worker effect(s) that waited for a later try are due now")
    await shots_of(browser, "actions-outbox-due-now", reload=False)

    await browser.open(f"{service.url}/console/outbox/{dead.id}")
    await shots_of(browser, "actions-effect-dead")
    await browser.click('form[action$="/retry"] button')
    await browser.arrive(f"console/outbox/{dead.id}")
    assert f"Effect #{dead.id} (worker job name_search) sent at" in await browser.text("#notice")
    assert await browser.text("#effect-destination") == "worker"
    await shots_of(browser, "actions-effect-retried", reload=False)
    await browser.do(lambda driver: driver.refresh())
    assert len([r for r in worker.requests if r.json["order_number"] == "FO-2"]) == 2

    await browser.open(service.url + "/console/orders/CA-7")
    assert "given up by Dana" in await browser.text("main")
    await shots_of(browser, "actions-timeline-given-up")
    await browser.open(service.url + "/console/")
    await shots_of(browser, "actions-overview")

    compliance_order("CO-20001", service_slug="ucr")
    await browser.open(service.url + "/console/links")
    await browser.do(lambda d: Select(d.find_element(By.NAME, "kind"))
                     .select_by_visible_text("ucr"))
    await browser.fill_and_submit("main form", order="CO-20001", cycle="2027")
    await browser.arrive("console/links")
    assert "/api/v1/ucr/filed?order=CO-20001" in await browser.text("#notice-code")
    await shots_of(browser, "actions-link-signed", reload=False)
    await browser.do(lambda driver: driver.refresh())
    assert ConsoleAction.select().where(ConsoleAction.action == "sign link").count() == 1
