"""BEHAVIOUR.md 4.2 balance.available: CRTC orders advance to Client Selection once their
payment has had 2 (card, bnpl) or 4 (ach) business days to settle. Fixed clock; Frappe is a
real HTTP peer on loopback."""
import asyncio
import dataclasses
import datetime
import json

import pytest

from models import UTC, CrtcOrder, Outbox, WebhookEvent
from domain.settlement import business_days_after, settle_crtc_orders
from engine.transaction import Transaction
from tests import stripe_events as se
from tests.stripe_events import RECEIVED, deliver, settings  # noqa: F401 (fixture)

FRIDAY = datetime.datetime(2026, 11, 20, 16, 0, tzinfo=UTC)


def paid_crtc(number, method="card", paid_at=FRIDAY, **fields):
    return CrtcOrder.create(order_number=number, payment_status="paid", payment_method=method,
                            paid_at=paid_at, **fields)


def advanced(frappe):
    return [json.loads(r.json["doc"])["name"] for r in frappe.requests if r.method == "POST"]


def document(name, state):
    """Frappe's answer to GET /api/resource/<doctype>/<name>."""
    return (200, {"data": {"name": name, "doctype": "CRTC Order", "workflow_state": state}})


REFUSED = (417, {"exc_type": "WorkflowTransitionError"})
# The CRTC workflow as Frappe v15 shows it (GET /api/resource/Workflow/<name>), as the
# site of ../shared/real-frappe builds it.
CRTC_TRANSITIONS = [
    {"state": "New", "action": "Request Funds", "next_state": "Awaiting Funds"},
    {"state": "Awaiting Funds", "action": "Confirm Funds", "next_state": "Client Selection"},
    {"state": "Client Selection", "action": "Record Incorporation",
     "next_state": "Incorporated"},
]


def read_back(name, state):
    """What Frappe answers to the read-back after a 417: the document, then the doctype's
    active workflow (listed, then read)."""
    return [document(name, state), (200, {"data": [{"name": "CRTC Order Flow"}]}),
            (200, {"data": {"name": "CRTC Order Flow", "document_type": "CRTC Order",
                            "transitions": CRTC_TRANSITIONS}})]


@pytest.mark.parametrize("start,end,days", [
    ((2026, 11, 20), (2026, 11, 20), 0),   # Friday, same day
    ((2026, 11, 20), (2026, 11, 22), 0),   # to Sunday
    ((2026, 11, 20), (2026, 11, 23), 1),   # to Monday
    ((2026, 11, 20), (2026, 11, 24), 2),   # to Tuesday
    ((2026, 11, 20), (2026, 11, 26), 4),   # to Thursday
    ((2026, 11, 21), (2026, 11, 23), 1),   # Saturday to Monday
    ((2026, 11, 16), (2026, 11, 30), 10),  # two whole weeks
])
def test_business_days_count_weekdays_after_the_start_up_to_the_end(start, end, days):
    assert business_days_after(datetime.date(*start), datetime.date(*end)) == days


@pytest.mark.parametrize("day,settled", [
    ((2026, 11, 21), []), ((2026, 11, 22), []),               # the weekend: nothing
    ((2026, 11, 23), []),                                      # Monday: 1 business day
    ((2026, 11, 24), ["CA-CARD", "CA-BNPL"]),                  # Tuesday: card and bnpl
    ((2026, 11, 25), ["CA-CARD", "CA-BNPL"]),                  # Wednesday: ach has 3
    ((2026, 11, 26), ["CA-CARD", "CA-BNPL", "CA-ACH"]),        # Thursday: ach has 4
], ids=["sat", "sun", "mon", "tue", "wed", "thu"])
@pytest.mark.gen_test
async def test_paid_friday_card_settles_tuesday_and_ach_thursday(
        ctx, clock, frappe, day, settled):
    paid_crtc("CA-CARD", "card")
    paid_crtc("CA-BNPL", "bnpl", paid_at=FRIDAY + datetime.timedelta(minutes=5))
    paid_crtc("CA-ACH", "ach", paid_at=FRIDAY + datetime.timedelta(minutes=10))
    clock.set(*day, 9, 0)
    counts = await settle_crtc_orders(ctx, Transaction(ctx))
    assert advanced(frappe) == settled
    assert counts == {"examined": 3, "settled": len(settled), "not_due": 3 - len(settled),
                      "failed": 0}
    for order in CrtcOrder.select():
        expected = order.order_number in settled
        assert order.funds_available is expected
        assert order.funds_available_at == (clock() if expected else None)


