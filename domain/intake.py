"""Orders in: the one contract behind the orders API (`PUT /api/v1/orders/<kind>/<number>`),
the import command (`receiver.py orders import FILE`) and a shop that shares the database
(docs/ORDERS.md).

The shop owns who the customer is and what was ordered: SHOP_FIELDS, per kind. The
service owns every other column (payment, fulfilment, settlement, holdback, notes, the
Frappe document name): a call that names one is refused, never half taken. `parse`
checks an order as the shop sends it (a JSON object, or a CSV row whose cells are text)
and raises InvalidOrder naming the field (what each value must be, an order number and a
currency among them: domain.order_checks); `store` writes it, once: the same order sent
again changes nothing, and says so.

An order that arrives makes the calls that wait for it due now (`make_waiting_due`): the
failed events about it, or about an order that names it as its parent (a payment's
re-dispatch of the parent), are retried at once rather than at their next backoff. The
inbox then hands them to their plugins in its own order; nothing here orders them.
Calls still waiting for an order not there yet (`waiting_calls`), and the card facts
waiting for the ids that will find their order (`facts_waiting`), are what the console's
overview shows.

Longer than most: the contract (its fields, their checks, the file formats) is one thing,
read together."""
import csv
import dataclasses
import datetime
import decimal
import functools
import io
import json
import logging
import re
from typing import Any, Callable, Iterator, Mapping

from domain import order_checks, orders, payment_state
# InvalidOrder: the contract's error, raised by its checks (domain.order_checks).
from domain.order_checks import InvalidOrder as InvalidOrder, shown
from engine import inbox
from engine.contracts import EngineContext
from engine.payload import read_json
from engine.transaction import CallsWaiting, FactsWaiting, Transaction
from models import ORDER_MODELS, OrderBase

log = logging.getLogger("receiver.orders")

KINDS = tuple(ORDER_MODELS)
# The fields every order's shop sets, and those of one kind.
COMMON_FIELDS = ("customer_email", "customer_name", "service_name", "parent_order_number",
                 "discount_code")
SHOP_FIELDS = {
    "formation": COMMON_FIELDS,
    "compliance": (*COMMON_FIELDS, "service_slug"),
    "bundle": COMMON_FIELDS,
    "canada_crtc": (*COMMON_FIELDS, "total_cents", "amb_annual_price_cents", "currency"),
}
# The columns of the row itself, not the shop's nor the service's to set.
ROW_FIELDS = ("id", "order_number", "created_at", "updated_at")

MAX_TEXT_LENGTH = 255
MAX_EMAIL_LENGTH = 254
EMAIL = re.compile(r"[^@\s\x00-\x1f\x7f]{1,64}@[^@\s\x00-\x1f\x7f]{1,189}\.[^@\s.\x00-\x1f\x7f]{1,63}")
DEFAULT_CURRENCY = "USD"
# The largest amount a BIGINT holds.
MAX_CENTS = 2 ** 63 - 1
# Orders written per unit of work by an import; each row is its own savepoint.
IMPORT_BATCH = 100
# The fields that say what a payment was for: once an order is paid, a call changes them
# only when it says it means it (the API's amend_paid=1, the import's --amend-paid). The
# kind is never changed: a number is an order of one kind (OtherKind).
MONEY_FIELDS = ("total_cents", "amb_annual_price_cents", "currency")


class UnknownKind(LookupError):
    """The path names no kind of order."""


class OtherKind(ValueError):
    """The order number is already an order of another kind: one number, one order (the
    crypto callbacks and Frappe's webhooks name an order by its number alone)."""

    def __init__(self, order_number: str, kind: str) -> None:
        super().__init__(f"order {order_number} is a {kind} order")
        self.kind = kind


