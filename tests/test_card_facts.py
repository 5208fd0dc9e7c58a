"""Stripe's facts, whatever order they reach us in (BEHAVIOUR.md 4.2, "Facts whose order is
not known yet"): which deliveries are one fact is each type's own declaration; a fact
whose order cannot be found yet waits with the ids that will find it, shows on the
console, is told to the administrator past CARD_FACT_WAIT_ALERT_MINUTES, and is handled
when its checkout (or its order) comes; every time kept is Stripe's; a conflict between
two facts about one object is settled by asking Stripe. End to end through the signed
webhook, events in Stripe's shapes, Stripe's API a loopback stand-in
(tests/stripe_api.py), mail read back from a real SMTP server."""
import asyncio
import dataclasses
import datetime

import pytest

import plugins
from models import (
    UTC, ComplianceOrder, ConsoleAction, CrtcOrder, FormationOrder, Outbox, SubscriptionCycle,
    WebhookEvent,
)
from domain import intake
from domain.settlement import settle_crtc_orders
from engine import inbox, outbox
from engine.transaction import Transaction
from ops import operator as ops_operator
from tests import stripe_events as se
from tests.console_helpers import (  # noqa: F401 (fixtures)
    console_settings, logged_in, notice, operator, refused, text,
)
from tests.test_cli import cli_env, run_async
from tests.stripe_api import stripe_api  # noqa: F401 (fixture)
from tests.stripe_events import RECEIVED, deliver, send  # noqa: F401 (fixtures)

# A Monday's payment, its dispute, an update of it, its close, a later look.
PAID = int(datetime.datetime(2026, 11, 23, 9, 0, tzinfo=UTC).timestamp())
DISPUTED, UPDATED, CLOSED, REOPENED = PAID + 86400, PAID + 2 * 86400, PAID + 20 * 86400, \
    PAID + 21 * 86400


def at(unix):
    return datetime.datetime.fromtimestamp(unix, UTC)


@pytest.fixture
def settings(settings):
    return dataclasses.replace(console_settings(se.with_payment_processors(settings)))


def subjects(smtp):
    return [message["Subject"] for _, message in smtp.messages]


def stored(evt_id):
    return WebhookEvent.get(WebhookEvent.external_id == evt_id)


async def subscription_paid(stripe_api, intent="pi_test_first", invoice_id="in_test_first",
                            subscription="sub_test_1"):
    """Stripe knows the first invoice of a subscription, paid by `intent` (which, as an
    invoice's intent, names no order)."""
    invoice = se.invoice(subscription, billing_reason="subscription_create",
                         invoice_id=invoice_id)
    stripe_api.invoice_paid_by(invoice, intent)
    return invoice


async def asked_since(stripe_api, asked, unless=None):
    """Wait, 10 s at most, until Stripe's stand-in is asked more than `asked` times (or
    the `unless` future is done): the test's assertions say what did not happen."""
    for _ in range(200):
        if len(stripe_api.requests) > asked or (unless is not None and unless.done()):
            return
        await asyncio.sleep(0.05)


async def waiting_dispute(send, clock, stripe_api):
    """A dispute of CO-1's subscription's first payment, come before CO-1 is linked to
    the subscription: its event, waiting."""
    clock.set(2026, 11, 24, 9, 0)
    ComplianceOrder.create(order_number="CO-1", service_name="Registered Agent")
    await subscription_paid(stripe_api)
    return await send("charge.dispute.created", se.dispute("pi_test_first",
                                                           dispute_id="dp_test_s"),
                      created=DISPUTED)


def subscription_checkout(number="CO-1", subscription="sub_test_1"):
    return se.checkout_session(number, "compliance", mode="subscription",
                               subscription=subscription, payment_intent=None,
                               session_id=f"cs_test_{number}")


# --- a fact before its order ------------------------------------------------------------

