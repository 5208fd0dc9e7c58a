"""The signed "I already filed" links of the IFTA and UCR reminder e-mails, and the signed
survey invitation.

token = url-safe base64 (unpadded) of HMAC-SHA256(LINK_SECRET, "<kind>|<order>|<cycle>").
The separator may not appear in an order number or a cycle, or "a|b" + "c" and "a" + "b|c"
would sign the same message and a token could be moved to another cycle. A survey token
is signed over "survey|<order>|": its own kind, so no link token passes for it.
"""
import base64
import datetime
import hashlib
import hmac
import urllib.parse

from engine.transaction import Transaction
from settings import Settings

KINDS = ("ifta", "ucr")
SURVEY = "survey"
SEPARATOR = "|"
# A cycle is a short label such as "2026-Q3" or "2027"; anything longer is not ours.
MAX_PART_LENGTH = 100


class InvalidLinkPart(ValueError):
    """An order number or cycle that cannot be signed unambiguously."""


def check_parts(kind: str, order_number: str, cycle: str) -> None:
    """InvalidLinkPart unless a link of that kind, order and cycle can be signed."""
    if kind not in KINDS:
        raise InvalidLinkPart(f"kind must be one of {', '.join(KINDS)}")
    check_part("order", order_number)
    check_part("cycle", cycle)


def check_part(name: str, value: str) -> None:
    """InvalidLinkPart unless `value` (the link's `name` part) can be signed."""
    if not value or len(value) > MAX_PART_LENGTH or SEPARATOR in value or "\x00" in value:
        raise InvalidLinkPart(
            f"{name} must be 1 to {MAX_PART_LENGTH} characters without {SEPARATOR!r} or NUL")


def sign(secret: str, *parts: str) -> str:
    """The token of `parts` signed with `secret`."""
    message = SEPARATOR.join(parts).encode("utf-8")
    digest = hmac.new(secret.encode("utf-8"), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def link_token(secret: str, kind: str, order_number: str, cycle: str) -> str:
    """The token of an "I already filed" link; InvalidLinkPart for a part it cannot sign."""
    check_parts(kind, order_number, cycle)
    return sign(secret, kind, order_number, cycle)


def survey_token(secret: str, order_number: str) -> str:
    """The token of an order's survey invitation: only the customer who was sent it can
    answer, and nobody else learns from the survey endpoint which orders exist."""
    check_part("order", order_number)
    return sign(secret, SURVEY, order_number, "")


def same_token(given: str | None, expected: str) -> bool:
    """Constant-time check; a padded token is accepted as well as the unpadded one."""
    given = (given or "").rstrip("=")
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("ascii"))


def token_valid(secret: str, kind: str, order_number: str, cycle: str,
                token: str | None) -> bool:
    """Whether `token` is the link's (False for a part that cannot be signed)."""
    try:
        return same_token(token, link_token(secret, kind, order_number, cycle))
    except InvalidLinkPart:
        return False


def survey_token_valid(secret: str, order_number: str, token: str | None) -> bool:
    """Whether `token` is the order's survey invitation's."""
    try:
        return same_token(token, survey_token(secret, order_number))
    except InvalidLinkPart:
        return False


def signed_link(settings: Settings, kind: str, order_number: str, cycle: str) -> str:
    """The "I already filed" link of a reminder, signed."""
    query = urllib.parse.urlencode({
        "order": order_number, "cycle": cycle,
        "token": link_token(settings.link_secret, kind, order_number, cycle)})
    return f"{settings.public_base_url}/api/v1/{kind}/filed?{query}"


def record_self_filed(tx: Transaction, kind: str, order_number: str, cycle: str,
                      now: datetime.datetime) -> tuple[datetime.datetime, bool]:
    """Record the self-filing once; return (first recorded time, recorded by this call).

    Link scanners prefetch and people click twice: every later call finds the first row."""
    return tx.record_self_filing(kind, order_number, cycle, now)


def self_filed_at(tx: Transaction, kind: str, order_number: str,
                  cycle: str) -> datetime.datetime | None:
    """When the customer said they filed this cycle (the first time), or None."""
    return tx.self_filed_at(kind, order_number, cycle)


def already_filed(tx: Transaction, kind: str, order_number: str, cycle: str) -> bool:
    """Whether the customer said they filed this cycle: a reminder job asks before sending."""
    return tx.filed_already(kind, order_number, cycle)
