"""The public JSON endpoints: survey, referral check and info, DOT state requirements.

Anyone may call them, so every one is rate limited per client address and answers a
bad input with 400 `{"error": ..., "field": ...}` naming the field at fault."""
import functools
import json
import datetime
import os
import re
from typing import Any, Iterable, NoReturn

import tornado.web
from peewee import fn

from handlers.base import ApiHandler, same_secret
from models import ORDER_MODELS, ReferralCode, SurveyResponse
from domain.links import survey_token_valid
from engine.prepared import InsertOnce
from handlers.ratelimit import RateLimited

NEW_RESPONSE = InsertOnce(SurveyResponse)
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
MAX_COMMENT_LENGTH = 2000
MAX_ORDER_NUMBER_LENGTH = 100
# An unpadded base64 HMAC-SHA256 is 43 characters; room for padding, nothing more.
MAX_TOKEN_LENGTH = 64
REFERRAL_CODE = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMAIL = re.compile(r"[^@\s/\x00-\x1f]{1,64}@[^@\s/\x00-\x1f]{1,189}\.[^@\s/.\x00-\x1f]{1,63}")


# Tornado calls `initialize` with the route's own arguments (handlers.routes): the rate
# limited handlers take a limiter besides the context.
class PublicApiHandler(RateLimited, ApiHandler):  # type: ignore[misc]
    # A survey response (its comment is at most 2,000 characters) or a referral code.
    body_limit = 16 * 1024

    def refuse_too_many(self) -> NoReturn:
        self.fail(429, "too many requests")

    def fail_field(self, status: int, message: str, field: str) -> NoReturn:
        self.answer(status, {"error": message, "field": field})
        raise tornado.web.Finish()

    def text_field(self, body: dict[str, Any], name: str, max_length: int,
                   required: bool = True) -> str:
        value = body.get(name, "")
        if not isinstance(value, str):
            self.fail_field(400, f"{name} must be a string", name)
        value = value.strip()
        if "\x00" in value:
            # PostgreSQL text cannot hold NUL; no honest survey or order number has one.
            self.fail_field(400, f"{name} must not contain NUL characters", name)
        if required and not value:
            self.fail_field(400, f"missing field: {name}", name)
        if len(value) > max_length:
            self.fail_field(400, f"{name} is longer than {max_length} characters", name)
        return value

    def refuse_unknown_fields(self, body: dict[str, Any], known: Iterable[str]) -> None:
        unknown = sorted(set(body) - set(known))
        if unknown:
            self.fail_field(400, f"unknown field: {unknown[0]}", unknown[0])


def order_exists(order_number: str) -> bool:
    return any(model.select().where(model.order_number == order_number).exists()
               for model in ORDER_MODELS.values())


class SurveyHandler(PublicApiHandler):
    """POST /api/v1/survey: one post-completion survey response per order, from the
    customer's signed invitation (domain.links.survey_token)."""

    async def post(self) -> None:
        body = self.json_body()
        self.refuse_unknown_fields(body, ("order_number", "token", "rating", "comment"))
        order_number = self.text_field(body, "order_number", MAX_ORDER_NUMBER_LENGTH)
        token = self.text_field(body, "token", MAX_TOKEN_LENGTH)
        rating = body.get("rating")
        # bool is an int in Python; a rating of `true` is not a rating.
        if type(rating) is not int or not 1 <= rating <= 5:
            self.fail_field(400, "rating must be a whole number from 1 to 5", "rating")
        comment = self.text_field(body, "comment", MAX_COMMENT_LENGTH, required=False)
        # Before the lookup: without the order's own token nobody learns whether it exists,
        # nor takes the one response that belongs to its customer.
        if not survey_token_valid(self.ctx.settings.link_secret, order_number, token):
            self.fail_field(403, "invalid token for this order", "token")
        now = self.ctx.clock()

        def record() -> str:
            if not order_exists(order_number):
                return "unknown"
            recorded = NEW_RESPONSE.run(order_number=order_number, rating=rating,
                                        comment=comment, created_at=now, updated_at=now)
            return "duplicate" if recorded is None else "recorded"
        outcome = await self.ctx.db(record)
        if outcome == "unknown":
            self.fail_field(404, "unknown order", "order_number")
        if outcome == "duplicate":
            self.fail_field(409, "a survey response for this order was already recorded",
                            "order_number")
        self.answer(201, {"recorded": True, "order_number": order_number})


