"""One payment's Stripe facts, whatever the world does with them, give the order its facts
alone give (BEHAVIOUR.md 3.3, 4.2): hypothesis draws which facts happened (an earlier
attempt declined, the intent's success, a dispute created, updated and closed, a second
close with the other outcome, a refund), a delivery order of their events, copies of
them (one delivered again late, some told again in a new Event object), when the shop's order arrives (before any of them, or
after some: a fact before its order), some sent while the database is down (spooled, the
spool drained at any point), and a Stripe stand-in that does not know the
payment's order (the intent has no metadata there); each event is sent signed through
the webhook. The final order (payment status, dispute, refund, paid_at, failed_at, the
session reference) is checked against a model computed from the facts alone, nothing is
left waiting or failed, and the administrator is told of the dispute once, on the
order, never on order "unknown"."""
import contextlib
import dataclasses
import datetime
import itertools

from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from models import UTC, ORDER_MODELS, WebhookEvent
from domain import intake
from engine import inbox
from tests import stripe_events as se
from tests.service_process import database_down
from tests.stripe_api import stripe_api  # noqa: F401 (fixture)
from tests.stripe_events import RECEIVED, deliver, settings  # noqa: F401 (fixture)

DECLINED, PAID = 1795683540, 1795683600
DISPUTED, UPDATED, CLOSED, REFUNDED = (PAID + 86400, PAID + 2 * 86400, PAID + 20 * 86400,
                                       PAID + 25 * 86400)
AMOUNT = 49900
HANDLED_AT = datetime.datetime(2026, 12, 30, 9, 0, tzinfo=UTC)
FACTS = ("failed", "succeeded", "disputed", "updated", "closed", "closed_other", "refunded")

_example = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class World:
    subscription: bool
    stripe_knows: bool
    facts: frozenset[str]
    outcome: str
    refunded: int
    ordering: tuple[str, ...]
    copies: frozenset[str]
    late_copy: str | None
    # Told again late in a new Event object (a new id): the same fact, whatever its type.
    resent: frozenset[str]
    order_after: int
    # The deliveries (by place) sent while the database is down: spooled, then drained
    # before the deliveries at `drained_before` and at the end.
    down: frozenset[int]
    drained_before: frozenset[int]


@st.composite
def worlds(draw):
    subscription = draw(st.booleans())
    possible = [f for f in FACTS if not (subscription and f in ("failed", "succeeded"))]
    facts = set(draw(st.sets(st.sampled_from(possible))))
    if "closed" not in facts:
        facts.discard("closed_other")
    events = ["checkout", *sorted(facts)]
    ordering = tuple(draw(st.permutations(events)))
    return World(
        subscription=subscription,
        # A subscription's order is found through its invoice, which Stripe knows.
        stripe_knows=subscription or draw(st.booleans()),
        facts=frozenset(facts), outcome=draw(st.sampled_from(["won", "lost"])),
        refunded=draw(st.sampled_from([10000, AMOUNT])), ordering=ordering,
        copies=frozenset(draw(st.sets(st.sampled_from(events)))),
        late_copy=draw(st.none() | st.sampled_from(events)),
        resent=frozenset(draw(st.sets(st.sampled_from(events), max_size=2))),
        order_after=draw(st.integers(0, len(events))),
        down=frozenset(draw(st.sets(st.integers(0, 2 * len(events)), max_size=4))),
        drained_before=frozenset(draw(st.sets(st.integers(0, 2 * len(events)), max_size=2))))


def model(world):
    """The order the facts alone give: (payment_status, dispute_status, refunded_amount,
    payment_failed_at)."""
    dispute = None
    if "closed" in world.facts:
        dispute = world.outcome  # Stripe's dispute as it is now, whatever the copies said
    elif "updated" in world.facts:
        dispute = "under_review"
    elif "disputed" in world.facts:
        dispute = "needs_response"
    refunded = world.refunded if "refunded" in world.facts else None
    if dispute == "lost":
        status = "dispute_lost"
    elif dispute in ("needs_response", "under_review"):
        status = "disputed"
    elif refunded == AMOUNT:
        status = "refunded"
    else:
        status = "paid"
    failed_at = (datetime.datetime.fromtimestamp(DECLINED, UTC)
                 if "failed" in world.facts else None)
    return status, dispute, refunded, failed_at