@pytest.mark.parametrize("dispute_first", [True, False], ids=["dispute first", "checkout first"])
@pytest.mark.gen_test
async def test_a_subscriptions_dispute_before_its_checkout_waits_and_is_told_on_its_order(
        send, ctx, smtp, stripe_api, dispute_first):
    """Stripe knows the dispute's intent paid the first invoice of a subscription no order
    has yet: the dispute waits for it (no mail about order "unknown"), and once the
    checkout links the subscription the order ends disputed and "Dispute opened on order
    CO-1" is sent, whichever came first."""
    ComplianceOrder.create(order_number="CO-1", service_name="Registered Agent")
    await subscription_paid(stripe_api)
    dispute = se.dispute("pi_test_first", amount=19900, dispute_id="dp_test_s",
                         charge_id="ch_test_s")
    steps = [("charge.dispute.created", dispute, DISPUTED),
             ("checkout.session.completed", subscription_checkout(), PAID)]
    for event_type, obj, created in steps if dispute_first else steps[::-1]:
        row = await send(event_type, obj, created=created)
        if dispute_first and event_type == "charge.dispute.created":
            assert row.status == "waiting"
            assert set(row.waiting_for.split()) == {
                "payment_intent:pi_test_first", "charge:ch_test_s", "invoice:in_test_first",
                "subscription:sub_test_1"}
            assert smtp.messages == []
    await ctx.drain_background()
    order = ComplianceOrder.get()
    assert (order.payment_status, order.dispute_id) == ("disputed", "dp_test_s")
    assert subjects(smtp) == ["Dispute opened on order CO-1"]
    assert WebhookEvent.get(WebhookEvent.event_type == "charge.dispute.created").status == \
        "processed"


@pytest.mark.gen_test
async def test_a_refund_before_its_checkout_is_kept_once_the_checkout_links_the_intent(
        send, ctx, smtp, stripe_api):
    """Stripe does not know the refund's intent (the stand-in's 404): it waits for it."""
    FormationOrder.create(order_number="FO-1")
    refund = se.charge("pi_test_r", amount_refunded=49900, charge_id="ch_test_r")
    assert (await send("charge.refunded", refund, created=PAID + 3600)).status == "waiting"
    await send("checkout.session.completed",
               se.checkout_session("FO-1", "formation", payment_intent="pi_test_r"),
               created=PAID)
    await ctx.drain_background()
    order = FormationOrder.get()
    assert (order.payment_status, order.refunded_amount, order.refunded_as_of) == (
        "refunded", 49900, at(PAID + 3600))
    assert f"({at(PAID + 3600).isoformat()})" in order.notes, "noted at Stripe's time"
    assert subjects(smtp) == ["Refund in full on order FO-1: $499.00"]


@pytest.mark.gen_test
async def test_a_renewal_before_its_checkout_is_dispatched_once_the_checkout_links_it(
        send, ctx, worker):
    ComplianceOrder.create(order_number="CO-1", service_slug="registered-agent")
    renewal = se.invoice("sub_test_1", invoice_id="in_test_renewal")
    assert (await send("invoice.paid", renewal)).status == "waiting"
    assert worker.requests == []
    await send("checkout.session.completed", subscription_checkout(), created=PAID)
    await ctx.drain_background()
    [job] = worker.requests
    assert (job.json["invoice_id"], job.json["recurring_cycle"]) == ("in_test_renewal", 1)
    assert SubscriptionCycle.get().order_number == "CO-1"


@pytest.mark.gen_test
async def test_a_bank_debits_success_before_its_unpaid_checkout_pays_the_order(send, ctx,
                                                                                stripe_api):
    """The intent names no order (no payment_intent_data.metadata): the unpaid checkout
    keeps the intent on the order, and the waiting success pays it, as of its own time."""
    CrtcOrder.create(order_number="CA-1")
    intent = {**se.payment_intent(None, None, intent_id="pi_test_ach",
                                  payment_method_types=("us_bank_account",)), "metadata": {}}
    assert (await send("payment_intent.succeeded", intent, created=PAID + 4 * 86400)
            ).status == "waiting"
    await send("checkout.session.completed", se.checkout_session(
        "CA-1", "canada_crtc", payment_status="unpaid", payment_intent="pi_test_ach",
        payment_method_types=("us_bank_account",), session_id="cs_test_ach"), created=PAID)
    await ctx.drain_background()
    order = CrtcOrder.get()
    assert (order.payment_status, order.paid_at, order.payment_method) == (
        "paid", at(PAID + 4 * 86400), "ach")
    assert order.stripe_session_id == "cs_test_ach"