class ReferralCheckHandler(PublicApiHandler):
    """POST /api/v1/referral/check: is a code valid, and what does it give."""

    async def post(self) -> None:
        body = self.json_body()
        self.refuse_unknown_fields(body, ("code",))
        code = self.text_field(body, "code", 64)
        if not REFERRAL_CODE.fullmatch(code):
            self.fail_field(400, "code may hold only letters, digits, - and _", "code")
        referral = await self.ctx.db(
            lambda: ReferralCode.get_or_none(ReferralCode.code == code.upper()))
        if referral is None or not usable(referral, self.ctx.clock()):
            self.answer(200, {"code": code.upper(), "valid": False, "discount": None})
        else:
            self.answer(200, {"code": referral.code, "valid": True,
                              "discount": {"percent_off": referral.percent_off}})


def usable(referral: ReferralCode, now: datetime.datetime) -> bool:
    return referral.active and (referral.expires_at is None or referral.expires_at > now)


class ReferralInfoHandler(PublicApiHandler):
    """GET /api/v1/referral/<email>: a customer's referral codes and what they earned.

    Only a caller with the shared secret (X-Webhook-Secret) is told anything; without it
    every e-mail gets the same answer, so nobody learns whether an e-mail is a customer."""

    WITHHELD = {"email": None, "codes": None,
                "detail": "referral details are given to authenticated callers only"}

    async def get(self, email: str) -> None:
        email = email.strip().lower()
        if len(email) > 254 or not EMAIL.fullmatch(email):
            self.fail_field(400, "email must be an e-mail address", "email")
        secret = self.request.headers.get("X-Webhook-Secret")
        if secret is None:
            self.answer(200, self.WITHHELD)
            return
        if not same_secret(secret, self.ctx.settings.workflow_secret):
            self.fail(401, "Unauthorized")
        now = self.ctx.clock()

        def described() -> list[dict[str, Any]]:
            codes = (ReferralCode.select()
                     .where(fn.LOWER(ReferralCode.owner_email) == email)
                     .order_by(ReferralCode.code))
            return [describe(code, now) for code in codes]
        self.answer(200, {"email": email, "codes": await self.ctx.db(described),
                          "detail": None})


def describe(referral: ReferralCode, now: datetime.datetime) -> dict[str, Any]:
    """What the referral info tells of one code. In a unit of work (ctx.db)."""
    paid = paid_orders_using(referral.code)
    return {"code": referral.code, "valid": usable(referral, now),
            "percent_off": referral.percent_off, "paid_referrals": paid,
            "reward_cents_per_referral": referral.reward_cents,
            "reward_earned_cents": paid * referral.reward_cents}


def paid_orders_using(code: str) -> int:
    return sum(model.select().where((fn.UPPER(model.discount_code) == code)
                                    & (model.payment_status == "paid")).count()
               for model in ORDER_MODELS.values())


@functools.cache
def state_requirements() -> dict[str, Any]:
    with open(os.path.join(DATA_DIR, "dot_state_requirements.json"), encoding="utf-8") as f:
        return json.load(f)


class DotRequirementsHandler(PublicApiHandler):
    """GET /api/v1/dot/state-requirements[?state=TX]: one state, or every state."""

    def get(self) -> None:
        data = state_requirements()
        states = data["states"]
        code = self.get_query_argument("state", None)
        if code is not None:
            code = code.strip().upper()
            if code not in states:
                self.fail_field(400, "state must be a two-letter US state code", "state")
            states = {code: states[code]}
        self.answer(200, {"about": data["about"],
                          "states": [{"code": c, **states[c]} for c in sorted(states)]})