def stripe_events(world, n, stripe_api):
    """The events of payment `n` as Stripe sends them, by fact; Stripe's API told what
    it knows of them."""
    kind, number = ("compliance", f"CO-Q{n}") if world.subscription else ("canada_crtc",
                                                                           f"CA-Q{n}")
    intent, session, subscription = f"pi_test_q{n}", f"cs_test_q{n}", f"sub_test_q{n}"
    dispute_id, charge_id = f"dp_test_q{n}", f"ch_test_q{n}"
    if world.subscription:
        checkout = se.checkout_session(number, kind, mode="subscription", payment_intent=None,
                                       subscription=subscription, session_id=session)
        stripe_api.invoice_paid_by(se.invoice(subscription, invoice_id=f"in_test_q{n}",
                                              billing_reason="subscription_create"), intent)
    else:
        checkout = se.checkout_session(number, kind, payment_intent=intent,
                                       session_id=session)
        if world.stripe_knows:
            stripe_api.charged(se.payment_intent(number, kind, intent_id=intent), "card")
    stripe_api.disputes[dispute_id] = se.dispute(intent, amount=AMOUNT, dispute_id=dispute_id,
                                                 charge_id=charge_id, status=world.outcome)
    other = "lost" if world.outcome == "won" else "won"

    def dispute(status):
        return se.dispute(intent, amount=AMOUNT, dispute_id=dispute_id, charge_id=charge_id,
                          status=status)
    built = {
        "checkout": ("checkout.session.completed", checkout, PAID),
        "failed": ("payment_intent.payment_failed", se.payment_intent(
            number, kind, intent_id=intent, status="requires_payment_method",
            last_payment_error=se.card_declined()), DECLINED),
        # Named by its metadata, without the session: the reference comes from the checkout.
        "succeeded": ("payment_intent.succeeded",
                      se.payment_intent(number, kind, intent_id=intent), PAID + 5),
        "disputed": ("charge.dispute.created", dispute("needs_response"), DISPUTED),
        "updated": ("charge.dispute.updated", dispute("under_review"), UPDATED),
        "closed": ("charge.dispute.closed", dispute(world.outcome), CLOSED),
        "closed_other": ("charge.dispute.closed", dispute(other), CLOSED + 60),
        "refunded": ("charge.refunded", se.charge(intent, amount_refunded=world.refunded,
                                                  charge_id=charge_id), REFUNDED),
    }
    return kind, number, {name: se.event(event_type, obj, created=created)
                          for name, (event_type, obj, created) in built.items()}


@hypothesis_settings(max_examples=60, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])
@given(world=worlds())
def test_any_delivery_of_one_payments_facts_gives_the_order_its_facts_give(
        io_loop, post, ctx, db, clock, smtp, stripe_api, world):
    n = next(_example)

    async def run():
        clock.fixed = HANDLED_AT
        kind, number, events = stripe_events(world, n, stripe_api)
        deliveries = list(world.ordering)
        for name in world.ordering:
            if name in world.copies:  # Stripe's retry of the same event, right after
                deliveries.insert(deliveries.index(name) + 1, name)
        if world.late_copy:
            deliveries.append(world.late_copy)
        order_at = min(world.order_after, len(deliveries))
        for index, name in enumerate(deliveries):
            if index in world.drained_before:
                await inbox.drain_spool(ctx)
                await ctx.drain_background()
            if index == order_at:
                await intake.put(ctx, intake.parse(kind, number, {}), "the tests")
            with database_down(db) if index in world.down else contextlib.nullcontext():
                assert (await deliver(post, clock, events[name]))[:2] == RECEIVED
            await ctx.drain_background()
        await inbox.drain_spool(ctx)
        await ctx.drain_background()
        if order_at == len(deliveries):
            await intake.put(ctx, intake.parse(kind, number, {}), "the tests")
        for name in sorted(world.resent):
            again = {**events[name], "id": f"{events[name]['id']}_again"}
            events[f"{name} again"] = again
            assert (await deliver(post, clock, again))[:2] == RECEIVED
            await ctx.drain_background()
        for _ in range(3):  # what the order's arrival made due, and what that woke
            await inbox.retry_due(ctx)
            await ctx.drain_background()
        ids = [evt["id"] for evt in events.values()]
        left = [(row.event_type, row.status, row.last_error) for row in WebhookEvent.select()
                .where(WebhookEvent.external_id.in_(ids), WebhookEvent.status != "processed")]
        told = [message["Subject"] for _, message in smtp.messages
                if f"Q{n}" in message["Subject"] or "unknown" in message["Subject"]]
        return ORDER_MODELS[kind].get(ORDER_MODELS[kind].order_number == number), left, told

    order, left, told = io_loop.run_sync(run)
    assert left == [], world
    assert (order.payment_status, order.dispute_status, order.refunded_amount,
            order.payment_failed_at) == model(world), world
    assert (order.paid_at, order.stripe_session_id) == (
        datetime.datetime.fromtimestamp(PAID, UTC), f"cs_test_q{n}"), world
    opened = [subject for subject in told if subject.startswith("Dispute opened")]
    disputed = world.facts & {"disputed", "updated", "closed"}
    assert opened == ([f"Dispute opened on order {order.order_number}"] if disputed else []), \
        world
    assert not [subject for subject in told if "unknown" in subject], world
