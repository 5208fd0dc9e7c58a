"""docs/INTEGRATIONS.md against the code: it opens with what each sender must send, in the
names the handlers read (a Stripe Checkout Session's metadata.order_id and order_type);
it has the worker, Telegram and SMTP, each with what the service sends them, what it
expects back and how to check it, and every job the worker can receive; Frappe's naming
rule (the Workflows the service assumes) comes before the steps that rely on it."""
import os
import re

import plugins  # noqa: F401 (registers every plugin)
from domain.card_events import order_of_metadata
from domain.holdback import RELEASE_JOB
from models import ORDER_MODELS
from plugins.registry import workflow_webhooks
from tests.ops_helpers import ROOT

GUIDE = os.path.join(ROOT, "docs", "INTEGRATIONS.md")


def sections(level):
    """[(heading, text under it up to the next heading of that level or above)]."""
    with open(GUIDE, encoding="utf-8") as guide:
        text = guide.read()
    marks = [match for match in re.finditer(r"^(#{1,3}) (.+)$", text, re.MULTILINE)]
    found = []
    for index, match in enumerate(marks):
        if len(match.group(1)) != level:
            continue
        end = next((later.start() for later in marks[index + 1:]
                    if len(later.group(1)) <= level), len(text))
        found.append((match.group(2), text[match.end():end]))
    return found


def test_the_guide_opens_with_what_each_sender_must_send_as_the_code_reads_it():
    (first, text), *_ = sections(2)
    assert first == "What each sender must send"
    for name in ("metadata.order_id", "metadata.order_type", "payment_intent_data.metadata",
                 "external_id", "X-Webhook-Secret", "order_number"):
        assert name in text, name
    # The names and values the guide gives are those the card plugins read.
    session = {"object": "checkout.session", "id": "cs_1",
               "metadata": {"order_id": "CA-0001", "order_type": "canada_crtc"}}
    assert order_of_metadata(session) == ("CA-0001", "canada_crtc")
    assert order_of_metadata({**session, "metadata": {"order_id": "CA-0001"}}) is None
    for kind in ORDER_MODELS:
        assert f"`{kind}`" in text, kind


def test_the_worker_telegram_and_smtp_each_have_a_section_with_a_check():
    found = dict(sections(2))
    for heading, sends in (("4. Worker", "POST /jobs"), ("5. Telegram", "sendMessage"),
                           ("6. Mail (SMTP)", "SMTP_URL")):
        text = found[heading]
        assert sends in text and "Check it" in text and "```sh" in text, heading
    worker = found["4. Worker"]
    jobs = {plugin.job for plugin in map(workflow_webhooks.get, workflow_webhooks.keys())
            if plugin.job} | {"process_compliance_service", RELEASE_JOB}
    assert {job for job in jobs if f"`{job}`" not in worker} == set()
    assert "Idempotency-Key" in worker and "any 2xx" in worker


def test_frappes_naming_rule_comes_before_the_steps_that_rely_on_it():
    frappe = [heading for heading, _ in sections(3) if heading.startswith("1.")]
    assert frappe[0] == "1.1 The Workflows the service assumes"
    assert frappe == sorted(frappe)


def test_the_stripe_endpoint_and_the_cli_are_given_every_card_event_type_handled():
    """The endpoint's list and `stripe listen --events` name each registered type: one
    left out is never sent, and its facts never reach the service."""
    registered = set(plugins.registries()["card"].keys())
    stripe = dict(sections(2))["2. Card processor (Stripe)"]
    [listed] = re.findall(r"--events (\S+)", stripe)
    assert set(listed.split(",")) == registered
    endpoint = stripe[:stripe.index("2. Copy the endpoint")]
    named = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", endpoint))
    assert registered <= named