@pytest.mark.gen_test
async def test_a_subscription_invoices_success_waits_for_nothing(send, stripe_api):
    """The first invoice's intent names no order: Stripe says it paid an invoice, whose
    own events tell of it."""
    await subscription_paid(stripe_api, intent="pi_test_inv")
    intent = {**se.payment_intent(None, None, intent_id="pi_test_inv"), "metadata": {}}
    assert (await send("payment_intent.succeeded", intent)).status == "processed"


@pytest.mark.gen_test
async def test_a_dispute_of_an_order_not_stored_yet_is_handled_when_the_order_comes(
        send, ctx, post, smtp, stripe_api):
    """Stripe names the order (the intent's metadata); the shop has not sent it yet."""
    stripe_api.charged(se.payment_intent("CA-9", "canada_crtc", intent_id="pi_test_9"), "card")
    row = await send("charge.dispute.created", se.dispute("pi_test_9"), created=DISPUTED)
    assert row.status == "waiting"
    stored_order = await intake.put(ctx, intake.parse("canada_crtc", "CA-9", {}), "the tests")
    assert stored_order.due == 1
    assert await inbox.retry_due(ctx) == 1
    assert CrtcOrder.get().payment_status == "disputed"
    assert subjects(smtp) == ["Dispute opened on order CA-9"]


@pytest.mark.gen_test
@pytest.mark.parametrize("event_type", ["checkout.session.completed",
                                        "payment_intent.succeeded"])
async def test_a_payment_naming_an_order_not_stored_yet_pays_it_when_it_comes(
        event_type, send, ctx, clock, smtp, stripe_api):
    """The customer paid before the shop sent the order: the payment waits for the
    order's number, however long (once retried to its end and given up), and pays the
    order once it is stored, as of Stripe's time."""
    if event_type == "checkout.session.completed":
        payment = se.checkout_session("FO-77", "formation", session_id="cs_test_77",
                                      payment_intent="pi_test_77")
    else:
        payment = se.payment_intent("FO-77", "formation", intent_id="pi_test_77")
    stripe_api.charged(se.payment_intent("FO-77", "formation", intent_id="pi_test_77"),
                       "card")
    row = await send(event_type, payment, created=PAID)
    assert row.status == "waiting" and "order:FO-77" in row.waiting_for.split()
    clock.advance(days=3)  # past every retry the inbox would have made
    await inbox.retry_due(ctx)  # looked at again: still waiting, the administrator told
    assert stored(row.external_id).status == "waiting"
    await outbox.send_due(ctx)
    assert [s for s in subjects(smtp) if "waits for its order" in s] == [
        f"Event #{row.id} ({event_type}) waits for its order"]

    stored_order = await intake.put(ctx, intake.parse("formation", "FO-77", {}), "the tests")
    assert stored_order.due == 1
    assert await inbox.retry_due(ctx) == 1
    order = FormationOrder.get()
    assert (order.payment_status, order.paid_at) == ("paid", at(PAID))
    assert stored(row.external_id).status == "processed"


@pytest.mark.gen_test
async def test_a_fact_that_waits_just_after_its_checkout_linked_it_is_handled_at_once(
        post, ctx, clock, smtp, stripe_api):
    """The dispute looks for its order before the checkout is committed and writes its
    wait after the checkout's wake looked for waiting facts (Stripe slow to say it does
    not know the intent): it is handed over again at once, not an hour later."""
    FormationOrder.create(order_number="FO-R")
    stripe_api.hold = asyncio.Event()
    asked = len(stripe_api.requests)
    dispute = se.event("charge.dispute.created", se.dispute("pi_test_r", dispute_id="dp_r"),
                       created=DISPUTED)
    assert (await deliver(post, clock, dispute))[:2] == RECEIVED
    await asked_since(stripe_api, asked)  # its handling, in the background, waits on Stripe
    assert len(stripe_api.requests) > asked
    checkout = se.event("checkout.session.completed", se.checkout_session(
        "FO-R", "formation", payment_intent="pi_test_r"), created=PAID)
    assert (await deliver(post, clock, checkout))[:2] == RECEIVED
    assert FormationOrder.get().payment_status == "paid"
    stripe_api.hold.set()
    await ctx.drain_background()
    await ctx.drain_background()  # and what it handed over again
    assert stored(dispute["id"]).status == "processed"
    assert FormationOrder.get().payment_status == "disputed"
    await outbox.send_due(ctx)
    assert subjects(smtp) == ["Dispute opened on order FO-R"]


