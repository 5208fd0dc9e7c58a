"""What an order's values must be to be taken in (domain.intake, docs/ORDERS.md): one
notion of an order number and of a currency for the orders API and the import, and text
that can be stored and shown.

An order number is in the orders API's path, in the links mailed to customers, in
Frappe's calls and in the crypto processor's invoices, whose callbacks name no kind: the
kind is read from the number's prefix (domain.orders.order_type_of). So a number is ASCII
letters and digits with `-`, `_` or `.` between them, and it carries its kind's prefix,
written as the rule writes it (`FO-`, not `fo-`). A currency is a code of ISO 4217's
table (the `iso4217` package, as domain/money.py reads it) that has a minor unit, the
unit the amounts are counted in.

Every message names what it was given in ASCII and at most 40 characters of it (`shown`):
the import prints them to a terminal, whatever a cell held."""
import json
import re
import unicodedata
from typing import Any

import iso4217

from domain.orders import DEFAULT_ORDER_TYPE, ORDER_TYPE_PREFIXES, order_type_of

MAX_NUMBER_LENGTH = 255
# Letters and digits first and last: no number is `.` or `..` (a path's own segments) nor
# ends in punctuation a mail client would leave out of the link.
ORDER_NUMBER = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,253}[A-Za-z0-9])?")
NUMBER_CHARACTERS = re.compile(r"[A-Za-z0-9._-]")
# C0 and C1 controls and DEL: never in text a person typed (a C1 in a name is most often a
# Windows-1252 byte read as Latin-1).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Amounts in a CSV cell: ASCII digits only (`str.isdigit` is true of `²` and of other
# scripts' digits, which `int` refuses or reads as a number nobody wrote), at most the
# digits of the largest BIGINT.
CELL_CENTS = re.compile(r"[0-9]{1,19}")
# Nesting past which a JSON value is named as too deep rather than as unreadable; the
# parser itself stops near a thousand levels. No shop field holds an array or an object.
MAX_NESTING = 200
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,40}")
JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:]')


class InvalidOrder(ValueError):
    """An order the contract refuses; `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def shown(value: Any) -> str:
    """`value` as a message quotes it: JSON, ASCII, at most 40 characters."""
    if isinstance(value, (str, int, float, type(None))):
        text = json.dumps(value[:40] if isinstance(value, str) else value)
        return text if not isinstance(value, str) or len(value) <= 40 else text[:-1] + '..."'
    return type(value).__name__


def named(value: str) -> str:
    """A name given as a field or a kind, as a message quotes it: as it is when it is a
    plain word, else `shown`."""
    return value if PLAIN_NAME.fullmatch(value) else shown(value)


def check_text(name: str, value: str) -> None:
    """Text that can be stored and shown: no lone surrogate (JSON's `"\\ud800"`, which no
    database stores), no control character."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as bad:
        raise InvalidOrder(name, f"{name} holds a lone surrogate, U+{ord(value[bad.start]):04X} "
                                 "(half of a character: the sender's text was cut or "
                                 "mis-encoded)") from None
    if CONTROL.search(value):
        raise InvalidOrder(name, f"{name} must not hold control characters")


def check_number(name: str, number: Any, kind: str | None = None) -> str:
    """`number` as an order number of `kind` (of any kind when None: its prefix still
    written as the rule writes it). Raises InvalidOrder naming `name` and why."""
    if not isinstance(number, str):
        raise InvalidOrder(name, f"{name} must be text, got {shown(number)}")
    if not ORDER_NUMBER.fullmatch(number):
        raise InvalidOrder(name, f"{name} must be 1 to {MAX_NUMBER_LENGTH} ASCII letters and "
                                 "digits, with - _ or . between them (it is part of links "
                                 f"and paths); {_fault(number)}")
    for prefix, of_kind in ORDER_TYPE_PREFIXES:
        if number[:len(prefix)].upper() == prefix and not number.startswith(prefix):
            raise InvalidOrder(name, f"{name} {shown(number)}: write its prefix {prefix} in "
                                     f"capitals (the prefix {prefix} names a {of_kind} order; "
                                     f"{number[:len(prefix)]} names none)")
    if kind is not None and order_type_of(number) != kind:
        raise InvalidOrder(name, f"{name} {shown(number)}: {_prefix_rule(kind)}, the prefix "
                                 "the crypto processor's callbacks find its kind by")
    return number


def _fault(number: str) -> str:
    if not number:
        return "got an empty one"
    if len(number) > MAX_NUMBER_LENGTH:
        return f"got {len(number)} characters"
    for character in number:
        if not NUMBER_CHARACTERS.fullmatch(character):
            return f"{shown(number)} holds {_character(character)}"
    return f"{shown(number)} must start and end with a letter or a digit"


def _character(character: str) -> str:
    code = f"U+{ord(character):04X}"
    if 0xD800 <= ord(character) <= 0xDFFF:
        return f"{code} (a lone surrogate)"
    name = unicodedata.name(character, "")
    if name:
        return f"{code} ({name})"
    return f"{code} (a control character)" if unicodedata.category(character) == "Cc" \
        else code


def _prefix_rule(kind: str) -> str:
    own = [prefix for prefix, of_kind in ORDER_TYPE_PREFIXES if of_kind == kind]
    if kind != DEFAULT_ORDER_TYPE:
        return f"a {kind} order's number starts with {own[0]}"
    others = ", ".join(prefix for prefix, of_kind in ORDER_TYPE_PREFIXES if of_kind != kind)
    return f"a {kind} order's number starts with {own[0]} or with none of {others}"


def check_currency(name: str, value: str) -> str:
    """`value` as an ISO 4217 code with a minor unit, upper case."""
    code = value.upper()
    try:
        exponent = iso4217.Currency(code).exponent
    except ValueError:
        raise InvalidOrder(name, f"{name} must be an ISO 4217 code such as USD or CAD, got "
                                 f"{shown(value)}") from None
    if exponent is None:
        raise InvalidOrder(name, f"{name} {code} has no minor unit in ISO 4217 (a metal, a "
                                 "fund or a test code): no amount in cents is in it")
    return code


def cell_cents(value: str) -> int | str:
    """A CSV cell's amount: its ASCII digits as a number; any other cell as it is (refused
    by the amount's check with what it holds)."""
    digits = value.strip()
    return int(digits) if CELL_CENTS.fullmatch(digits) else value


def too_deep(text: str) -> str | None:
    """When a JSON object's text nests past MAX_NESTING: the top-level key of the value
    that does ("" when none is read yet); else None. Read for a text the parser refused,
    to name the field."""
    depth = 0
    last_string = key = ""
    for token in JSON_TOKEN.finditer(text):
        symbol = token.group()
        if symbol in ("[", "{"):
            depth += 1
            if depth > MAX_NESTING:
                return key
        elif symbol in ("]", "}"):
            depth -= 1
        elif symbol == ":":
            if depth == 1:
                key = last_string
        else:
            last_string = _key(symbol)
    return None


def _key(token: str) -> str:
    try:
        key = json.loads(token)
    except ValueError:
        return ""
    return key if isinstance(key, str) else ""
