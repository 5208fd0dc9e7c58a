"""One name per destination wherever the operator meets one: worker, workflow, telegram and
smtp on every console page, in the command line and in /metrics (the names of /readyz and
of the settings WORKER_URL, WORKFLOW_URL, TELEGRAM_*, SMTP_URL). The outbox's own kinds
of effect (job, workflow_action, alert, email) are shown nowhere."""
import re

import pytest

from engine import outbox
from engine.outbox import Effects
from models import Outbox
from tests.console_helpers import (  # noqa: F401 (fixtures)
    console_settings, logged_in, operator, text,
)
from tests.test_cli import run
from tests.test_ops_endpoints import samples

NAMES = {"worker", "workflow", "telegram", "smtp"}
KINDS = ("job", "workflow_action", "alert", "email")
# Where a page names a destination: a list's cell, a link's filter, the effect's facts, the
# outbox's filter.
NAMED = (re.compile(r'<span class="cell-label">Destination: </span>([^<]*)</td>'),
         re.compile(r'destination=([^&"#]*)'),
         re.compile(r'<dd id="effect-destination">([^<]*)</dd>'),
         re.compile(r'<select name="destination">(.*?)</select>', re.S))


@pytest.fixture
def settings(settings):
    return console_settings(settings)


async def one_effect_of_each_kind(ctx, worker, frappe, telegram, smtp):
    """A sent and a dead effect of every kind, for order FO-1."""
    for status, peers in (("sent", ()), ("dead", (worker, frappe, telegram))):
        for peer in peers:
            peer.fail_with(400)
        effects = Effects(ctx)

        def ask(effects=effects, status=status):
            effects.job("name_search", {"order_number": "FO-1"}, key=f"job-{status}")
            effects.workflow_action("workflow_doctype", "ORD-1", "Start Name Check",
                                    key=f"action-{status}", order_number="FO-1")
            effects.alert("FO-1 paid", key=f"alert-{status}", order_number="FO-1")
            effects.email(["admin@example.test"], "Payment failed", "email/outbox_dead",
                          key=f"mail-{status}", order_number="FO-1", title="Payment failed",
                          row=Outbox(id=1, kind="job"), attempts=1, error="x")
        await ctx.db(ask)
        await outbox.deliver(ctx, effects.rows)
        for peer in peers:
            peer.status, peer.body = 200, {"ok": True}
    Outbox.update(status="dead").where(Outbox.kind == "email", Outbox.status == "sent",
                                       Outbox.idempotency_key == "mail-dead").execute()
    # (and the administrator's mails saying that the others were given up, pending)
    assert {(row.kind, row.status) for row in Outbox.select()} >= {
        (kind, status) for kind in KINDS for status in ("sent", "dead")}


def names_on(page):
    found = []
    for pattern in NAMED[:3]:
        found += pattern.findall(page)
    for options in NAMED[3].findall(page):
        found += [name for name in re.findall(r"<option[^>]*>([^<]*)</option>", options)
                  if name != "any"]
    return found


@pytest.mark.gen_test(timeout=120)
async def test_every_page_the_command_line_and_metrics_name_a_destination_alike(
        logged_in, ctx, worker, frappe, telegram, smtp, database_url):
    await one_effect_of_each_kind(ctx, worker, frappe, telegram, smtp)
    rows = list(Outbox.select())
    paths = ["/console/", "/console/outbox", "/console/outbox?status=sent",
             "/console/orders/FO-1", *(f"/console/outbox/{row.id}" for row in rows),
             *(f"/console/outbox?status=dead&destination={name}" for name in NAMES)]
    seen = set()
    for path in paths:
        page = text(await logged_in.get(path))
        named = names_on(page)
        assert set(named) <= NAMES, (path, set(named) - NAMES)
        seen |= set(named)
        assert "kind=" not in page, path
        for kind in KINDS:
            assert not re.search(rf">\s*{kind}\s*<", page), (path, kind)
    assert seen == NAMES

    listed = run(database_url, "outbox", "list")
    assert listed.returncode == 0, listed.stderr
    header, *lines = listed.stdout.splitlines()
    column = header.split().index("DESTINATION")
    assert {line.split()[column] for line in lines} == NAMES
    only = run(database_url, "outbox", "list", "--destination", "telegram")
    assert [line.split()[column] for line in only.stdout.splitlines()[1:]] == ["telegram"] * 2
    wrong = run(database_url, "outbox", "list", "--destination", "alert")
    assert wrong.returncode == 2 and "choose from 'worker', 'workflow'" in wrong.stderr

    exposition = samples(await ctx.metrics.exposition(ctx))
    for metric in ("receiver_outbox_sends_total", "receiver_outbox_waiting",
                   "receiver_destination_up"):
        labels = [dict(found) for name, found in exposition if name == metric]
        assert {found["destination"] for found in labels} == NAMES, metric
        assert all("kind" not in found for found in labels), metric
