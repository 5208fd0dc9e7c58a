"""Statements per webhook, counted (bench/statements.py): on PostgreSQL each is a round
trip the loop waits on. The counts are deterministic, so each receiver's is held to an
upper bound here; a change that adds a statement to a webhook's path fails this file."""
import dataclasses
import datetime

import pytest

from bench.statements import StatementCount
from engine import outbox
from engine.outbox import Effects
from models import CrtcOrder, FormationOrder, Outbox
from tests import shkeeper
from tests import stripe_events as se
from tests.test_order_names import FRAPPE_HEADERS, frappe_body
from tests.door import through_the_door

# The statements one webhook costs today, from its request to its response (the same on
# both databases): the event's dedup read and INSERT (as processed: no UPDATE after its
# handling), the order's read, per effect an outbox INSERT (a job's or action's also says
# whether an earlier one of its order is unsent), then the UPDATE of its send outcome;
# with BEGIN and COMMIT of both transactions. A card payment (checkout.session.completed)
# costs 14, a crypto payment 11, its background handling included.
WORKFLOW_BOUNDS = {"formation/submitted": 11, "formation/ready": 9}


@pytest.mark.gen_test
@pytest.mark.parametrize("stored", [True, False], ids=["order stored", "order not stored"])
@pytest.mark.parametrize("path", sorted(WORKFLOW_BOUNDS))
async def test_a_workflow_webhook_stays_within_its_statements(path, stored, post, worker,
                                                              frappe):
    """The order's document name is read in one statement for every kind of order, so an
    order not stored here (looked for in each kind's table) costs no more."""
    if stored:
        FormationOrder.create(order_number="FO-7", order_name="FORM-7")
    body = {"order_name": "FORM-7", "order_number": "FO-7", "state_code": "DE",
            "entity_name": "Acme LLC"}
    with StatementCount().open() as count:
        status, _, _ = await post(f"/api/v1/webhooks/{path}", frappe_body(body),
                                  FRAPPE_HEADERS)
    assert status == 200
    assert count.total <= WORKFLOW_BOUNDS[path]


@pytest.mark.gen_test
@pytest.mark.parametrize("minutes_late", [0, 10], ids=["in time", "past the settle time"])
async def test_a_webhook_naming_its_change_pays_one_lookup_more_only_when_late(
        minutes_late, post, worker, frappe, clock):
    """A body with `modified` within WORKFLOW_RECONCILE_SETTLE_SECONDS (120) of its change
    costs what one without costs; a later one, one SELECT more: whether a reconciliation
    run handled its change first (domain.reconcile.handled_since)."""
    modified = clock() - datetime.timedelta(minutes=minutes_late)
    body = {"order_name": "FORM-7", "order_number": "FO-7",
            "modified": modified.strftime("%Y-%m-%d %H:%M:%S.%f")}
    with StatementCount().open() as count:
        status, _, _ = await post("/api/v1/webhooks/formation/ready", frappe_body(body),
                                  FRAPPE_HEADERS)
    assert status == 200
    assert count.total <= WORKFLOW_BOUNDS["formation/ready"] + (1 if minutes_late else 0)


@pytest.fixture
def settings(settings):
    return dataclasses.replace(settings, stripe_secret_key=se.SECRET_KEY,
                               stripe_webhook_secrets=(se.SECRET,),
                               crypto_processor_api_key=shkeeper.API_KEY)


@pytest.mark.gen_test
async def test_a_card_payment_stays_within_its_statements(post, ctx, clock, telegram):
    FormationOrder.create(order_number="FO-1")
    paid = se.event("checkout.session.completed", se.checkout_session("FO-1", "formation"))
    with StatementCount().open() as count:
        assert (await se.deliver(post, clock, paid))[:2] == se.RECEIVED
        await ctx.drain_background()
    assert FormationOrder.get().payment_status == "paid"
    assert count.total <= 14


@pytest.mark.gen_test
async def test_a_crypto_payment_stays_within_its_statements(post, ctx, telegram):
    CrtcOrder.create(order_number="CA-1001")
    with StatementCount().open() as count:
        status, _, _ = await post(shkeeper.URL, shkeeper.paid("CA-1001"), shkeeper.key_headers())
        await ctx.drain_background()
    assert status == 202 and CrtcOrder.get().payment_status == "paid"
    assert count.total <= 11


@pytest.mark.gen_test
async def test_a_drain_records_a_whole_batch_of_sends_in_one_statement(ctx, clock, worker):
    """A backlog is sent in batches of claimed rows; the rows a batch sent are marked in
    one UPDATE, not one each (each would hold the database thread, and the live
    requests' turns behind it, for a round trip)."""
    effects = Effects(ctx)
    for number in range(1, 51):
        through_the_door(effects.job, "name_search", {"order_number": f"FO-{number}"},
                         key=f"job-FO-{number}")
    clock.advance(minutes=5)  # past the lease their request held them under
    with StatementCount().open() as count:
        assert await outbox.send_due(ctx) == 50
    assert len(worker.requests) == 50
    assert Outbox.select().where(Outbox.status == "sent", Outbox.attempts == 1).count() == 50
    # Making waiting rows due, two claims (the second finds nothing left), one UPDATE
    # for the 50 outcomes: each in its transaction. One per row would be 50 and more.
    assert count.total <= 13, count.total