# --- visible, and bounded -------------------------------------------------------------------

@pytest.mark.gen_test
async def test_a_waiting_fact_shows_on_the_console_and_is_told_once_past_the_setting(
        send, ctx, clock, smtp, stripe_api, logged_in):
    clock.set(2026, 11, 24, 9, 0)
    row = await send("charge.dispute.created", se.dispute("pi_test_lost", charge_id="ch_x"),
                     created=DISPUTED)
    page = text(await logged_in.get("/console/"))
    card = page[page.index('id="facts-waiting"'):]
    card = card[:card.index("</div></div>")]
    assert ">1</div>" in card and f'href="/console/events/{row.id}"' in card
    assert "payment_intent:pi_test_lost" in card
    event_page = text(await logged_in.get(f"/console/events/{row.id}"))
    assert 'id="event-waiting"' in event_page and "waiting for its order" in event_page

    minutes = ctx.settings.card_fact_wait_alert_minutes
    clock.advance(minutes=minutes - 1)
    await inbox.retry_due(ctx)
    await outbox.send_due(ctx)
    assert smtp.messages == []
    clock.advance(minutes=1)
    await inbox.retry_due(ctx)
    await outbox.send_due(ctx)
    assert subjects(smtp) == [f"Event #{row.id} (charge.dispute.created) waits for its order"]
    assert "payment_intent:pi_test_lost" in smtp.messages[0][1].get_body(("plain",)).get_content()
    clock.advance(minutes=minutes)
    await inbox.retry_due(ctx)
    await outbox.send_due(ctx)
    assert len(smtp.messages) == 1, "told once"
    assert WebhookEvent.get_by_id(row.id).status == "waiting"


# --- the operator's hand on a waiting fact -----------------------------------------------------

def waiting_record(event_id):
    event = WebhookEvent.get_by_id(event_id)
    return event.status, set((event.waiting_for or "").split()), event.attempts


@pytest.mark.gen_test
async def test_a_waiting_dispute_replayed_once_its_link_is_fixed_leaves_the_order_disputed(
        send, ctx, clock, smtp, stripe_api, logged_in):
    """The operator replays a waiting fact without confirming anything: while its order is
    still unknown it waits again for the same ids (its alert not sent twice); once the
    operator has fixed the order's link to its subscription, the next replay handles it."""
    clock.set(2026, 11, 24, 9, 0)
    ComplianceOrder.create(order_number="CO-1", service_name="Registered Agent")
    await subscription_paid(stripe_api)
    row = await send("charge.dispute.created", se.dispute(
        "pi_test_first", amount=19900, dispute_id="dp_test_s", charge_id="ch_test_s"),
        created=DISPUTED)
    waited = waiting_record(row.id)
    assert waited[0] == "waiting"
    page = text(await logged_in.get(f"/console/events/{row.id}"))
    assert 'id="event-look-again"' in page and 'name="confirm"' not in page
    assert f'action="/console/events/{row.id}/give-up"' in page
    minutes = ctx.settings.card_fact_wait_alert_minutes
    clock.advance(minutes=minutes)
    await inbox.retry_due(ctx)
    await outbox.send_due(ctx)
    assert subjects(smtp) == [f"Event #{row.id} (charge.dispute.created) waits for its order"]

    clock.advance(minutes=5)
    _, page = await logged_in.act(f"/console/events/{row.id}/replay")
    assert not refused(page)
    assert notice(page) == (f"Event #{row.id} replayed: it is now waiting. Its order is still "
                            "not known: it waits again for the ids below, and is handled as "
                            "soon as one of them is linked to an order.")
    assert waiting_record(row.id) == waited
    assert WebhookEvent.get_by_id(row.id).next_attempt_at == clock() + datetime.timedelta(
        minutes=minutes)
    await outbox.send_due(ctx)
    assert len(smtp.messages) == 1 and Outbox.select().count() == 1, "its alert not twice"

    # The operator links the subscription by hand: nothing wakes the fact.
    ComplianceOrder.update(stripe_subscription_id="sub_test_1").execute()
    _, page = await logged_in.act(f"/console/events/{row.id}/replay")
    assert notice(page).startswith(f"Event #{row.id} replayed: it is now processed.")
    await ctx.drain_background()
    order = ComplianceOrder.get()
    assert (order.payment_status, order.dispute_id) == ("disputed", "dp_test_s")
    assert subjects(smtp)[1:] == ["Dispute opened on order CO-1"]
    assert [(a.operator, a.action, a.outcome) for a in ConsoleAction.select().where(
        ConsoleAction.action == "replay event").order_by(ConsoleAction.id)] == [
        ("Dana", "replay event", "waiting"), ("Dana", "replay event", "processed")]
    # Handled, it is a processed event like any: replayed again only when confirmed.
    _, page = await logged_in.act(f"/console/events/{row.id}/replay")
    assert refused(page) and "it was handled already (processed)" in notice(page)


