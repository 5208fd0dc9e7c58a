"""An effect is named by its cause and its purpose, not by its position among the effects
its handling asks for: a handling that asks in another order (a plugin's lines moved, an
effect asked only on a retry) sends nothing twice and loses nothing, and rows stored
under the positional keys of before are still recognised (docs/DECISIONS.md, "Effects are named")."""
import hashlib

import pytest

from models import CrtcOrder, Outbox, WebhookEvent
from engine import inbox
from engine.outbox import Effects
from ops import operator
from tests.conftest import WEBHOOK_SECRET
from tests.door import through_the_door
from tests.test_inbox import card_plugin  # noqa: F401 (a fixture)

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"}
ORDER = {"order_name": "FORM-7", "order_number": "FO-7"}


def start_filing(effects):
    effects.workflow_action("workflow_doctype", "FORM-7", "Start Filing",
                            purpose="Start Filing", order_number="FO-7")


def job(action):
    def ask(effects):
        effects.job(action, {"order_number": "FO-7"}, purpose=action)
    return ask


@pytest.fixture
def asking(card_plugin):  # noqa: F811
    """A card plugin that asks for the effects in the list it returns, in its order at
    the time of each handling."""
    asks = []

    def handle(ctx, event, effects):
        for ask in list(asks):
            ask(effects)
    card_plugin("test.effects", handle)
    return asks


def positional_key(event, kind, position):
    """The key an effect had before effects were named: its position among the effects
    its handling asked for, as engine/outbox.py derived it then."""
    text = f"{event.source}|{event.dedup_key}|{kind}|{position}"
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:40]}"


def store_by_position(event):
    """Re-key the event's rows as the code before named effects wrote them, in the order
    they were asked."""
    for position, row in enumerate(Outbox.select().where(Outbox.event == event.id)
                                   .order_by(Outbox.id)):
        (Outbox.update(idempotency_key=positional_key(event, row.kind, position))
         .where(Outbox.id == row.id).execute())


def sent_jobs(worker):
    return [request.json["action"] for request in worker.requests]


@pytest.mark.gen_test
async def test_a_replay_that_asks_in_another_order_sends_nothing_twice(
        ctx, asking, worker, frappe):
    asking += [start_filing, job("file_entity")]
    event, _, outcome = await inbox.accept(ctx, "card", "test.effects", "k-order", b"{}")
    assert outcome == "processed"

    asking.reverse()  # the plugin's two lines swapped
    assert await operator.replay(ctx, event.id, force=True) == "processed"

    assert Outbox.select().count() == 2
    assert sent_jobs(worker) == ["file_entity"] and len(frappe.requests) == 1


@pytest.mark.gen_test
async def test_an_effect_asked_first_on_a_retry_is_sent_and_the_others_are_not_sent_again(
        ctx, clock, card_plugin, worker):  # noqa: F811
    runs = []

    def handle(ctx, event, effects):
        runs.append(event)
        if len(runs) > 1:
            job("name_search")(effects)  # asked only now, before the job asked the first time
        job("file_entity")(effects)
        if len(runs) == 1:
            effects.retry_later("the rest later")
    card_plugin("test.effects", handle)
    event, _, outcome = await inbox.accept(ctx, "card", "test.effects", "k-retry", b"{}")
    assert outcome == "failed"

    clock.advance(minutes=2)
    assert await inbox.retry_due(ctx) == 1

    assert sorted(sent_jobs(worker)) == ["file_entity", "name_search"]
    assert Outbox.select().where(Outbox.event == event.id).count() == 2


@pytest.mark.gen_test
async def test_a_replay_of_an_event_handled_when_keys_were_positions_sends_nothing_again(
        ctx, post, worker, frappe):
    status, _, _ = await post("/api/v1/webhooks/formation/submitted",
                              {**ORDER, "state_code": "WY", "entity_name": "Acme LLC"}, AUTH)
    assert status == 200
    [event] = WebhookEvent.select()
    store_by_position(event)

    assert await operator.replay(ctx, event.id, force=True) == "processed"

    assert Outbox.select().count() == 2
    assert sent_jobs(worker) == ["name_search"] and len(frappe.requests) == 1


@pytest.mark.gen_test
async def test_a_retry_of_an_event_handled_when_keys_were_positions_sends_nothing_again(
        ctx, clock, post, worker):
    # A delivery reported before its order exists keeps its job and is retried.
    status, _, _ = await post("/api/v1/webhooks/crtc/delivered", ORDER, AUTH)
    assert status == 200
    [row] = Outbox.select()
    store_by_position(row.event)
    CrtcOrder.create(order_number="FO-7")

    clock.advance(minutes=2)
    assert await inbox.retry_due(ctx) == 1

    assert CrtcOrder.get().delivered_at is not None
    assert Outbox.select().count() == 1 and sent_jobs(worker) == ["mark_delivered"]


@pytest.mark.gen_test
async def test_rows_stored_by_position_are_recognised_by_kind_when_the_order_changed(
        ctx, asking, worker, frappe):
    asking += [start_filing, job("file_entity")]
    event, _, _ = await inbox.accept(ctx, "card", "test.effects", "k-legacy", b"{}")
    store_by_position(event)

    asking.reverse()
    assert await operator.replay(ctx, event.id, force=True) == "processed"

    assert Outbox.select().count() == 2
    assert sent_jobs(worker) == ["file_entity"] and len(frappe.requests) == 1


def test_an_effect_without_a_key_or_a_purpose_is_refused(ctx):
    with pytest.raises(TypeError, match="needs a key, or a purpose"):
        Effects(ctx).job("deliver", {"order_number": "FO-7"}, purpose="deliver")
    event, _ = through_the_door(inbox.store, ctx, "card", "test.effects", "k-unnamed", b"{}")
    with pytest.raises(TypeError, match="needs a key, or a purpose"):
        Effects(ctx, event).alert("FO-7 paid")
    assert Outbox.select().count() == 0


@pytest.mark.gen_test
async def test_a_handling_that_asks_twice_for_one_purpose_fails_and_sends_nothing(
        ctx, asking, worker):
    asking += [job("deliver"), job("deliver")]
    event, _, outcome = await inbox.accept(ctx, "card", "test.effects", "k-twice", b"{}")

    assert outcome == "failed"
    assert "two job effects of one event for the same purpose 'deliver'" in \
        WebhookEvent.get_by_id(event.id).last_error
    assert Outbox.select().count() == 0 and worker.requests == []
