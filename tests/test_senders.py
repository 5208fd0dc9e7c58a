"""No sender is open by default: SENDERS says which senders a shop uses, production needs
the keys of those and of no other, and an endpoint whose key is not set refuses every
call, in every environment (the crypto callback's: tests/test_crypto_webhook.py; the
orders API's: tests/test_intake.py)."""
import dataclasses
import json

import pytest

from settings import PLACEHOLDER_WEBHOOK_SECRET, ConfigurationError, Settings

PRODUCTION = {
    "RECEIVER_ENV": "production", "WEBHOOK_SECRET": "workflow-secret-for-the-tests-0123456789", "LINK_SECRET": "link-secret-for-the-tests-0123456789abc",
    "ADMIN_EMAIL": "ops@example.com",
    "STRIPE_SECRET_KEY": "sk_live_a", "STRIPE_WEBHOOK_SECRET": "whsec_a",
    "CRYPTO_PROCESSOR_API_KEY": "k",
}
ORDERS_KEY = "0rders-api-key-of-forty-three-characters-xx"
BY_SENDER = {"workflow": {"WEBHOOK_SECRET": "workflow-secret-for-the-tests-0123456789"},
             "card": {"STRIPE_SECRET_KEY": "sk_live_a", "STRIPE_WEBHOOK_SECRET": "whsec_a"},
             "crypto": {"CRYPTO_PROCESSOR_API_KEY": "k"},
             "orders": {"ORDERS_API_KEY": ORDERS_KEY}}
ALWAYS = {"RECEIVER_ENV": "production", "LINK_SECRET": "link-secret-for-the-tests-0123456789abc", "ADMIN_EMAIL": "ops@example.com"}


def test_without_senders_the_three_of_before_are_needed_and_the_orders_api_is_not():
    settings = Settings.from_env(PRODUCTION)
    assert settings.senders == ("workflow", "card", "crypto")
    assert settings.production and not settings.orders_api_key


@pytest.mark.parametrize("used", [("workflow",), ("card",), ("crypto",), ("orders",),
                                  ("workflow", "crypto"), ("crypto", "orders"),
                                  ("workflow", "card", "crypto", "orders")])
def test_production_needs_the_keys_of_the_senders_in_use_and_no_other(used):
    keys = {name: value for sender in used for name, value in BY_SENDER[sender].items()}
    settings = Settings.from_env({**ALWAYS, **keys, "SENDERS": ",".join(used)})
    assert settings.production and settings.senders == used
    for sender in used:
        for name in BY_SENDER[sender]:
            missing = {key: value for key, value in keys.items() if key != name}
            with pytest.raises(ConfigurationError, match=f"not set: {name}$"):
                Settings.from_env({**ALWAYS, **missing, "SENDERS": ",".join(used)})


@pytest.mark.parametrize("value", ["", "change-me-orders-api-key", "CHANGE-ME"])
def test_production_refuses_an_unset_or_placeholder_orders_key_when_the_api_is_used(value):
    with pytest.raises(ConfigurationError, match="ORDERS_API_KEY"):
        Settings.from_env({**PRODUCTION, "SENDERS": "workflow,card,crypto,orders",
                           "ORDERS_API_KEY": value})


@pytest.mark.parametrize("value", ["change-me", "short-key"])
def test_production_refuses_a_weak_orders_key_even_with_the_api_left_out_of_senders(value):
    """Set, the key opens the orders API whatever SENDERS says (found by a review)."""
    with pytest.raises(ConfigurationError, match="too short: ORDERS_API_KEY$"):
        Settings.from_env({**PRODUCTION, "ORDERS_API_KEY": value})


SHORT = "x" * 31


@pytest.mark.parametrize("name,more", [
    ("WEBHOOK_SECRET", {}),
    ("LINK_SECRET", {}),
    ("ORDERS_API_KEY", {"SENDERS": "orders,workflow,card,crypto"}),
    ("WORKFLOW_WEBHOOK_SIGNING_SECRET", {}),
])
def test_production_holds_every_secret_the_shop_makes_to_one_length(name, more):
    """One rule for the secrets the shop makes: 32 characters or more (a 5-character
    WEBHOOK_SECRET started while ORDERS_API_KEY had to be 32). The processors' keys are
    taken as issued (`k` and `whsec_a` above)."""
    with pytest.raises(ConfigurationError, match=f"32 random characters or more.*"
                                                 f"too short: {name}$"):
        Settings.from_env({**PRODUCTION, **more, name: SHORT})
    assert Settings.from_env({**PRODUCTION, **more, name: SHORT + "x"}).production


def test_a_secret_for_a_sender_left_out_is_not_held_to_it():
    assert Settings.from_env({**ALWAYS, **BY_SENDER["card"], "SENDERS": "card",
                              "WEBHOOK_SECRET": "short"}).production


@pytest.mark.parametrize("value", ["change-me-shkeeper-key", "Change-Me"])
def test_production_refuses_a_placeholder_crypto_key(value):
    with pytest.raises(ConfigurationError, match="not set: CRYPTO_PROCESSOR_API_KEY$"):
        Settings.from_env({**PRODUCTION, "CRYPTO_PROCESSOR_API_KEY": value})


def test_an_unknown_sender_is_named():
    with pytest.raises(ConfigurationError, match="SENDERS names 'stripe': the senders are "
                                                 "workflow, card, crypto, orders"):
        Settings.from_env({"SENDERS": "workflow, stripe"})
    assert Settings.from_env({"SENDERS": " Crypto , orders "}).senders == ("crypto", "orders")


@pytest.fixture
def settings(settings):
    """Production, for a shop that does not use the workflow: no WEBHOOK_SECRET set."""
    return dataclasses.replace(settings, env="production", senders=("crypto",),
                               webhook_secret=PLACEHOLDER_WEBHOOK_SECRET)


SUBMITTED = {"order_name": "ORD-1", "order_number": "FO-1", "state_code": "WY",
             "entity_name": "Acme LLC"}


@pytest.mark.gen_test
async def test_in_production_the_placeholder_webhook_secret_opens_nothing(
        post, client, base_url, worker):
    """The placeholder is in the source for all to read: where no WEBHOOK_SECRET is set in
    production, the workflow webhooks and the referral details stay closed."""
    auth = {"X-Webhook-Secret": PLACEHOLDER_WEBHOOK_SECRET}
    status, reply, _ = await post("/api/v1/webhooks/formation/submitted", SUBMITTED, auth)
    assert (status, reply) == (401, {"error": "Unauthorized"})
    referral = await client.fetch(base_url + "/api/v1/referral/pat@example.com", headers=auth)
    assert (referral.code, json.loads(referral.body)) == (401, {"error": "Unauthorized"})
    assert worker.requests == []