@pytest.mark.gen_test(timeout=60)
async def test_a_waiting_fact_being_replayed_is_left_to_that_replay(
        send, ctx, clock, smtp, stripe_api, logged_in):
    """The replay claims the fact as the inbox retry claims one: a retry that runs while
    the replay waits on Stripe passes it over (it came long ago, and would otherwise be
    due at once), and the fact is handled once."""
    row = await waiting_dispute(send, clock, stripe_api)
    assert row.status == "waiting"
    clock.advance(minutes=10)
    ComplianceOrder.update(stripe_subscription_id="sub_test_1").execute()
    asked_before = len(stripe_api.requests)
    stripe_api.hold = asyncio.Event()
    replay = asyncio.ensure_future(logged_in.act(f"/console/events/{row.id}/replay"))
    await asked_since(stripe_api, asked_before, unless=replay)
    assert not replay.done(), "the replay waits on Stripe"
    assert ops_operator.in_flight(ctx, WebhookEvent.get_by_id(row.id))
    assert await asyncio.wait_for(inbox.retry_due(ctx), 10) == 0
    stripe_api.hold.set()
    _, page = await replay
    assert notice(page).startswith(f"Event #{row.id} replayed: it is now processed.")
    await ctx.drain_background()
    assert ComplianceOrder.get().payment_status == "disputed"
    assert subjects(smtp) == ["Dispute opened on order CO-1"]


@pytest.mark.gen_test
async def test_a_waiting_fact_given_up_stays_dead_when_its_order_comes(
        send, ctx, clock, smtp, stripe_api, logged_in):
    row = await waiting_dispute(send, clock, stripe_api)
    assert (await logged_in.post(f"/console/events/{row.id}/give-up")).code == 400
    _, page = await logged_in.act(f"/console/events/{row.id}/give-up",
                                  {"reason": "a test-mode dispute"})
    assert notice(page) == (f"Event #{row.id} given up, with your reason: it is dead and "
                            "final, and its order's arrival no longer handles it (a forced "
                            "replay would).")
    event = WebhookEvent.get_by_id(row.id)
    assert (event.status, event.given_up_by, event.given_up_at, event.given_up_reason,
            event.next_attempt_at) == ("dead", "Dana", clock(), "a test-mode dispute", None)
    assert f'action="/console/events/{row.id}/give-up"' not in text(page)
    assert [(a.action, a.target, a.outcome) for a in ConsoleAction.select().where(
        ConsoleAction.action == "give up event")] == [
        ("give up event", str(row.id), "a test-mode dispute")]

    await send("checkout.session.completed", subscription_checkout(), created=PAID)
    await ctx.drain_background()
    clock.advance(minutes=2 * ctx.settings.card_fact_wait_alert_minutes)
    assert await inbox.retry_due(ctx) == 0
    await outbox.send_due(ctx)
    assert WebhookEvent.get_by_id(row.id).status == "dead"
    assert ComplianceOrder.get().payment_status == "paid" and smtp.messages == []
    _, page = await logged_in.act(f"/console/events/{row.id}/replay")
    assert refused(page) and "it was given up by Dana" in notice(page)
    _, page = await logged_in.act(f"/console/events/{row.id}/give-up", {"reason": "again"})
    assert refused(page) and "was given up already, by Dana" in notice(page)


