"""The signed "I already filed" links of the IFTA and UCR reminder e-mails, and the signed
survey invitation.

token = url-safe base64 (unpadded) of HMAC-SHA256(LINK_SECRET, "<kind>|<order>|<cycle>").
The separator may not appear in an order number or a cycle, or "a|b" + "c" and "a" + "b|c"
would sign the same message and a token could be moved to another cycle. A survey token
is signed over "survey|<order>|": its own kind, so no link token passes for it.
"""
import base64
import hashlib
import hmac
import urllib.parse

from models import ComplianceOrder, SelfFiling
from engine.prepared import InsertOnce

NEW_FILING = InsertOnce(SelfFiling)
KINDS = ("ifta", "ucr")
SURVEY = "survey"
SEPARATOR = "|"
# A cycle is a short label such as "2026-Q3" or "2027"; anything longer is not ours.
MAX_PART_LENGTH = 100


class InvalidLinkPart(ValueError):
    """An order number or cycle that cannot be signed unambiguously."""


def check_parts(kind, order_number, cycle):
    if kind not in KINDS:
        raise InvalidLinkPart(f"kind must be one of {', '.join(KINDS)}")
    check_part("order", order_number)
    check_part("cycle", cycle)


def check_part(name, value):
    if not value or len(value) > MAX_PART_LENGTH or SEPARATOR in value or "\x00" in value:
        raise InvalidLinkPart(
            f"{name} must be 1 to {MAX_PART_LENGTH} characters without {SEPARATOR!r} or NUL")


def sign(secret, *parts):
    message = SEPARATOR.join(parts).encode("utf-8")
    digest = hmac.new(secret.encode("utf-8"), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def link_token(secret, kind, order_number, cycle):
    check_parts(kind, order_number, cycle)
    return sign(secret, kind, order_number, cycle)


def survey_token(secret, order_number):
    """The token of an order's survey invitation: only the customer who was sent it can
    answer, and nobody else learns from the survey endpoint which orders exist."""
    check_part("order", order_number)
    return sign(secret, SURVEY, order_number, "")


def same_token(given, expected):
    """Constant-time check; a padded token is accepted as well as the unpadded one."""
    given = (given or "").rstrip("=")
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("ascii"))


def token_valid(secret, kind, order_number, cycle, token):
    try:
        return same_token(token, link_token(secret, kind, order_number, cycle))
    except InvalidLinkPart:
        return False


def survey_token_valid(secret, order_number, token):
    try:
        return same_token(token, survey_token(secret, order_number))
    except InvalidLinkPart:
        return False


def signed_link(settings, kind, order_number, cycle):
    query = urllib.parse.urlencode({
        "order": order_number, "cycle": cycle,
        "token": link_token(settings.link_secret, kind, order_number, cycle)})
    return f"{settings.public_base_url}/api/v1/{kind}/filed?{query}"


def find_order(order_number):
    """IFTA and UCR are compliance services: their orders are compliance orders."""
    return ComplianceOrder.get_or_none(ComplianceOrder.order_number == order_number)


def record_self_filed(kind, order_number, cycle, now):
    """Record the self-filing once; return (first recorded time, recorded by this call).

    Link scanners prefetch and people click twice: every later call finds the first row."""
    created = NEW_FILING.run(kind=kind, order_number=order_number, cycle=cycle,
                             self_filed_at=now, created_at=now, updated_at=now)
    row = SelfFiling.get(filing_key(kind, order_number, cycle))
    return row.self_filed_at, created is not None


def self_filed_at(kind, order_number, cycle):
    """When the customer said they filed this cycle (the first time), or None."""
    row = SelfFiling.get_or_none(filing_key(kind, order_number, cycle))
    return None if row is None else row.self_filed_at


def already_filed(kind, order_number, cycle):
    """Whether the customer said they filed this cycle: a reminder job asks before sending."""
    return SelfFiling.select().where(filing_key(kind, order_number, cycle)).exists()


def filing_key(kind, order_number, cycle):
    return ((SelfFiling.kind == kind) & (SelfFiling.order_number == order_number)
            & (SelfFiling.cycle == cycle))

