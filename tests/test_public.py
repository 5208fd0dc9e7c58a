"""The public JSON endpoints: survey, referral check and info, DOT state requirements,
and the per-client-address rate limit in front of them."""
import dataclasses
import datetime
import ipaddress
import json

import pytest

from models import (
    UTC, BundleOrder, ComplianceOrder, CrtcOrder, FormationOrder, ReferralCode, SurveyResponse,
)
from app.server import make_app
from app.context import Context
from domain import fulfillment
from domain.links import link_token, survey_token
from handlers.ratelimit import RateLimiter
from settings import ConfigurationError, Settings
from tests.conftest import WEBHOOK_SECRET
from tests.public_helpers import parsed, served
from tests.service_process import database_down

JSON = {"Content-Type": "application/json"}


# --- survey ---------------------------------------------------------------------------------

def survey(ctx, order_number, **fields):
    """A survey body carrying the order's token, as the customer's invitation gives it."""
    return {"order_number": order_number,
            "token": survey_token(ctx.settings.link_secret, order_number), **fields}


@pytest.mark.parametrize("model", [FormationOrder, ComplianceOrder, BundleOrder, CrtcOrder])
@pytest.mark.gen_test
async def test_a_survey_response_is_recorded_for_any_kind_of_order(post, ctx, model):
    model.create(order_number="ORD-1")
    status, reply, _ = await post("/api/v1/survey",
                                  survey(ctx, "ORD-1", rating=5, comment="Fast and clear."),
                                  JSON)
    assert (status, reply) == (201, {"recorded": True, "order_number": "ORD-1"})
    row = SurveyResponse.get()
    assert (row.order_number, row.rating, row.comment) == ("ORD-1", 5, "Fast and clear.")


@pytest.mark.gen_test
async def test_the_comment_is_optional(post, ctx):
    FormationOrder.create(order_number="FO-1")
    status, _, _ = await post("/api/v1/survey", survey(ctx, "FO-1", rating=1), JSON)
    assert status == 201 and SurveyResponse.get().comment == ""


@pytest.mark.gen_test
async def test_a_second_response_for_the_same_order_is_refused(post, ctx):
    FormationOrder.create(order_number="FO-1")
    first = survey(ctx, "FO-1", rating=4)
    assert (await post("/api/v1/survey", first, JSON))[0] == 201
    status, reply, _ = await post("/api/v1/survey", {**first, "rating": 1}, JSON)
    assert status == 409
    assert reply == {"error": "a survey response for this order was already recorded",
                     "field": "order_number"}
    assert SurveyResponse.get().rating == 4


@pytest.mark.gen_test
async def test_a_survey_for_an_unknown_order_is_404(post, ctx):
    status, reply, _ = await post("/api/v1/survey", survey(ctx, "FO-404", rating=3), JSON)
    assert (status, reply) == (404, {"error": "unknown order", "field": "order_number"})
    assert SurveyResponse.select().count() == 0


@pytest.mark.parametrize("order_number", ["FO-1", "FO-404"])
@pytest.mark.parametrize("token", [
    "x" * 43, "signed-for-another-order", "ifta-link-token", "tok|en"])
@pytest.mark.gen_test
async def test_without_the_orders_token_the_survey_is_403_whether_or_not_it_exists(
        post, ctx, order_number, token):
    FormationOrder.create(order_number="FO-1")
    forged = {"signed-for-another-order": survey_token(ctx.settings.link_secret, "FO-2"),
              "ifta-link-token": link_token(ctx.settings.link_secret, "ifta", order_number,
                                            "2026-Q3")}.get(token, token)
    status, reply, _ = await post("/api/v1/survey", {"order_number": order_number,
                                                     "token": forged, "rating": 1}, JSON)
    assert (status, reply) == (403, {"error": "invalid token for this order",
                                     "field": "token"})
    assert SurveyResponse.select().count() == 0


@pytest.mark.gen_test
async def test_a_padded_survey_token_is_accepted(post, ctx):
    FormationOrder.create(order_number="FO-1")
    body = survey(ctx, "FO-1", rating=5)
    status, _, _ = await post("/api/v1/survey", {**body, "token": body["token"] + "="}, JSON)
    assert status == 201


