"""A real Frappe site's webhooks (tests/frappe_traces/: bodies, headers and workflow logs
recorded from a v15.54.1 site) sent to the service in any order: each try Frappe made
delivered or lost, copies, late copies, orders interleaved, Frappe's list answering or
not when a webhook comes; some sent while the database is down (spooled, answered
`queued`), the spool drained at any later point; some at the same moment as others,
handled side by side (any order of theirs is one the model allows), Frappe and the worker
taking a drawn time to answer while they are handled; a drain killed once it has stored
its calls, before it hands any over, the process restarted (its memory lost, its spool
file read again, what it stored handled by the retry once its leases are over); then the
reconciliation run Frappe's
lost webhooks leave to the service. Whatever hypothesis draws, each document's state changes are handled once each,
their jobs and workflow actions in the order of the document's saves, as a model
computed from the document's record and the deliveries alone says:

- a change whose webhook comes first is acted on, unless a later change of its document
  was handled already: then it is history (recorded, nothing sent);
- before a change of a path that follows others (`WorkflowWebhook.after`) is handled with
  none of those stored, the workflow log's earlier changes are handled first, each as a
  state its document has left (its path's rule: handled, or recorded and told), if
  Frappe's list answers;
- a webhook 5 s or more after its save (a later try, or one Frappe's queue held) has its
  document's every change handled first, as the site has them now: the current state
  acted on, each state left by its path's rule; the webhook is then a copy;
- a webhook that comes while calls wait in the spool (the database down, or back and
  the spool not drained yet) joins them, and no log is read for it; the drain stores the
  spooled changes new to the inbox and hands each document's over in the order of its
  saves, each acted on unless a later change of its document was handled: then history;
- the run finds what is left, on every document: the current state acted on, a state
  left by its path's rule, a change older than one handled as history."""
import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import json
import logging
import os
import zoneinfo

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings as hypothesis_settings, strategies as st

from domain import reconcile
from engine import inbox, outbox
from models import UTC, WebhookEvent
from plugins.workflow import HANDLED
from tests.conftest import WEBHOOK_SECRET, start_afresh
from tests.frappe_site import FrappeSite
from tests.service_process import database_down
from tests.test_reconcile import FIELDS

TRACES = os.path.join(os.path.dirname(__file__), "frappe_traces")
SIGNING_SECRET = "site-signing-secret-abcdef"  # the site's, as its README says
KOLKATA = zoneinfo.ZoneInfo("Asia/Kolkata")  # the site's time zone (time_zone.json)
# Each example costs a second or more: a failure is shown as drawn, not shrunk for minutes.
NO_SHRINKING = (Phase.explicit, Phase.reuse, Phase.generate)


def load(name):
    with open(os.path.join(TRACES, f"{name}.json"), encoding="utf-8") as trace:
        return json.load(trace)


ORDERS = {name: load(name) for name in ("FO-1001", "FO-1002", "FO-1003", "CA-2001",
                                        "CA-2002")}


# Which paths come just before each in the workflows the site was set up with
# (docs/INTEGRATIONS.md 1.1): the model's own reading of them, not the plugins'.
FOLLOWS = {"formation/name-available": ("formation/submitted",),
           "formation/filed-needs-ein": ("formation/name-available",),
           "formation/filed-skip-ein": ("formation/name-available",),
           "formation/ein-obtained": ("formation/filed-needs-ein",),
           "formation/approved": ("formation/ein-obtained", "formation/filed-skip-ein"),
           "formation/ready": ("formation/approved",),
           "crtc/funds-available": ("crtc/awaiting-funds",),
           "crtc/incorporated": ("crtc/funds-available",)}


def changes(trace):
    """The document's state changes, in the order of its saves: [(path, modified)]."""
    seen = {}
    for webhook in trace["webhooks"]:
        seen[json.loads(webhook["body"])["modified"]] = webhook["service_path"]
    return [(path, modified) for modified, path in sorted(seen.items())]


# One delivery: (order, which try of Frappe's, copies of it that reach us, whether
# Frappe's list answers while it is handled, whether the database is down when it comes,
# whether the spool is drained before it comes (or the drain KILLED once it has stored
# the calls, and the process restarted), whether it comes at the same moment as
# the delivery before it, how long Frappe and the worker take to answer while it is
# handled: its handling time).
delivery = st.tuples(st.sampled_from(sorted(ORDERS)), st.integers(min_value=0, max_value=6),
                     st.integers(min_value=1, max_value=2), st.booleans(),
                     st.sampled_from((False, False, True)),
                     st.sampled_from((False, True, False, True, "killed")),
                     st.sampled_from((False, False, True)),
                     st.sampled_from((0, 0, 0.02, 0.2)))
# At most this many deliveries come at one moment.
TOGETHER = 3
# What the model is told of a drain of the spool.
DRAIN = ("drain",)


KILLED = "killed"