@pytest.mark.gen_test
async def test_the_frappe_call_applies_the_configured_action_to_the_crtc_doctype(
        ctx, clock, frappe):
    ctx.settings = dataclasses.replace(ctx.settings, crtc_doctype="Canada Order",
                                       crtc_funds_action="Funds Cleared")
    paid_crtc("CA-1")
    clock.set(2026, 11, 24, 9, 0)
    await settle_crtc_orders(ctx, Transaction(ctx))
    [request] = frappe.requests
    assert request.path == "/api/method/frappe.model.workflow.apply_workflow"
    assert request.json == {"cmd": "frappe.model.workflow.apply_workflow",
                            "doc": json.dumps({"doctype": "Canada Order", "name": "CA-1"}),
                            "action": "Funds Cleared"}


@pytest.mark.gen_test
async def test_business_days_are_dated_in_the_business_time_zone(ctx, clock, frappe):
    ctx.settings = dataclasses.replace(ctx.settings, business_tz="America/Toronto")
    # Saturday 02:00 UTC is still Friday evening in Toronto.
    paid_crtc("CA-1", paid_at=datetime.datetime(2026, 11, 21, 2, 0, tzinfo=UTC))
    clock.set(2026, 11, 24, 4, 59)           # Monday 23:59 in Toronto
    assert (await settle_crtc_orders(ctx, Transaction(ctx)))["settled"] == 0
    clock.set(2026, 11, 24, 5, 0)            # Tuesday 00:00 in Toronto
    assert (await settle_crtc_orders(ctx, Transaction(ctx)))["settled"] == 1


@pytest.mark.gen_test
async def test_only_paid_unsettled_card_ach_bnpl_orders_with_a_payment_time_are_examined(
        ctx, clock, frappe):
    paid_crtc("CA-OK")
    paid_crtc("CA-CRYPTO", "crypto")
    paid_crtc("CA-NO-METHOD", None)
    paid_crtc("CA-SETTLED", funds_available=True)
    paid_crtc("CA-NO-TIME", paid_at=None)
    CrtcOrder.create(order_number="CA-PENDING", payment_method="card", paid_at=FRIDAY)
    CrtcOrder.create(order_number="CA-DISPUTED", payment_status="disputed",
                     payment_method="card", paid_at=FRIDAY)
    clock.set(2026, 12, 7, 9, 0)
    counts = await settle_crtc_orders(ctx, Transaction(ctx))
    assert advanced(frappe) == ["CA-OK"] and counts["examined"] == 1


@pytest.mark.gen_test
async def test_at_most_twenty_oldest_paid_first(ctx, clock, frappe):
    for n in range(25):
        paid_crtc(f"CA-{n:02d}", paid_at=FRIDAY - datetime.timedelta(hours=25 - n))
    clock.set(2026, 12, 7, 9, 0)
    counts = await settle_crtc_orders(ctx, Transaction(ctx))
    assert advanced(frappe) == [f"CA-{n:02d}" for n in range(20)]
    assert counts["examined"] == 20
    await settle_crtc_orders(ctx, Transaction(ctx))
    assert advanced(frappe)[20:] == [f"CA-{n:02d}" for n in range(20, 25)]


@pytest.mark.parametrize("failure", [(500, {"exc": "boom"}),
                                     (417, {"exc_type": "WorkflowTransitionError"})],
                         ids=["frappe-500", "frappe-417"])
@pytest.mark.gen_test
async def test_a_refused_order_stays_unsettled_and_the_loop_goes_on(ctx, clock, frappe, failure):
    paid_crtc("CA-1", paid_at=FRIDAY)
    paid_crtc("CA-2", paid_at=FRIDAY + datetime.timedelta(hours=1))
    frappe.responses.append(failure)
    clock.set(2026, 11, 30, 9, 0)
    counts = await settle_crtc_orders(ctx, Transaction(ctx))
    assert advanced(frappe) == ["CA-1", "CA-2"]
    assert (counts["settled"], counts["failed"]) == (1, 1)
    states = {o.order_number: o.funds_available for o in CrtcOrder.select()}
    assert states == {"CA-1": False, "CA-2": True}

    await settle_crtc_orders(ctx, Transaction(ctx))
    assert CrtcOrder.get(CrtcOrder.order_number == "CA-1").funds_available is True