def renewal(subscription, invoice_id):
    return se.invoice(subscription, invoice_id=invoice_id)


@pytest.mark.gen_test
async def test_the_waiting_list_is_filtered_and_looked_at_again_or_given_up_at_once(
        send, ctx, clock, worker, logged_in):
    clock.set(2026, 11, 24, 9, 0)
    ComplianceOrder.create(order_number="CO-1", service_slug="registered-agent")
    first = await send("invoice.paid", renewal("sub_test_1", "in_test_r1"))
    second = await send("invoice.paid", renewal("sub_test_2", "in_test_r2"))
    done = await send("invoice.paid", {**renewal("sub_test_3", "in_test_r3"),
                                       "billing_reason": "subscription_create"})
    assert {first.status, second.status, done.status} == {"waiting", "processed"}
    overview = text(await logged_in.get("/console/"))
    assert 'href="/console/events?status=waiting" id="facts-waiting-list"' in overview

    page = text(await logged_in.get("/console/events?status=waiting"))
    assert "<strong>2</strong> fact(s) waiting for their order" in page
    assert "Look again at 2</button>" in page and "Give up 2</button>" in page
    # An id a fact waits for finds it (any kind: here a subscription's).
    page = text(await logged_in.get("/console/events?status=waiting&q=sub_test_2"))
    assert "<strong>1</strong> fact(s) waiting" in page
    assert f'href="/console/events/{second.id}"' in page
    assert f'href="/console/events/{first.id}"' not in page
    page = text(await logged_in.get("/console/events?q=sub_test"))
    assert "No events." in page, "a whole id, not a part of one"

    ComplianceOrder.update(stripe_subscription_id="sub_test_1").execute()
    response, page = await logged_in.act("/console/events/retry", {"status": "waiting"})
    assert response.headers["Location"] == "/console/events?status=waiting"
    assert notice(page).startswith("2 waiting fact(s) looked for again, due now")
    assert {WebhookEvent.get_by_id(e.id).status for e in (first, second)} == {"received"}
    assert await inbox.retry_due(ctx) == 2
    assert WebhookEvent.get_by_id(first.id).status == "processed"
    assert waiting_record(second.id) == ("waiting", {"subscription:sub_test_2"}, 0)
    await outbox.send_due(ctx)
    assert [job.json["invoice_id"] for job in worker.requests] == ["in_test_r1"]

    response, page = await logged_in.act("/console/events/give-up", {
        "status": "waiting", "q": "sub_test_2", "reason": "order deleted in the shop"})
    assert response.headers["Location"] == "/console/events?status=waiting&q=sub_test_2"
    assert notice(page).startswith("1 waiting fact(s) given up, with your reason")
    event = WebhookEvent.get_by_id(second.id)
    assert (event.status, event.given_up_by, event.given_up_reason) == (
        "dead", "Dana", "order deleted in the shop")
    for action in ("/console/events/retry", "/console/events/give-up"):
        _, page = await logged_in.act(action, {"status": "waiting", "reason": "x"})
        assert refused(page) and notice(page).startswith("No fact"), action
    assert sorted((a.action, a.target) for a in ConsoleAction.select().where(
        ConsoleAction.action.in_(["retry event", "give up event"]))) == sorted([
            ("retry event", str(first.id)), ("retry event", str(second.id)),
            ("give up event", str(second.id))])