async def drain_killed_and_restarted(ctx, clock):
    """A drain killed once it has stored its spool file's calls, before it hands any over
    (the moment acknowledged steps were dropped): the process's memory is lost with it,
    the restarted process drains its spool at start (the file, not deleted, read again:
    every call a duplicate) and, once the dead drain's leases are over, the retry hands
    what it stored over, each document's in the order of its saves."""
    drain = asyncio.ensure_future(inbox.drain_spool(ctx))

    class KillOnceStored(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("spool file drained"):
                drain.cancel()

    spool_log = logging.getLogger("receiver.spool")
    killer, level = KillOnceStored(), spool_log.level
    spool_log.addHandler(killer)
    spool_log.setLevel(logging.INFO)  # the line is INFO's
    try:
        await asyncio.gather(drain, return_exceptions=True)
    finally:
        spool_log.removeHandler(killer)
        spool_log.setLevel(level)
    for task in list(ctx.background_tasks):
        task.cancel()
    await asyncio.gather(*ctx.background_tasks, return_exceptions=True)
    inbox._PARKED.clear()
    inbox._CLAIMS_CUT_SHORT.clear()
    await inbox.drain_spool(ctx)
    clock.advance(seconds=ctx.settings.claim_lease_seconds + 1)
    while await inbox.retry_due(ctx):
        pass
    await ctx.drain_background()


def moments(deliveries):
    """The deliveries grouped by the moment they come: one after another, or together. Of
    deliveries that come together the first says for all of them whether the database is
    down, whether the spool is drained before, and whether Frappe's list answers; each
    reaches us once, and they take the longest handling time of theirs."""
    grouped = []
    for delivery in deliveries:
        if delivery[6] and grouped and len(grouped[-1]) < TOGETHER:
            grouped[-1].append(delivery)
        else:
            grouped.append([delivery])
    return grouped


@pytest.fixture
def site(io_loop):
    frappe = FrappeSite(FIELDS)
    yield frappe
    frappe.stop()


@pytest.fixture
def settings(settings, site):
    return dataclasses.replace(settings, workflow_url=site.url,
                               workflow_webhook_signing_secret=SIGNING_SECRET)


def put_on_site(site, trace):
    """The document and its workflow log as the site answered them after the last step."""
    doctype = trace["doctype"]
    row = dict(trace["list_row"])
    row["modified"] = datetime.datetime.fromisoformat(row["modified"])
    document = {**{field: None for field in FIELDS[doctype]}, **row}
    site.documents[doctype] = [d for d in site.documents[doctype]
                               if d["name"] != document["name"]] + [document]
    site.logs[(doctype, trace["name"])] = [
        {"name": entry["name"], "creation": entry["creation"], "content": entry["content"]}
        for entry in reversed(trace["workflow_logs"])]


def model(ctx, drawn):
    """{order: (the jobs, the workflow actions)} the deliveries should cause, in order."""
    plugins = ctx.plugins["workflow"]
    outcome = {order: {} for order in ORDERS}  # order -> {index: "act" | "left" | "history"}

    def place(order, index, how):
        later = [other for other in outcome[order] if other > index]
        outcome[order][index] = "history" if later else how

    spooled = []

    def drain():
        # Stored together, each document's changes handed over in the order of its saves.
        for order, index in sorted(set(spooled)):
            if index not in outcome[order]:
                place(order, index, "act")
        spooled.clear()

    for told in drawn:
        if told == DRAIN:
            drain()
            continue
        order, index, frappe_answers, late, joins_the_spool = told
        if joins_the_spool or spooled:
            spooled.append((order, index))
            continue
        found = outcome[order]
        path = changes(ORDERS[order])[index][0]
        after = FOLLOWS.get(path, ())
        last = len(changes(ORDERS[order])) - 1
        if late and frappe_answers:
            # Its document as the site has it now: every change, the last one current.
            for k in range(last + 1):
                if k not in found:
                    place(order, k, "act" if k == last else "left")
        if index in found or any(other > index for other in found):
            found.setdefault(index, "history")
            continue
        earlier = [k for k, (p, _) in enumerate(changes(ORDERS[order])) if p in after]
        if after and frappe_answers and not any(k in found for k in earlier):
            for k in range(index):
                if k not in found:
                    place(order, k, "left")
        place(order, index, "act")
    drain()
    for order, trace in ORDERS.items():  # the run, which finds every document
        last = len(changes(trace)) - 1
        for k in range(last + 1):
            if k not in outcome[order]:
                place(order, k, "act" if k == last else "left")
    expected = {}
    for order, found in outcome.items():
        jobs, actions = [], []
        for k, (path, _) in enumerate(changes(ORDERS[order])):
            plugin = plugins.get(path)
            how = found.get(k)
            if how == "act" or (how == "left" and plugin.left_rule == HANDLED):
                jobs += [plugin.job] if plugin.job else []
            if how == "act" and plugin.workflow_action:
                actions.append(plugin.workflow_action)
        expected[order] = (jobs, actions)
    return expected


@hypothesis_settings(max_examples=40, deadline=None, database=None, phases=NO_SHRINKING,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])
@given(deliveries=st.lists(delivery, min_size=1, max_size=14))
# A change the workflow log found first, its own webhook then spooled: the drain once
# stored it again, as a second event of the same change, and acted on it, the changes
# after it (recorded as states its document had left) not counted as handled.
@example(deliveries=[("FO-1001", 1, 1, True, False, False, False, 0),
                     ("FO-1001", 0, 1, True, True, False, False, 0)])