@pytest.mark.parametrize("body,field", [
    ({"rating": 3}, "order_number"),
    ({"order_number": "  ", "rating": 3}, "order_number"),
    ({"order_number": 17, "rating": 3}, "order_number"),
    ({"order_number": "F" * 101, "rating": 3}, "order_number"),
    ({"order_number": "FO-1"}, "rating"),
    ({"order_number": "FO-1", "rating": 0}, "rating"),
    ({"order_number": "FO-1", "rating": 6}, "rating"),
    ({"order_number": "FO-1", "rating": 4.5}, "rating"),
    ({"order_number": "FO-1", "rating": "5"}, "rating"),
    ({"order_number": "FO-1", "rating": True}, "rating"),
    ({"order_number": "FO-1", "rating": 5, "comment": "x" * 2001}, "comment"),
    ({"order_number": "FO-1", "rating": 5, "comment": ["a"]}, "comment"),
    ({"order_number": "FO-1", "rating": 5, "email": "a@b.c"}, "email"),
    ({"order_number": "FO-1\u0000", "rating": 5}, "order_number"),
    ({"order_number": "FO-1", "rating": 5, "comment": "a\u0000b"}, "comment"),
    ({"order_number": "FO-1", "rating": 5, "token": ""}, "token"),
    ({"order_number": "FO-1", "rating": 5, "token": 17}, "token"),
    ({"order_number": "FO-1", "rating": 5, "token": "t" * 65}, "token"),
])
@pytest.mark.gen_test
async def test_bad_survey_input_is_a_400_naming_the_field(post, ctx, body, field):
    FormationOrder.create(order_number="FO-1")
    if isinstance(body.get("order_number"), str) and "token" not in body:
        body = {**body, "token": survey_token(ctx.settings.link_secret, "FO-1")}
    status, reply, _ = await post("/api/v1/survey", body, JSON)
    assert status == 400 and reply["field"] == field and reply["error"]
    assert SurveyResponse.select().count() == 0


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", "\"text\""])
@pytest.mark.gen_test
async def test_a_body_that_is_not_a_json_object_is_400(post, raw):
    status, reply, _ = await post("/api/v1/survey", raw, JSON)
    assert (status, reply) == (400, {"error": "invalid JSON body"})


@pytest.mark.gen_test
async def test_database_down_is_503_with_retry_after(post, ctx, db):
    with database_down(db):
        status, reply, response = await post("/api/v1/survey", survey(ctx, "FO-1", rating=5),
                                             JSON)
    assert (status, reply) == (503, {"error": "temporarily unavailable"})
    assert response.headers["Retry-After"] == "30"


# --- referral check -------------------------------------------------------------------------

def referral(code="FRIEND10", owner="Pat@Example.com", **fields):
    return ReferralCode.create(code=code, owner_email=owner, percent_off=10,
                               reward_cents=2500, **fields)


@pytest.mark.gen_test
async def test_a_valid_code_says_what_it_gives(post):
    referral()
    status, reply, _ = await post("/api/v1/referral/check", {"code": " friend10 "}, JSON)
    assert (status, reply) == (200, {"code": "FRIEND10", "valid": True,
                                     "discount": {"percent_off": 10}})


@pytest.mark.gen_test
async def test_unknown_inactive_and_expired_codes_are_not_valid(post, clock):
    clock.set(2026, 11, 20, 9, 0)
    referral("OFF01", active=False)
    referral("OLD01", expires_at=datetime.datetime(2026, 11, 1, tzinfo=UTC))
    referral("LATER1", expires_at=datetime.datetime(2026, 12, 1, tzinfo=UTC))
    for code in ("NOPE99", "OFF01", "OLD01"):
        status, reply, _ = await post("/api/v1/referral/check", {"code": code}, JSON)
        assert (status, reply) == (200, {"code": code, "valid": False, "discount": None})
    assert (await post("/api/v1/referral/check", {"code": "LATER1"}, JSON))[1]["valid"]