@pytest.mark.gen_test(timeout=60)
async def test_the_command_line_replays_and_gives_up_a_waiting_fact(
        send, ctx, settings, database_url, worker):
    ComplianceOrder.create(order_number="CO-1", service_slug="registered-agent")
    row = await send("invoice.paid", renewal("sub_test_1", "in_test_r1"))
    lost = await send("invoice.paid", renewal("sub_test_9", "in_test_r9"))
    env = cli_env(database_url, settings)
    shown = await run_async(env, "events", "show", str(row.id))
    assert "waiting for:  subscription:sub_test_1\n" in shown.stdout

    again = await run_async(env, "events", "replay", str(row.id))
    assert (again.returncode, again.stdout) == (1, (
        f"event #{row.id}: waiting (its order is still not known: it waits again for "
        "subscription:sub_test_1, and is handled as soon as one of them is linked to an "
        "order)\n"))
    assert waiting_record(row.id) == ("waiting", {"subscription:sub_test_1"}, 0)
    assert worker.requests == [] and Outbox.select().count() == 0

    ComplianceOrder.update(stripe_subscription_id="sub_test_1").execute()
    handled = await run_async(env, "events", "replay", str(row.id))
    assert (handled.returncode, handled.stdout) == (0, f"event #{row.id}: processed\n")
    assert [job.json["invoice_id"] for job in worker.requests] == ["in_test_r1"]

    given_up = await run_async(env, "events", "give-up", str(lost.id), "--reason",
                               "order deleted in the shop")
    assert (given_up.returncode, given_up.stdout) == (
        0, f"event #{lost.id} given up: dead and final\n")
    event = WebhookEvent.get_by_id(lost.id)
    assert (event.status, event.given_up_reason) == ("dead", "order deleted in the shop")
    assert event.given_up_by.endswith("(command line)")
    refused_replay = await run_async(env, "events", "replay", str(lost.id))
    assert refused_replay.returncode == 1 and "add --force" in refused_replay.stderr
    assert WebhookEvent.get_by_id(lost.id).status == "dead"


# --- what "the same" is, type by type ---------------------------------------------------------

def test_every_registered_card_type_declares_its_placement():
    registry = plugins.registries()["card"]
    for event_type in registry.keys():
        assert registry.placement(event_type) is not None, event_type
    assert registry.in_background("charge.dispute.updated")
    assert not registry.in_background("checkout.session.completed")


@pytest.mark.gen_test
async def test_a_second_failed_attempt_of_one_intent_is_a_fact_of_its_own(send, smtp):
    FormationOrder.create(order_number="FO-1")
    for created, message in ((PAID, "Your card was declined."), (PAID + 600, "Do not honor.")):
        await send("payment_intent.payment_failed", se.payment_intent(
            "FO-1", "formation", intent_id="pi_test_twice", status="requires_payment_method",
            last_payment_error=se.card_declined(message)), created=created)
    order = FormationOrder.get()
    assert (order.payment_status, order.payment_failed_at) == ("failed", at(PAID + 600))
    assert order.notes.count("Payment failed") == 2 and "Do not honor." in order.notes
    assert subjects(smtp) == ["Payment failed for order FO-1"] * 2


@pytest.mark.gen_test
async def test_every_dispute_update_is_a_fact_of_its_own(send, stripe_api):
    CrtcOrder.create(order_number="CA-1", payment_status="paid",
                     stripe_payment_intent_id="pi_test_u")
    await send("charge.dispute.created", se.dispute("pi_test_u", dispute_id="dp_test_u",
                                                    status="warning_needs_response"),
               created=DISPUTED)
    for status, created in (("warning_under_review", UPDATED),
                            ("needs_response", UPDATED + 3600)):
        row = await send("charge.dispute.updated", se.dispute(
            "pi_test_u", dispute_id="dp_test_u", status=status), created=created)
        assert row.status == "processed"
    order = CrtcOrder.get()
    assert (order.dispute_status, order.dispute_as_of) == ("needs_response", at(UPDATED + 3600))
    assert order.notes.count("Dispute updated") == 2


# --- a conflict asks Stripe ---------------------------------------------------------------------