def test_a_real_sites_webhooks_in_any_order_give_what_its_record_says(
        deliveries, ctx, db, clock, site, worker, post, io_loop):
    start_afresh(ctx, db)
    worker.requests.clear()
    site.actions.clear()
    for trace in ORDERS.values():
        put_on_site(site, trace)
    drawn = []  # per moment, per delivery of it, what the model is told of each copy
    clock.set(2026, 12, 3, 7, 29)

    async def deliver(delivery, copies, frappe_answers, down):
        """Send one delivery (its copies one after another); what the model is told of
        each."""
        order, attempt = delivery[:2]
        trace = ORDERS[order]
        webhook = trace["webhooks"][attempt % len(trace["webhooks"])]
        modified = json.loads(webhook["body"])["modified"]
        index = [m for _, m in changes(trace)].index(modified)
        headers = {**webhook["headers"], "X-Webhook-Secret": WEBHOOK_SECRET}
        headers.pop("Host"), headers.pop("Content-Length")
        told = []
        for _ in range(copies):
            saved = datetime.datetime.fromisoformat(modified).replace(tzinfo=KOLKATA)
            late = clock() - saved >= reconcile.LATE_AFTER
            joins_the_spool = down or inbox.spool_holds_calls(ctx)
            status, reply, _ = await post(webhook["path"], webhook["body"], headers)
            assert status == 200
            if joins_the_spool:  # spooled: nothing it causes is promised yet
                assert reply == {"received": True, "action": "queued"}, reply
            told.append((order, index, frappe_answers, late, down))
        return told

    async def scenario():
        for moment in moments(deliveries):
            first = moment[0]
            frappe_answers, down, drain_first = first[3], first[4], first[5]
            if drain_first == KILLED:
                await drain_killed_and_restarted(ctx, clock)
                drawn.append([[DRAIN]])
            elif drain_first:
                await inbox.drain_spool(ctx)
                drawn.append([[DRAIN]])  # before all of the moment's deliveries
            sent_at = max(datetime.datetime.fromisoformat(
                ORDERS[d[0]]["webhooks"][d[1] % len(ORDERS[d[0]]["webhooks"])]["sent_at"])
                for d in moment).astimezone(UTC)
            clock.fixed = max(clock(), sent_at) + datetime.timedelta(milliseconds=300)
            site.down_with = None if frappe_answers else (502, "BadGateway")
            site.delay = worker.delay = max(d[7] for d in moment)
            with database_down(db) if down else contextlib.nullcontext():
                told = await asyncio.gather(*(
                    deliver(d, d[2] if len(moment) == 1 else 1, frappe_answers, down)
                    for d in moment))
            drawn.append(told)
        site.delay = worker.delay = 0
        site.down_with = None
        await inbox.drain_spool(ctx)
        clock.advance(minutes=10)
        await reconcile.reconcile_workflow(ctx)
        await ctx.drain_background()
        for _ in range(3):
            clock.advance(minutes=5)
            await outbox.send_due(ctx)
            await inbox.retry_due(ctx)
    io_loop.run_sync(scenario, timeout=120)

    # Deliveries that came together were handled in some order: any of theirs.
    possible = [model(ctx, [told for members in order for member in members
                            for told in member])
                for order in itertools.product(*(itertools.permutations(moment)
                                                 for moment in drawn))]
    outcome = {}
    for order in ORDERS:
        sent = [r.json for r in worker.posts if r.json["order_number"] == order]
        name = ORDERS[order]["name"]
        applied = [a for a in map(_action, site.actions) if a[0] == name]
        outcome[order] = ([job["action"] for job in sent],
                          [action for _, action in applied])
    assert outcome in possible, (outcome, possible[0], deliveries)
    expected = possible[0]
    assert len({r.headers["Idempotency-Key"] for r in worker.posts}) == len(worker.posts)
    # Each change stored once, whoever found it, and none left unfinished.
    assert not WebhookEvent.select().where(
        WebhookEvent.status.in_(inbox.AWAITING_HANDLING)).exists()
    for order in expected:
        stored = WebhookEvent.select().where(WebhookEvent.order_number == order).count()
        assert stored == len(changes(ORDERS[order])), (order, deliveries)


def _action(applied):
    """(document name, action) of one apply_workflow call the site took."""
    doc = applied.get("doc")
    doc = doc[0] if isinstance(doc, list) else doc
    action = applied.get("action")
    action = action[0] if isinstance(action, list) else action
    name = json.loads(doc)["name"] if isinstance(doc, str) else doc["name"]
    return name, action