@pytest.mark.gen_test
async def test_frappe_unreachable_is_a_failure_per_order_not_a_crash(ctx, clock, frappe):
    frappe.stop()
    paid_crtc("CA-1")
    paid_crtc("CA-2", paid_at=FRIDAY + datetime.timedelta(hours=1))
    clock.set(2026, 11, 30, 9, 0)
    counts = await settle_crtc_orders(ctx, Transaction(ctx))
    assert counts == {"examined": 2, "settled": 0, "not_due": 0, "failed": 2}
    assert not CrtcOrder.select().where(CrtcOrder.funds_available).exists()


@pytest.mark.gen_test
async def test_two_runs_at_once_settle_an_order_once(ctx, clock, frappe):
    paid_crtc("CA-1")
    clock.set(2026, 11, 30, 9, 0)
    frappe.delay = 0.2
    frappe.responses = [(200, {"message": {"name": "CA-1"}}), REFUSED,
                        *read_back("CA-1", "Client Selection")]
    first, second = await asyncio.gather(settle_crtc_orders(ctx, Transaction(ctx)), settle_crtc_orders(ctx, Transaction(ctx)))
    assert len(advanced(frappe)) == 2, "both runs asked before either had an answer"
    assert first["settled"] + second["settled"] == 1
    assert first["failed"] + second["failed"] == 0
    order = CrtcOrder.get()
    assert order.funds_available is True and order.funds_available_at == clock()


@pytest.mark.gen_test
async def test_a_run_after_a_settled_one_asks_frappe_nothing(ctx, clock, frappe):
    paid_crtc("CA-1")
    clock.set(2026, 11, 30, 9, 0)
    await settle_crtc_orders(ctx, Transaction(ctx))
    assert await settle_crtc_orders(ctx, Transaction(ctx)) == {"examined": 0, "settled": 0, "not_due": 0,
                                             "failed": 0}
    assert len(frappe.requests) == 1


@pytest.mark.gen_test
async def test_balance_available_settles_in_the_background(post, ctx, clock, frappe):
    paid_crtc("CA-1")
    paid_crtc("CA-ACH", "ach")
    clock.set(2026, 11, 24, 9, 0)
    answer = await deliver(post, clock, se.event("balance.available", se.balance()))
    assert answer[:2] == RECEIVED
    await ctx.drain_background()
    assert advanced(frappe) == ["CA-1"]
    assert WebhookEvent.get().status == "processed"


@pytest.mark.parametrize("state", ["Client Selection", "Incorporated"])
@pytest.mark.gen_test
async def test_an_action_applied_but_not_recorded_is_marked_settled_on_the_next_run(
        ctx, clock, frappe, state):
    # An earlier run had Frappe apply the action, then lost the write of funds_available:
    # every later run is refused with 417, and the order would hold a batch slot for good.
    paid_crtc("CA-1")
    clock.set(2026, 11, 30, 9, 0)
    frappe.responses = [REFUSED, *read_back("CA-1", state)]
    counts = await settle_crtc_orders(ctx, Transaction(ctx))
    assert (counts["settled"], counts["failed"]) == (1, 0)
    order = CrtcOrder.get()
    assert order.funds_available is True and order.funds_available_at == clock()
    read = frappe.requests[1]
    assert (read.method, read.path) == ("GET", "/api/resource/CRTC%20Order/CA-1")
    assert read.headers["Authorization"] == "token wf-key:wf-secret"
    assert read.headers["X-Frappe-Site-Name"] == "erp.example.test"


@pytest.mark.parametrize("replies", [
    read_back("CA-1", "Awaiting Funds"),
    # On the real site: an order ops had not yet moved to Awaiting Funds was taken for
    # one past it, marked settled, and never tried again.
    read_back("CA-1", "New"),
    [(404, {})],
    [(200, {"data": {"name": "CA-1"}})],
], ids=["still-awaiting", "not-yet-awaiting", "not-found", "no-state"])
@pytest.mark.gen_test
async def test_a_refused_order_not_shown_past_the_action_stays_unsettled(ctx, clock, frappe,
                                                                         replies):
    paid_crtc("CA-1")
    clock.set(2026, 11, 30, 9, 0)
    frappe.responses = [REFUSED, *replies]
    frappe.fail_with(404, {})
    counts = await settle_crtc_orders(ctx, Transaction(ctx))
    assert (counts["settled"], counts["failed"]) == (0, 1)
    order = CrtcOrder.get()
    assert order.funds_available is False
    assert (order.funds_refusals, order.funds_refused_at) == (1, clock())