@pytest.mark.parametrize("first", ["won", "lost"])
@pytest.mark.gen_test
async def test_two_closes_with_different_outcomes_are_settled_by_stripe(
        send, stripe_api, smtp, first):
    """Whichever came first, the dispute as Stripe has it now (won) decides."""
    CrtcOrder.create(order_number="CA-1", payment_status="paid",
                     stripe_payment_intent_id="pi_test_c")
    stripe_api.disputes["dp_test_c"] = se.dispute("pi_test_c", dispute_id="dp_test_c",
                                                  status="won")
    second = "lost" if first == "won" else "won"
    for status, created in ((first, CLOSED), (second, CLOSED + 60)):
        await send("charge.dispute.closed", se.dispute("pi_test_c", dispute_id="dp_test_c",
                                                       status=status), created=created)
    assert CrtcOrder.get().payment_status == "paid"
    assert stripe_api.asked("disputes") == ["/v1/disputes/dp_test_c"]


@pytest.mark.parametrize("now_at_stripe, status", [("needs_response", "disputed"),
                                                   ("won", "paid")])
@pytest.mark.gen_test
async def test_a_dispute_updated_after_it_closed_is_settled_by_stripe(
        send, stripe_api, now_at_stripe, status):
    """An inquiry closed and then turned into a chargeback, or a stale update: Stripe's
    dispute as it is now decides, whatever event types told the two."""
    CrtcOrder.create(order_number="CA-1", payment_status="paid",
                     stripe_payment_intent_id="pi_test_o")
    stripe_api.disputes["dp_test_o"] = se.dispute("pi_test_o", dispute_id="dp_test_o",
                                                  status=now_at_stripe)
    await send("charge.dispute.funds_reinstated", se.dispute(
        "pi_test_o", dispute_id="dp_test_o", status="won", reinstated=True), created=CLOSED)
    await send("charge.dispute.updated", se.dispute(
        "pi_test_o", dispute_id="dp_test_o", status="needs_response"), created=REOPENED)
    assert CrtcOrder.get().payment_status == status
    assert stripe_api.asked("disputes") == ["/v1/disputes/dp_test_o"]


# --- every time is Stripe's -----------------------------------------------------------------

@pytest.mark.gen_test
async def test_a_monday_payment_handled_thursday_settles_on_friday(send, ctx, clock, frappe):
    """Two business days from when Stripe took the money, not from when we heard of it."""
    clock.set(2026, 11, 26, 9, 0)  # Thursday
    CrtcOrder.create(order_number="CA-1")
    await send("checkout.session.completed", se.checkout_session("CA-1", "canada_crtc"),
               created=PAID)
    assert CrtcOrder.get().paid_at == at(PAID)
    clock.set(2026, 11, 27, 9, 0)  # Friday: two business days after Monday and more
    counts = await settle_crtc_orders(ctx, Transaction(ctx))
    assert counts["settled"] == 1


@pytest.mark.gen_test
async def test_the_reference_is_the_checkout_session_whichever_event_came_first(send):
    FormationOrder.create(order_number="FO-1")
    await send("payment_intent.succeeded",
               se.payment_intent("FO-1", "formation", intent_id="pi_test_ref"),
               created=PAID + 5)
    await send("checkout.session.completed", se.checkout_session(
        "FO-1", "formation", payment_intent="pi_test_ref", session_id="cs_test_ref"),
        created=PAID)
    order = FormationOrder.get()
    assert (order.stripe_session_id, order.stripe_payment_intent_id, order.paid_at) == (
        "cs_test_ref", "pi_test_ref", at(PAID))


@pytest.mark.gen_test
async def test_a_renewal_completing_a_pending_order_is_paid_at_the_invoices_time(send):
    ComplianceOrder.create(order_number="CO-1", stripe_subscription_id="sub_test_1")
    invoice = {**se.invoice("sub_test_1"),
               "status_transitions": {"paid_at": PAID, "finalized_at": PAID - 60}}
    await send("invoice.paid", invoice, created=PAID + 30)
    order = ComplianceOrder.get()
    assert (order.payment_status, order.paid_at) == ("paid", at(PAID))