class PaidOrder(ValueError):
    """The order is paid and the call changes what its payment was for (MONEY_FIELDS)
    without saying it means it; `field` the first such field, `changes` each one's
    (stored, asked)."""

    def __init__(self, order: OrderBase, changes: Mapping[str, tuple[Any, Any]]) -> None:
        self.field = next(name for name in MONEY_FIELDS if name in changes)
        paid = orders.paid_amount(order)
        asked = "; ".join(f"{name} stays {shown(old)} (asked {shown(new)})"
                          for name, (old, new) in changes.items())
        super().__init__(f"order {order.order_number} is paid"
                         f"{f' ({paid} received)' if paid else ''}: {asked}")


@dataclasses.dataclass(frozen=True)
class OrderInput:
    """An order as the shop sent it, checked: its shop fields to set (None: cleared)."""
    kind: str
    order_number: str
    values: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Stored:
    order: OrderBase
    # created, updated or unchanged
    outcome: str
    # The calls waiting for this order made due now by its arrival.
    due: int
    # {field: (old, new)} of an update.
    changes: Mapping[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    # An update of a paid order's MONEY_FIELDS, as the call said it meant.
    amended_paid: bool = False


def model_of(kind: str) -> type[OrderBase]:
    try:
        return ORDER_MODELS[kind]
    except KeyError:
        raise UnknownKind(f"unknown kind: {order_checks.named(kind)} "
                          f"(the kinds: {', '.join(KINDS)})") from None


def service_fields(kind: str) -> tuple[str, ...]:
    """The columns of an order of `kind` that the service owns: every one the shop does
    not, the row's own aside."""
    return tuple(field.name for field in model_of(kind)._meta.sorted_fields
                 if field.name not in ROW_FIELDS and field.name not in SHOP_FIELDS[kind])


def read_body(data: bytes) -> dict[str, Any]:
    """An orders API call's body as its JSON object. Raises InvalidOrder naming the field
    whose value nests too deep for the parser, ValueError for any other body that is not a
    JSON object."""
    try:
        body = read_json(data)
    except ValueError:
        field = order_checks.too_deep(data.decode("utf-8", "replace"))
        if field is not None:
            raise _nested(field) from None
        raise
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    return body


def _nested(field: str) -> InvalidOrder:
    return InvalidOrder(field or "body", f"{field or 'the body'} nests arrays or objects more "
                                         f"than {order_checks.MAX_NESTING} deep (a shop field "
                                         "is text or a number)")


def parse(kind: str, order_number: str, fields: Mapping[str, Any],
          cells: bool = False) -> OrderInput:
    """The order of `kind` and `order_number` with `fields` (JSON values; with `cells`,
    a CSV row's text, where an empty cell clears its field and amounts are digits).
    Raises UnknownKind, or InvalidOrder naming the first field at fault."""
    model_of(kind)
    order_checks.check_number("order_number", order_number, kind)
    own = SHOP_FIELDS[kind]
    values = {}
    for name, value in fields.items():
        if name in ("kind", "order_number"):
            given = kind if name == "kind" else order_number
            if value != given:
                raise InvalidOrder(name, f"{name} is {shown(given)} (the path's), not "
                                         f"{shown(value)}")
            continue
        if name not in own:
            raise InvalidOrder(name, _not_the_shops(kind, name))
        if cells and value == "":
            value = None
        values[name] = CHECKS[name](name, value, cells)
    if values.get("parent_order_number") == order_number:
        raise InvalidOrder("parent_order_number",
                           "parent_order_number must not be the order's own number")
    return OrderInput(kind, order_number, values)


def _not_the_shops(kind: str, name: str) -> str:
    if name in ROW_FIELDS or any(name in service_fields(other) for other in KINDS):
        return (f"{name} is the service's to set, not the shop's: the orders API never "
                "changes it (docs/ORDERS.md)")
    if any(name in SHOP_FIELDS[other] for other in KINDS):
        return f"{name} is not a field of {kind} orders"
    return f"unknown field: {order_checks.named(name)}"


def _text(name: str, value: Any, cells: bool, max_length: int = MAX_TEXT_LENGTH) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidOrder(name, f"{name} must be text or null")
    value = value.strip()
    order_checks.check_text(name, value)
    if len(value) > max_length:
        raise InvalidOrder(name, f"{name} is longer than {max_length} characters")
    return value or None


def _email(name: str, value: Any, cells: bool) -> str | None:
    value = _text(name, value, cells, MAX_EMAIL_LENGTH)
    if value is not None and not EMAIL.fullmatch(value):
        raise InvalidOrder(name, f"{name} must be an e-mail address")
    return value


def _order_number(name: str, value: Any, cells: bool) -> str | None:
    value = _text(name, value, cells)
    # The parent may be of any kind: its prefix is checked as written, not against one.
    return None if value is None else order_checks.check_number(name, value)


def _cents(name: str, value: Any, cells: bool) -> int | None:
    if value is None:
        return None
    if cells and isinstance(value, str):
        value = order_checks.cell_cents(value)
    # bool is an int to Python, not an amount; 780.0 is JSON's float, not cents.
    if type(value) is not int or not 0 <= value <= MAX_CENTS:
        raise InvalidOrder(name, f"{name} must be a whole number of cents (the currency's "
                                 f"minor units), 0 or more, got {shown(value)}")
    return value


def _currency(name: str, value: Any, cells: bool) -> str:
    value = _text(name, value, cells)
    if value is None:
        return DEFAULT_CURRENCY
    return order_checks.check_currency(name, value)


CHECKS = {
    "customer_email": _email, "customer_name": _text, "service_name": _text,
    "parent_order_number": _order_number, "discount_code": _text, "service_slug": _text,
    "total_cents": _cents, "amb_annual_price_cents": _cents, "currency": _currency,
}


# --- storing ---------------------------------------------------------------------------

def find(tx: Transaction, kind: str, order_number: str) -> OrderBase | None:
    """The order of `kind` and `order_number`, or None. Raises UnknownKind."""
    model_of(kind)
    return tx.order(kind, order_number)


def kind_of(tx: Transaction, order_number: str) -> str | None:
    """The kind of the order with that number, whatever it is; None when there is none."""
    return tx.kind_of_order(order_number)


def store(tx: Transaction, order: OrderInput, now: datetime.datetime, by: str,
          amend_paid: bool = False) -> Stored:
    """Create the order, or set its shop fields (a unit of work, or part of one), and keep
    what was done in its history, by `by` (who sent it). Raises OtherKind when the number
    is an order of another kind, and PaidOrder, nothing written, when the order is paid
    and the call changes one of its MONEY_FIELDS without `amend_paid`."""
    model_of(order.kind)
    found = tx.kind_of_order(order.order_number)
    if found not in (None, order.kind):
        raise OtherKind(order.order_number, found)
    existing = tx.lock_order(order.kind, order.order_number)
    if existing is None:
        created = tx.add_shop_order(order.kind, order.order_number, order.values, now)
        if created is not None:
            tx.record_creation(order.kind, order.order_number, {
                name: getattr(created, name) for name in SHOP_FIELDS[order.kind]}, now, by)
            return Stored(created, "created", make_waiting_due(tx, order.order_number, now))
        # Made by another call meanwhile, whose transaction has ended: it is there now.
        existing = tx.lock_order(order.kind, order.order_number)
        assert existing is not None
    changes = {name: (getattr(existing, name), value) for name, value in order.values.items()
               if getattr(existing, name) != value}
    if not changes:
        return Stored(existing, "unchanged", 0)
    paid_money = {name: change for name, change in changes.items() if name in MONEY_FIELDS}
    paid = bool(paid_money) and payment_state.received(existing)
    if paid and not amend_paid:
        raise PaidOrder(existing, paid_money)
    tx.record_changes(order.kind, order.order_number, changes, now, by)
    updated = tx.set_shop_fields(existing, {name: new for name, (_, new) in changes.items()},
                                 now)
    return Stored(updated, "updated", 0, changes, amended_paid=paid)


async def put(ctx: EngineContext, order: OrderInput, by: str,
              amend_paid: bool = False) -> Stored:
    """`store` in a unit of its own; the inbox's retry told to run now when calls were
    made due, so they are handled now rather than at its next tick."""
    stored: Stored = await ctx.db(functools.partial(store, Transaction(ctx), order,
                                                    ctx.clock(), by, amend_paid))
    if stored.outcome != "unchanged":
        log.log(logging.WARNING if stored.amended_paid else logging.INFO,
                "%s order %s %s through the orders API%s%s%s", order.kind,
                order.order_number, stored.outcome,
                f": {changes_text(stored.changes)}" if stored.changes else "",
                " (a paid order's amounts, as the call said it meant: amend_paid)"
                if stored.amended_paid else "",
                f"; {stored.due} waiting call(s) due now" if stored.due else "")
    if stored.due:
        run_waiting_calls(ctx)
    return stored


def changes_text(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """`total_cents 12900 -> 99999, currency "CAD" -> "USD"`: what an update changed."""
    return ", ".join(f"{name} {shown(old)} -> {shown(new)}"
                     for name, (old, new) in changes.items())


def run_waiting_calls(ctx: EngineContext) -> None:
    """Ask the service's inbox retry to run now (a command has no scheduler: the running
    service takes the calls made due at its next tick)."""
    if ctx.scheduler is not None:
        ctx.scheduler.run_soon("inbox")


def make_waiting_due(tx: Transaction, order_number: str, now: datetime.datetime) -> int:
    """The failed calls about `order_number`, or about an order naming it as its parent,
    due now; returns how many were not due yet."""
    return tx.make_calls_due(order_number, now)


def waiting_calls(tx: Transaction, limit: int = 20) -> CallsWaiting:
    """The calls not yet handled whose order is in none of the order tables (a unit of
    work): the first of an order failed for want of it, the later ones held behind it
    (engine.inbox). How many, for how many orders, and the `limit` orders that wait
    longest (number, calls, since when)."""
    return tx.calls_waiting_for_orders(inbox.AWAITING_HANDLING, limit)


def facts_waiting(tx: Transaction, limit: int = 10) -> FactsWaiting:
    """The card facts waiting for their order (a unit of work): how many, and the `limit`
    waiting longest, with the ids that will find their order (engine.inbox)."""
    return tx.facts_waiting(limit)


# --- what the shop is told -------------------------------------------------------------

def describe(order: OrderBase) -> dict[str, Any]:
    """The order as the service sees it, for the orders API: the shop's fields and the
    service's apart, every one present (null when unset)."""
    def shown(value: Any) -> Any:
        if isinstance(value, datetime.datetime):
            return value.isoformat()
        if isinstance(value, decimal.Decimal):
            return str(value)
        return value
    kind = order.kind
    assert kind is not None  # a row of one of ORDER_MODELS, each of a kind
    return {"kind": kind, "order_number": order.order_number,
            "shop": {name: shown(getattr(order, name)) for name in SHOP_FIELDS[kind]},
            "service": {name: shown(getattr(order, name)) for name in service_fields(kind)},
            "created_at": shown(order.created_at), "updated_at": shown(order.updated_at)}


def changes_shown(changes: Mapping[str, tuple[Any, Any]]) -> dict[str, dict[str, Any]]:
    """An update's changes as the orders API tells them: {field: {"old": ..., "new": ...}}."""
    return {name: {"old": old, "new": new} for name, (old, new) in changes.items()}


# --- files -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Row:
    """One order of a file: its line (the header is line 1), and the order or why not."""
    line: int
    order: OrderInput | None = None
    problem: str | None = None


class UnreadableFile(ValueError):
    """A file that is neither CSV with the header nor JSON lines; the message names the
    line."""


def read_rows(data: bytes) -> list[Row]:
    """Every order of an import file, checked: JSON lines when its first character is
    `{`, else CSV whose header is `kind,order_number,<field>...`. An order number on two
    lines makes the second a bad row (the file would not say which to keep)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as bad:
        line = data[:bad.start].count(b"\n") + 1
        raise UnreadableFile(f"line {line}: not UTF-8 text{_windows_1252(data, bad.start)}") \
            from None
    rows = list(_json_lines(text) if text.lstrip().startswith("{") else _csv_rows(text))
    first_line: dict[str, int] = {}
    checked = []
    for row in rows:
        if row.order is not None:
            earlier = first_line.setdefault(row.order.order_number, row.line)
            if earlier != row.line:
                row = Row(row.line, problem=f"order {row.order.order_number} is on line "
                                            f"{earlier} too")
        checked.append(row)
    return checked


def _windows_1252(data: bytes, start: int) -> str:
    """Why a file is not UTF-8 when its bytes read as Windows-1252: the encoding a
    spreadsheet's plain "CSV" export writes on Windows."""
    try:
        data.decode("cp1252")
    except UnicodeDecodeError:
        return f" (byte 0x{data[start]:02X})"
    return (f" (byte 0x{data[start]:02X}): it reads as Windows-1252, the encoding of a "
            "spreadsheet's plain CSV export on Windows; export it as CSV UTF-8")


def _checked(line: int, kind: Any, order_number: Any, fields: Mapping[str, Any],
             cells: bool) -> Row:
    try:
        if not isinstance(kind, str) or not kind:
            raise InvalidOrder("kind", f"kind is missing (the kinds: {', '.join(KINDS)})")
        # A file's kind is a word a person typed: `Formation` is formation (and an
        # unknown one is named as it was typed).
        kind = kind.strip()
        return Row(line, parse(kind.lower() if kind.lower() in ORDER_MODELS else kind,
                               order_number, fields, cells=cells))
    except (UnknownKind, InvalidOrder) as problem:
        return Row(line, problem=str(problem))


def _json_lines(text: str) -> Iterator[Row]:
    # Lines end at a line feed alone: a JSON string may hold U+2028 or U+0085, which
    # str.splitlines would break a line at.
    for line, content in enumerate(text.split("\n"), start=1):
        if not content.strip():
            continue
        try:
            body = json.loads(content)
        except RecursionError:
            yield Row(line, problem=str(_nested(order_checks.too_deep(content) or "")))
            continue
        except ValueError:
            body = None
        if not isinstance(body, dict):
            yield Row(line, problem="not a JSON object")
            continue
        fields = {name: value for name, value in body.items() if name not in ("kind",)}
        yield _checked(line, body.get("kind"), fields.pop("order_number", None), fields,
                       cells=False)


def _csv_rows(text: str) -> Iterator[Row]:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
    except (StopIteration, csv.Error):
        raise UnreadableFile("line 1: no header (kind,order_number,<field>...)") from None
    header = [name.strip() for name in header]
    if header[:2] != ["kind", "order_number"]:
        raise UnreadableFile(f"line 1: the header must start with kind,order_number"
                             f"{_other_separator(header)}")
    fields = header[2:]
    for name in fields:
        if not any(name in SHOP_FIELDS[kind] for kind in KINDS):
            raise UnreadableFile(f"line 1: {_not_the_shops(KINDS[0], name)}")
    if len(set(fields)) != len(fields):
        raise UnreadableFile("line 1: a field is named twice")
    while True:
        line = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as broken:
            # The reader goes on at the next line: the rows after it are read.
            yield Row(line, problem=_not_csv(broken))
            continue
        if not any(cell.strip() for cell in cells):
            continue
        if len(cells) != len(header):
            yield Row(line, problem=f"{len(cells)} values for the header's {len(header)} "
                                    "columns")
            continue
        kind, order_number = cells[0].strip(), cells[1].strip()
        given = {name: value for name, value in zip(fields, cells[2:])
                 # A column the row's kind does not have is left empty by it.
                 if name in SHOP_FIELDS.get(kind.lower(), ()) or value.strip()}
        yield _checked(line, kind, order_number, given, cells=True)


def _other_separator(header: list[str]) -> str:
    """The header split by another separator, named: a spreadsheet where the decimal mark
    is a comma exports its "CSV" with semicolons."""
    for separator, called in ((";", "semicolons"), ("\t", "tabs")):
        if len(header) == 1 and [name.strip() for name in
                                 header[0].split(separator)][:2] == ["kind", "order_number"]:
            return (f": its columns are separated by {called}, not commas (a spreadsheet's "
                    "export where the decimal mark is a comma); export it with commas")
    return ""


def _not_csv(broken: csv.Error) -> str:
    if "field larger than field limit" in str(broken):
        return (f"a cell longer than {csv.field_size_limit()} characters (no field holds "
                f"more than {MAX_TEXT_LENGTH})")
    return f"not CSV: {broken}"


@dataclasses.dataclass
class Imported:
    created: int = 0
    updated: int = 0
    unchanged: int = 0
    # (line, why) of each row not stored, in the file's order.
    bad: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    due: int = 0
    # (line, what changed) of each paid order whose amounts were changed (--amend-paid).
    amended: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    def add(self, other: "Imported") -> None:
        for name in ("created", "updated", "unchanged", "due"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.bad += other.bad
        self.amended += other.amended


async def import_rows(ctx: EngineContext, rows: list[Row],
                      progress: Callable[[int, int | None], None], source: str,
                      amend_paid: bool = False, dry_run: bool = False) -> Imported:
    """Store the good rows of a file, IMPORT_BATCH to a unit of work; the bad ones are
    counted with their line and reason. `source` names the file in the orders' history
    (`import orders.csv line 4`); `amend_paid` changes a paid order's MONEY_FIELDS;
    `dry_run`: each row stored to count what it does, then undone, nothing kept.
    `progress(stored, of)` after each batch."""
    good = [row for row in rows if row.order is not None]
    counts = Imported(bad=[(row.line, row.problem) for row in rows if row.problem is not None])
    progress(0, len(good))
    for start in range(0, len(good), IMPORT_BATCH):
        batch = good[start:start + IMPORT_BATCH]
        stored = await ctx.db(functools.partial(store_rows, Transaction(ctx), batch,
                                                ctx.clock(), source, amend_paid, dry_run))
        counts.add(stored)
        progress(start + len(batch), len(good))
    counts.bad.sort()
    counts.amended.sort()
    if counts.due and not dry_run:
        run_waiting_calls(ctx)
    return counts


class _Undone(Exception):
    """A dry run's row, stored to count what it does: its savepoint undoes it."""


def store_rows(tx: Transaction, rows: list[Row], now: datetime.datetime, source: str,
               amend_paid: bool = False, dry_run: bool = False) -> Imported:
    """Store the good rows of a batch, each alone (a unit of work): one refused (a number
    of another kind, a paid order's amounts without `amend_paid`) is a bad row, the
    others are stored; in a `dry_run`, counted as stored and undone, each in its
    savepoint, so that what the database would refuse is refused as it would be."""
    counts = Imported()
    for row in rows:
        assert row.order is not None
        try:
            with tx.savepoint():
                stored = store(tx, row.order, now, f"import {source} line {row.line}",
                               amend_paid)
                if dry_run:
                    raise _Undone
        except _Undone:
            pass  # counted below as it would have been stored
        except OtherKind as other:
            counts.bad.append((row.line, str(other)))
            continue
        except PaidOrder as paid:
            counts.bad.append((row.line, f"{paid}; --amend-paid changes a paid order's "
                                         f"{', '.join(MONEY_FIELDS)}"))
            continue
        if stored.amended_paid:
            counts.amended.append((row.line, f"order {row.order.order_number} is paid; "
                                             f"changed as asked: {changes_text(stored.changes)}"))
        setattr(counts, stored.outcome, getattr(counts, stored.outcome) + 1)
        counts.due += stored.due
    return counts