@pytest.mark.gen_test
async def test_a_refusal_the_workflow_could_not_be_read_for_is_not_counted(ctx, clock, frappe):
    """The real site without the Workflow read permission: an action applied already,
    refused again (417), could not be read back, and settlement counted a refusal of the
    order for what was our user's permission."""
    paid_crtc("CA-1")
    clock.set(2026, 11, 30, 9, 0)
    frappe.responses = [REFUSED, document("CA-1", "Client Selection"), (403, {
        "exception": "frappe.exceptions.PermissionError", "exc_type": "PermissionError"})]
    frappe.fail_with(404, {})
    counts = await settle_crtc_orders(ctx, Transaction(ctx))
    assert (counts["settled"], counts["failed"]) == (0, 1)
    order = CrtcOrder.get()
    assert order.funds_available is False
    assert (order.funds_refusals, order.funds_refused_at) == (0, None)


def refused_numbers(number_of_orders):
    return [f"CA-{n:02d}" for n in range(number_of_orders)]


@pytest.mark.gen_test
async def test_orders_frappe_refuses_for_good_do_not_starve_newer_ones(ctx, clock, frappe):
    # Twenty orders Frappe refuses on every run (their documents were never moved to
    # Awaiting Funds), all paid before a twenty-first it accepts.
    for n in range(20):
        paid_crtc(f"CA-{n:02d}", paid_at=FRIDAY - datetime.timedelta(hours=25 - n))
    paid_crtc("CA-NEW", paid_at=FRIDAY)
    frappe.fail_with(*REFUSED)
    clock.set(2026, 12, 7, 9, 0)
    first = await settle_crtc_orders(ctx, Transaction(ctx))
    assert advanced(frappe) == refused_numbers(20)
    assert (first["examined"], first["failed"]) == (20, 20)

    frappe.requests.clear()
    frappe.responses = [(200, {"message": {"name": "CA-NEW"}})]
    clock.advance(hours=1)
    second = await settle_crtc_orders(ctx, Transaction(ctx))
    assert advanced(frappe) == ["CA-NEW", *refused_numbers(19)]
    assert (second["examined"], second["settled"]) == (20, 1)
    assert CrtcOrder.get(CrtcOrder.order_number == "CA-NEW").funds_available is True

    # The one left out last time comes first now: every refused order keeps its turn.
    frappe.requests.clear()
    clock.advance(hours=1)
    await settle_crtc_orders(ctx, Transaction(ctx))
    assert advanced(frappe) == ["CA-19", *refused_numbers(19)]


@pytest.mark.gen_test
async def test_the_administrator_is_told_once_about_an_order_refused_n_times(
        ctx, clock, frappe):
    ctx.settings = dataclasses.replace(ctx.settings, settlement_refusals_before_alert=3)
    paid_crtc("CA-1", order_name="CRTC-0001")
    frappe.fail_with(*REFUSED)
    clock.set(2026, 11, 30, 9, 0)

    def notices():
        return list(Outbox.select().where(Outbox.kind == "email"))
    for _ in range(2):
        await settle_crtc_orders(ctx, Transaction(ctx))
        clock.advance(hours=1)
    assert notices() == []
    for _ in range(3):
        await settle_crtc_orders(ctx, Transaction(ctx))
        clock.advance(hours=1)
    [notice] = notices()
    mail = json.loads(notice.payload)
    assert mail["to"] == ["admin@example.test"]
    assert mail["subject"] == "CRTC order CA-1: Frappe refused settlement 3 times"
    assert "CRTC Order CRTC-0001" in mail["text"] and "HTTP 417" in mail["text"]
    assert CrtcOrder.get().funds_refusals == 5


@pytest.mark.parametrize("failure", [(401, {"exc_type": "AuthenticationError"}),
                                     (403, {"exc_type": "PermissionError"}),
                                     (500, {"exc_type": "ImportError"})],
                         ids=["401", "403", "500"])
@pytest.mark.gen_test
async def test_a_failure_that_is_not_about_the_order_is_not_counted_as_its_refusal(
        ctx, clock, frappe, failure):
    paid_crtc("CA-1")
    frappe.fail_with(*failure)
    clock.set(2026, 11, 30, 9, 0)
    assert (await settle_crtc_orders(ctx, Transaction(ctx)))["failed"] == 1
    order = CrtcOrder.get()
    assert (order.funds_refusals, order.funds_refused_at) == (0, None)