@pytest.mark.parametrize("body", [{}, {"code": ""}, {"code": 12}, {"code": "a b"},
                                  {"code": "<x>"}, {"code": "X" * 65}])
@pytest.mark.gen_test
async def test_a_malformed_code_is_400(post, body):
    status, reply, _ = await post("/api/v1/referral/check", body, JSON)
    assert status == 400 and reply["field"] == "code"


# --- referral info ----------------------------------------------------------------------------

@pytest.mark.gen_test
async def test_with_the_shared_secret_the_referral_info_is_complete(http_server, base_url,
                                                                   client, clock):
    clock.set(2026, 11, 20, 9, 0)
    referral("FRIEND10")
    referral("SPRING5", expires_at=datetime.datetime(2026, 3, 1, tzinfo=UTC))
    referral("OTHER1", owner="someone@else.com")
    ComplianceOrder.create(order_number="CO-1", discount_code="friend10",
                           payment_status="paid")
    CrtcOrder.create(order_number="CA-1", discount_code="FRIEND10", payment_status="paid")
    FormationOrder.create(order_number="FO-1", discount_code="FRIEND10")
    response = await client.fetch(base_url + "/api/v1/referral/pat%40example.com",
                                  headers={"X-Webhook-Secret": WEBHOOK_SECRET})
    assert response.code == 200
    assert parsed(response) == {"email": "pat@example.com", "detail": None, "codes": [
        {"code": "FRIEND10", "valid": True, "percent_off": 10, "paid_referrals": 2,
         "reward_cents_per_referral": 2500, "reward_earned_cents": 5000},
        {"code": "SPRING5", "valid": False, "percent_off": 10, "paid_referrals": 0,
         "reward_cents_per_referral": 2500, "reward_earned_cents": 0},
    ]}


@pytest.mark.gen_test
async def test_without_the_secret_nothing_tells_whether_an_email_is_known(
        http_server, base_url, client):
    referral("FRIEND10")
    known = await client.fetch(base_url + "/api/v1/referral/pat@example.com")
    unknown = await client.fetch(base_url + "/api/v1/referral/nobody@example.com")
    assert known.code == unknown.code == 200
    assert known.body == unknown.body
    assert parsed(known) == {"email": None, "codes": None, "detail":
                             "referral details are given to authenticated callers only"}


@pytest.mark.gen_test
async def test_a_wrong_secret_is_401_whatever_the_email(http_server, base_url, client):
    referral("FRIEND10")
    for email in ("pat@example.com", "nobody@example.com"):
        response = await client.fetch(base_url + f"/api/v1/referral/{email}",
                                      headers={"X-Webhook-Secret": "guess"})
        assert (response.code, parsed(response)) == (401, {"error": "Unauthorized"})


@pytest.mark.parametrize("email", ["not-an-email", "a@b", "a%20b@c.com", "x" * 250 + "@e.com",
                                   "a%00b@c.com", "a@b%01.com"])
@pytest.mark.gen_test
async def test_a_malformed_email_is_400(http_server, base_url, client, email):
    response = await client.fetch(base_url + f"/api/v1/referral/{email}",
                                  headers={"X-Webhook-Secret": WEBHOOK_SECRET})
    assert response.code == 400 and parsed(response)["field"] == "email"


# --- DOT state requirements ---------------------------------------------------------------------

@pytest.mark.gen_test
async def test_every_state_is_listed_and_every_value_cites_a_source(http_server, base_url,
                                                                    client):
    response = await client.fetch(base_url + "/api/v1/dot/state-requirements")
    assert response.code == 200
    states = parsed(response)["states"]
    assert len(states) == 51 and [s["code"] for s in states] == sorted(s["code"] for s in states)
    for state in states:
        for name, fact in state.items():
            if name in ("code", "name"):
                continue
            if fact["value"] == "unknown":
                assert fact["source"] is None
            else:
                assert isinstance(fact["value"], bool)
                assert fact["source"].startswith(("https://", "http://")), (state["code"], name)


@pytest.mark.gen_test
async def test_one_state_is_given_by_its_code(http_server, base_url, client):
    response = await client.fetch(base_url + "/api/v1/dot/state-requirements?state=or")
    [oregon] = parsed(response)["states"]
    assert oregon["code"] == "OR" and oregon["name"] == "Oregon"
    assert oregon["weight_distance_tax"]["value"] is True
    assert oregon["ucr_participating"]["value"] is False
    assert oregon["ifta_member"]["value"] is True
    [alaska] = parsed(await client.fetch(
        base_url + "/api/v1/dot/state-requirements?state=AK"))["states"]
    assert alaska["ifta_member"]["value"] is False


@pytest.mark.parametrize("state", ["ZZ", "", "Texas", "T"])
@pytest.mark.gen_test
async def test_an_unknown_state_code_is_400(http_server, base_url, client, state):
    response = await client.fetch(base_url + f"/api/v1/dot/state-requirements?state={state}")
    assert response.code == 400
    assert parsed(response) == {"error": "state must be a two-letter US state code",
                                "field": "state"}


# --- rate limit ----------------------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_limiter_allows_the_limit_then_says_how_long_to_wait():
    clock = FakeClock()
    limiter = RateLimiter(3, 60, clock=clock)
    assert [limiter.acquire("10.0.0.1") for _ in range(3)] == [0, 0, 0]
    assert limiter.acquire("10.0.0.1") == 20
    assert limiter.acquire("10.0.0.2") == 0
    clock.now += 19
    assert limiter.acquire("10.0.0.1") == 1
    clock.now += 1
    assert limiter.acquire("10.0.0.1") == 0


def test_a_limit_of_zero_turns_the_limiter_off():
    limiter = RateLimiter(0, 60)
    assert all(limiter.acquire("10.0.0.1") == 0 for _ in range(100))


def test_full_buckets_are_forgotten_when_many_addresses_were_seen(monkeypatch):
    import handlers.ratelimit
    monkeypatch.setattr(handlers.ratelimit, "PRUNE_ABOVE", 5)
    clock = FakeClock()
    limiter = RateLimiter(2, 60, clock=clock)
    for n in range(6):
        limiter.acquire(f"10.0.0.{n}")
    clock.now += 60
    limiter.acquire("10.0.1.1")
    assert list(limiter.buckets) == ["10.0.1.1"]


def test_the_limit_is_configured_from_the_environment():
    s = Settings.from_env({"PUBLIC_RATE_LIMIT": "5", "PUBLIC_RATE_WINDOW_SECONDS": "10"})
    assert (s.public_rate_limit, s.public_rate_window_seconds) == (5, 10)
    assert (Settings().public_rate_limit, Settings().public_rate_window_seconds) == (30, 60)
    with pytest.raises(ConfigurationError, match="PUBLIC_RATE_WINDOW_SECONDS"):
        Settings.from_env({"PUBLIC_RATE_WINDOW_SECONDS": "0"})


@pytest.fixture
def limited(settings, clock):
    limited = dataclasses.replace(settings, public_rate_limit=2, public_rate_window_seconds=60)
    return make_app(Context.create(limited, clock=clock)), limited


CALLS = [
    ("POST", "/api/v1/survey", json.dumps({"order_number": "FO-404", "rating": 3})),
    ("POST", "/api/v1/referral/check", json.dumps({"code": "GUESS1"})),
    ("GET", "/api/v1/referral/a@example.com", None),
    ("GET", "/api/v1/dot/state-requirements?state=TX", None),
]


@pytest.mark.parametrize("method,path,body", CALLS, ids=[c[1] for c in CALLS])
@pytest.mark.gen_test
async def test_each_public_endpoint_answers_429_with_retry_after(limited, client, method,
                                                                 path, body):
    app, settings = limited
    with served(app, settings) as base:
        responses = [await client.fetch(base + path, method=method, body=body, headers=JSON)
                     for _ in range(3)]
    assert [r.code for r in responses][2] == 429
    assert responses[0].code != 429 and responses[1].code != 429
    assert parsed(responses[2]) == {"error": "too many requests"}
    assert responses[2].headers["Retry-After"] == "30"


@pytest.mark.gen_test
async def test_the_limit_is_per_client_address_as_a_trusted_proxy_reports_it(settings, clock,
                                                                             client):
    settings = dataclasses.replace(settings, public_rate_limit=2,
                                   trusted_proxies=(ipaddress.ip_network("127.0.0.1/32"),))
    app = make_app(Context.create(settings, clock=clock))
    path = "/api/v1/dot/state-requirements?state=TX"

    async def codes(headers):
        return [(await client.fetch(base + path, headers=headers)).code for _ in range(3)]
    with served(app, settings) as base:
        first = await codes({"X-Forwarded-For": "203.0.113.7"})
        second = await codes({"X-Forwarded-For": "198.51.100.2"})
        real_ip = await codes({"X-Real-IP": "192.0.2.44"})
    assert first == second == real_ip == [200, 200, 429]


@pytest.mark.gen_test
async def test_forwarded_addresses_from_anyone_else_are_not_believed(limited, client):
    """Without TRUSTED_PROXIES, a new X-Real-IP per call is no new allowance (on the old
    code each was one: 3 x 200)."""
    app, settings = limited
    path = "/api/v1/dot/state-requirements?state=TX"
    with served(app, settings) as base:
        codes = [(await client.fetch(base + path, headers={"X-Real-IP": f"192.0.2.{n}"})).code
                 for n in range(3)]
    assert codes == [200, 200, 429]


@pytest.mark.gen_test
async def test_the_openapi_document_is_not_rate_limited(limited, client):
    app, settings = limited
    with served(app, settings) as base:
        responses = [await client.fetch(base + "/api/v1/openapi.yaml") for _ in range(4)]
    assert {r.code for r in responses} == {200}


@pytest.mark.gen_test
async def test_the_service_serves_openapi_yaml_as_it_is_in_the_repository(
        http_server, base_url, client):
    import yaml
    from handlers.openapi import OPENAPI_PATH
    response = await client.fetch(base_url + "/api/v1/openapi.yaml")
    assert response.code == 200
    assert response.headers["Content-Type"] == "application/yaml; charset=utf-8"
    with open(OPENAPI_PATH, "rb") as document:
        assert response.body == document.read()
    assert yaml.safe_load(response.body)["openapi"].startswith("3.")


def test_openapi_yaml_says_a_webhook_is_spooled_not_refused_while_the_database_is_down():
    import yaml
    from handlers.openapi import OPENAPI_PATH
    with open(OPENAPI_PATH, encoding="utf-8") as document:
        spec = yaml.safe_load(document)
    responses = spec["components"]["responses"]
    for path, operations in spec["paths"].items():
        unavailable = operations.get("post", {}).get("responses", {}).get("503", {})
        if path.startswith("/api/v1/webhooks/"):
            assert unavailable == {"$ref": "#/components/responses/SpoolUnavailable"}, path
    assert "spool" in responses["SpoolUnavailable"]["description"]
    assert "to the spool and acknowledged" in " ".join(spec["info"]["description"].split())


def test_openapi_yaml_describes_every_route_and_only_routes(ctx):
    import yaml
    from handlers.openapi import OPENAPI_PATH
    from handlers.routes import routes
    from plugins import registries
    with open(OPENAPI_PATH, encoding="utf-8") as document:
        paths = yaml.safe_load(document)["paths"]
    described = set(paths)
    routed = set()
    workflow = registries()["workflow"].keys()
    for pattern, *_ in routes(ctx):
        if pattern == r"/api/v1/webhooks/([a-z]+/[a-z_-]+)":
            routed |= {f"/api/v1/webhooks/{path}" for path in workflow
                       if not path.startswith("fulfillment/")}
            routed.add("/api/v1/webhooks/fulfillment/{status}")  # one path, its enum
        elif pattern == r"/api/v1/orders/([^/]+)/([^/]+)":
            routed.add("/api/v1/orders/{kind}/{order_number}")
        else:
            routed.add(pattern.replace("([^/]+)", "{email}"))
    assert len(workflow) == 20 + len(fulfillment.STATES)
    assert described == routed
    status = paths["/api/v1/webhooks/fulfillment/{status}"]["post"]["parameters"][0]
    assert sorted(status["schema"]["enum"]) == sorted(fulfillment.STATES)
