"""Crypto payments (SHKeeper invoice callbacks, BEHAVIOUR.md 4.3, 2.4, 2.5).

Reading a callback: amounts are Decimal end to end (strings or JSON numbers, every digit
kept), fiat amounts are kept in their currency's ISO 4217 minor unit (domain.money),
rounded half up, the order type comes from the order number's prefix. Recording a paid
one: the treasury job and the ledger entries are written together in a savepoint, then
the order's payment is completed. Its times are SHKeeper's: each entry is acquired when
SHKeeper stored its transaction, the order paid when it stored the newest one, whenever
the callback is handled; without a date SHKeeper wrote, when the callback reached us.

Callbacks may come in any order (SHKeeper re-sends, the spool, a retry), and one may list
no transaction (the fallback txid). Every callback lists the invoice's transactions so
far, so the invoice's state is its longest listing (`listing_version` places each
callback among its invoice's; the inbox hands them over in that order and one older than
a listing handled already is history: recorded, nothing done). A callback handled is
then the newest listing seen, and the ledger, the job and the order's amount are that
listing's: its transactions' entries (replacing the order's fallback entry, each entry's
status the listing's), the order's amount their sum. The job takes a callback's amounts
only when they are not older than its own (one that lists transactions over one that
does not; else the larger balance). The order's payment is one whatever callback
completes it: no second payment for the same coins.
"""
import dataclasses
import datetime
import decimal
import hashlib
import logging
import re
from typing import Any

from models import OrderBase
from engine.contracts import EngineContext
from engine.payload import exact_json
from engine.transaction import LedgerFields, OrderRef, Refused, Transaction
from domain.money import Money, minor_units
from domain.orders import (CRYPTO_REFERENCE, CRYPTO_SOURCE, OrderNotFound,
                           complete_payment, email_admin, order_name_of_any_kind,
                           order_type_of)

log = logging.getLogger("receiver.crypto")

PROVIDER = "crypto-processor"

PAID_STATUSES = ("PAID", "OVERPAID")
# An invoice naming no fiat currency is in SHKeeper's default.
DEFAULT_FIAT = "USD"
# The fallback txid's start (`crypto-<coin>-<epoch ms>`), and so its reference's.
FALLBACK_TXID = "crypto-"
# Wider than any coin's precision or any invoice; anything beyond is not a payment.
MAX_DECIMAL_PLACES = 30
MAX_AMOUNT = decimal.Decimal(10) ** 15
MAX_EXTERNAL_ID_LENGTH = 200
MAX_TXID_LENGTH = 256
# SHKeeper's statuses are short words (PAID, PARTIAL, ...); the status is the event's type
# and part of its dedup key, both indexed.
MAX_STATUS_LENGTH = 64
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
# A transaction's `date` as SHKeeper writes it: `str()` of its Transaction.created_at,
# which SQLite's CURRENT_TIMESTAMP filled in, in UTC and without a zone
# ("2026-11-20 09:00:12"; `str()` adds microseconds to a time that has them).
SHKEEPER_DATE = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(\.\d{6})?")


class MalformedCallback(ValueError):
    """The callback cannot be read as an invoice callback; the message says why."""


def read(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object whose numbers are Decimal, or MalformedCallback."""
    try:
        body = exact_json(raw)
    except ValueError:
        raise MalformedCallback("body is not JSON") from None
    if not isinstance(body, dict):
        raise MalformedCallback("body is not a JSON object")
    return body


def external_id_of(body: dict[str, Any]) -> str | None:
    """The order number, or None when the callback names none (BEHAVIOUR.md 4.3 rule 2)."""
    value = body.get("external_id")
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise MalformedCallback(f"external_id is not a string: {_shown(value)}")
    value = str(value).strip()
    if len(value) > MAX_EXTERNAL_ID_LENGTH or not value.isprintable():
        raise MalformedCallback(f"external_id is not an order number: {_shown(value)}")
    return value or None


def claims_paid(body: object) -> bool:
    """Whether a (possibly malformed) callback says the invoice is paid."""
    return isinstance(body, dict) and (
        body.get("paid") is True or body.get("status") in PAID_STATUSES)


def amount(body: dict[str, Any], field: str) -> decimal.Decimal:
    """A non-negative finite Decimal from a string or JSON number; absent is 0."""
    value = body.get(field)
    if value is None:
        return decimal.Decimal(0)
    if isinstance(value, bool) or not isinstance(value, (str, int, decimal.Decimal)):
        raise MalformedCallback(f"{field} is not a number: {_shown(value)}")
    try:
        number = decimal.Decimal(value.strip() if isinstance(value, str) else value)
    except decimal.InvalidOperation:
        raise MalformedCallback(f"{field} is not a number: {_shown(value)}") from None
    if not number.is_finite() or number < 0:
        raise MalformedCallback(f"{field} is not an amount: {_shown(value)}")
    places = -int(number.as_tuple().exponent)  # finite: the exponent is a number
    if number >= MAX_AMOUNT or places > MAX_DECIMAL_PLACES:
        raise MalformedCallback(f"{field} is out of range: {_shown(value)}")
    return number


def _told(body: dict[str, Any], field: str) -> decimal.Decimal:
    """An amount that only informs a notice (SHKeeper's fee, its overpaid measure): one
    that cannot be read is taken for 0, and the payment is not refused for it."""
    try:
        return amount(body, field)
    except MalformedCallback as unreadable:
        log.warning("crypto callback for %r: %s; taken for 0", body.get("external_id"),
                    unreadable)
        return decimal.Decimal(0)


def _text(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise MalformedCallback(f"{field} is not a string: {_shown(value)}")
    if not value.isprintable():
        # Control characters (NUL above all, which PostgreSQL cannot store) are no data.
        raise MalformedCallback(f"{field} is not printable text: {_shown(value)}")
    return value.strip()


@dataclasses.dataclass(frozen=True)
class InvoiceTransaction:
    """One transaction of the invoice, as SHKeeper lists it in every callback: its own
    coin and fiat amounts, the fiat split into what we keep and SHKeeper's fee."""

    txid: str
    coin: str
    amount_coin: decimal.Decimal
    amount_fiat: decimal.Decimal
    fee_fiat: decimal.Decimal
    # When SHKeeper stored it, as it writes it (SHKEEPER_DATE, UTC): text that sorts as
    # time among one invoice's transactions.
    date: str = ""

    @classmethod
    def parse(cls, item: dict[str, Any], invoice_coin: str) -> "InvoiceTransaction":
        txid = _text(item, "txid")
        if len(txid) > MAX_TXID_LENGTH:
            raise MalformedCallback("a transaction's txid is too long")
        return cls(txid=txid, coin=_text(item, "crypto").upper() or invoice_coin,
                   amount_coin=amount(item, "amount_crypto"),
                   amount_fiat=amount(item, "amount_fiat"),
                   fee_fiat=amount(item, "fee_fiat"), date=_text(item, "date"))

    def stored_at(self, arrived_at: datetime.datetime) -> datetime.datetime:
        """When SHKeeper stored the transaction (its `date`), as aware UTC. A date not
        written as SHKeeper writes it, or none (the fallback's), or one later than the
        callback's arrival (SHKeeper's clock ahead of ours: no transaction is stored
        after the callback listing it reached us) gives that arrival instead."""
        if not SHKEEPER_DATE.fullmatch(self.date):
            return arrived_at
        try:
            stored = datetime.datetime.fromisoformat(self.date)
        except ValueError:  # shaped like a date, yet none: a 31st of November
            return arrived_at
        return min(stored.replace(tzinfo=datetime.timezone.utc), arrived_at)


def _transactions(body: dict[str, Any],
                  invoice_coin: str) -> tuple[InvoiceTransaction, ...]:
    transactions = body.get("transactions")
    if transactions is None:
        return ()
    if not isinstance(transactions, list) or not all(isinstance(t, dict) for t in transactions):
        raise MalformedCallback("transactions is not a list of objects")
    return tuple(InvoiceTransaction.parse(item, invoice_coin) for item in transactions)


def _shown(value: object) -> str:
    """A bad value as it goes into a log line, last_error and the admin's e-mail."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True)
class Callback:
    """An invoice callback (or an `unconfirmed` notice), read and checked."""

    external_id: str
    status: str
    paid: bool
    coin: str
    fiat: str
    amount_coin: decimal.Decimal
    amount_fiat: decimal.Decimal
    transactions: tuple[InvoiceTransaction, ...]
    notice_txid: str
    # SHKeeper's fee (percent of the invoice, on top of it) and what it counts as paid
    # beyond its upper limit; 0 when not sent.
    fee_percent: decimal.Decimal = decimal.Decimal(0)
    overpaid_fiat: decimal.Decimal = decimal.Decimal(0)
    # The kind of the order stored under external_id (`routed`); None: not looked up, or
    # no such order.
    stored_kind: str | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> "Callback":
        external_id = external_id_of(body)
        if external_id is None:
            raise MalformedCallback("no external_id")
        paid = body.get("paid", False)
        if not isinstance(paid, bool):
            raise MalformedCallback(f"paid is not true or false: {_shown(paid)}")
        status = _text(body, "status")
        if len(status) > MAX_STATUS_LENGTH:
            raise MalformedCallback(f"status is too long: {_shown(status)}")
        notice_txid = _text(body, "txid")
        if len(notice_txid) > MAX_TXID_LENGTH:
            raise MalformedCallback("txid is too long")
        coin = _text(body, "crypto").upper() or "UNKNOWN"
        return cls(
            external_id=external_id, status=status, paid=paid,
            coin=coin, fiat=_text(body, "fiat").upper(),
            # An `unconfirmed` notice names its coin amount `amount`.
            amount_coin=amount(body, "balance_crypto" if "balance_crypto" in body else "amount"),
            amount_fiat=amount(body, "balance_fiat"),
            transactions=_transactions(body, coin), notice_txid=notice_txid,
            fee_percent=_told(body, "fee_percent"),
            overpaid_fiat=_told(body, "overpaid_fiat"))

    @property
    def txids(self) -> tuple[str, ...]:
        return tuple(transaction.txid for transaction in self.transactions)

    @property
    def to_be_processed(self) -> bool:
        return self.paid and self.status in PAID_STATUSES

    @property
    def order_type(self) -> str:
        """The kind of the callback's order: the stored order's; the prefix rule's
        (domain.orders.order_type_of) only for an order we do not have."""
        return self.stored_kind or order_type_of(self.external_id)

    def routed(self, tx: Transaction) -> "Callback":
        """The callback with the kind of the order stored under its number, when there is
        one: a number without its kind's prefix (a shop writing the tables, an order from
        before intake checked prefixes) is still that order's. A part that may fail
        alone: the receipt is recorded before the order is completed (BEHAVIOUR.md 4.3),
        so an order table the database refuses leaves the prefix's kind, and the
        completion's failure, as it was."""
        found = None
        with tx.apart(f"crypto callback for {self.external_id}: the kind of its order not "
                      "read, its prefix's taken"):
            found = order_name_of_any_kind(tx, self.external_id)
        return self if found is None else dataclasses.replace(self, stored_kind=found[0])

    @property
    def fiat_currency(self) -> str:
        return self.fiat or DEFAULT_FIAT

    def fiat_minor(self, amount_fiat: decimal.Decimal) -> int:
        """`amount_fiat` in the minor unit of the invoice's currency (ISO 4217)."""
        return minor_units(amount_fiat, self.fiat_currency)

    def usd_cents(self, amount_fiat: decimal.Decimal) -> int | None:
        """`amount_fiat` in USD cents when the invoice is in USD; None when it is not
        (no amount in another currency is recorded as USD)."""
        return self.fiat_minor(amount_fiat) if self.fiat_currency == "USD" else None

    @property
    def balance(self) -> Money:
        """The invoice's fiat balance as Money."""
        return Money.of_decimal(self.amount_fiat, self.fiat_currency)

    @property
    def net_fiat(self) -> decimal.Decimal:
        """What the invoice received less SHKeeper's fee: the transactions' own amounts
        without their fees when they give their fees, else the balance less the fee
        percentage it was charged on top."""
        listed = [t for t in self.transactions if t.txid]
        if listed and any(t.fee_fiat for t in listed):
            return sum((t.amount_fiat - t.fee_fiat for t in listed), decimal.Decimal(0))
        return self.amount_fiat / (1 + self.fee_percent / 100)

    @property
    def listed(self) -> bool:
        """Whether the callback lists the invoice's transactions (else the fallback txid
        stands for them)."""
        return any(self.txids)

    def txid(self, arrived_at: datetime.datetime) -> str:
        """transactions[0].txid, or `crypto-<coin>-<epoch ms>` of the callback's arrival."""
        if self.txids and self.txids[0]:
            return self.txids[0]
        epoch_ms = (arrived_at - EPOCH) // datetime.timedelta(milliseconds=1)
        return f"{FALLBACK_TXID}{self.coin}-{epoch_ms}"

    def dedup_key(self) -> str:
        """One key per state of the invoice: SHKeeper's re-sends (every 60 s until it
        gets 202) carry the same state and are one event; a PAID after a PARTIAL, or an
        OVERPAID after a PAID, differs in status or transactions and is a new one."""
        state = "|".join([self.status, str(self.paid), *sorted(self.txids), self.notice_txid])
        digest = hashlib.sha256(state.encode("utf-8")).hexdigest()[:32]
        return f"{self.external_id}:{self.status or '-'}:{digest}"

    @property
    def version(self) -> str:
        """Its place among its invoice's callbacks (plugins.crypto): how many transactions
        it lists, zero-padded, then the newest one's date. The list only grows, so a
        callback listing more is newer, whatever order the callbacks arrive in; one
        listing none (the fallback txid) is older than any that lists some."""
        listed = [transaction for transaction in self.transactions if transaction.txid]
        newest = max((transaction.date for transaction in listed), default="")
        return f"{len(listed):06d}|{newest}"

    def received_amount(self, arrived_at: datetime.datetime) -> Money:
        """What the ledger records of the invoice: its entries' fiat amounts (`received`),
        each in minor units, summed."""
        return Money.of(sum(self.fiat_minor(transaction.amount_fiat)
                            for transaction in self.received(arrived_at)), self.fiat_currency)

    def paid_at(self, arrived_at: datetime.datetime) -> datetime.datetime:
        """When the invoice was paid, as SHKeeper tells it: the newest received
        transaction's time (`stored_at`), for a PAID callback the transaction that paid
        it; for a callback listing none, its arrival."""
        return max(transaction.stored_at(arrived_at)
                   for transaction in self.received(arrived_at))

    def received(self, arrived_at: datetime.datetime) -> tuple[InvoiceTransaction, ...]:
        """The transactions the ledger records: every one listed with a txid (SHKeeper
        lists the invoice's whole history, oldest first). A callback that lists none is
        recorded as one receipt of the invoice's balance under the fallback txid."""
        listed = tuple(transaction for transaction in self.transactions if transaction.txid)
        if listed:
            return listed
        return (InvoiceTransaction(txid=self.txid(arrived_at), coin=self.coin,
                            amount_coin=self.amount_coin, amount_fiat=self.amount_fiat,
                            fee_fiat=decimal.Decimal(0)),)


def receive_payment(ctx: EngineContext, payload: dict[str, Any], tx: Transaction) -> None:
    """PAID and OVERPAID: record the treasury job and ledger entries, then complete the
    payment (with what the ledger records, the invoice's coins and SHKeeper's time of
    the newest transaction, `Callback.paid_at`), and tell the
    administrator of an invoice paid more or less than expected. A callback older than a
    listing handled already is history; anything else, or paid not true, is only logged
    (BEHAVIOUR.md 4.3 rules 3 and 10)."""
    callback = Callback.parse(payload)
    if history(tx, callback):
        return
    callback = callback.routed(tx)
    if not callback.to_be_processed:
        log.info("crypto %s callback for %s with paid=%s: logged only",
                 callback.status, callback.external_id, callback.paid)
        return
    arrival = arrived_at(ctx, tx)
    reference = CRYPTO_REFERENCE + callback.txid(arrival)
    received = callback.received_amount(arrival)
    coins = f"{callback.amount_coin} {callback.coin}"
    record_receipt(ctx, tx, callback, arrival)
    try:
        with tx.undone_on_failure():
            order, newly_paid = complete_payment(
                ctx, tx, callback.external_id, callback.order_type, reference,
                source=CRYPTO_SOURCE, payment_method="crypto", amount=received, coins=coins,
                paid_at=callback.paid_at(arrival))
    except OrderNotFound as missing:
        # The coins arrived: their treasury job and ledger entry stay recorded, and only
        # the completion is tried again.
        tx.retry_later(f"payment not completed: {type(missing).__name__}: {missing}")
        return
    except Refused as refused:
        tx.retry_later(f"payment not completed: {refused}")
        return
    if not newly_paid and (order.stripe_session_id or "").startswith(CRYPTO_REFERENCE):
        follow_listing(ctx, tx, callback, order, reference, received, coins)
    tell_other_currency(ctx, tx, callback, order)
    tell_mispaid(ctx, tx, callback, order)


def history(tx: Transaction, callback: Callback) -> bool:
    """Whether the callback lists less than one of its invoice handled already (the
    inbox's `overtaken_by`): it is then kept as history, and nothing is sent."""
    newer = tx.overtaken_by
    if newer is None:
        return False
    tx.record_only(f"an older listing of the invoice ({len(callback.txids)} transactions) "
                   f"than the one handled as event #{newer.id} ({newer.event_type}): "
                   "recorded, nothing done")
    return True


def follow_listing(ctx: EngineContext, tx: Transaction, callback: Callback, order: OrderBase,
                   reference: str, received: Money, coins: str) -> None:
    """An order whose crypto payment a callback completed already takes this newer
    listing: its amount is what the ledger now records (the alert says so when it
    changes), and a reference from the fallback txid becomes the invoice's first
    transaction's, as it would have been from the start."""
    was = Money.of(order.payment_amount, order.payment_currency) \
        if order.payment_amount is not None else None
    renamed = callback.listed and (order.stripe_session_id or "").startswith(
        CRYPTO_REFERENCE + FALLBACK_TXID)
    if was == received and not renamed:
        return
    if renamed:
        order.stripe_session_id = reference
    order.payment_amount, order.payment_currency = received.minor, received.currency
    order.updated_at = ctx.clock()
    tx.save(order)
    if was is not None and was != received:
        log.info("crypto payment of %s is now %s, was %s", callback.external_id, received,
                 was)
        tx.alert(f"Crypto payment for order {callback.external_id} is now {received}, "
                 f"was {was} ({coins}, {callback.status})",
                 key=f"alert-crypto-amount-{callback.order_type}-{callback.external_id}-"
                     f"{received.currency}-{received.minor}",
                 order_number=callback.external_id)


def tell_mispaid(ctx: EngineContext, tx: Transaction, callback: Callback,
                 order: OrderBase) -> None:
    """An invoice paid past CRYPTO_PAYMENT_TOLERANCE_PERCENT more or less than expected is
    told to the administrator, once per order and way. Expected: the order's total
    (total_cents, in the minor unit of the order's currency), against what the invoice
    received less SHKeeper's fee, when the invoice is in that currency; otherwise
    (no total, or an invoice in another currency), SHKeeper's own measure,
    `overpaid_fiat` (paid beyond its upper limit), against the rest of the balance."""
    tolerance = ctx.settings.crypto_payment_tolerance_percent
    total = _total_in(order, callback.fiat_currency)
    by_total = total is not None
    if total is not None:
        expected = total.amount
        received = callback.net_fiat
    elif callback.overpaid_fiat > 0:
        expected = callback.amount_fiat - callback.overpaid_fiat
        received = callback.amount_fiat
    else:
        return
    if expected <= 0:
        return
    share = (received - expected) / expected * 100
    if abs(share) <= tolerance:
        return
    way = "overpaid" if share > 0 else "underpaid"
    shown = abs(share).quantize(decimal.Decimal("0.1"))
    currency = callback.fiat_currency
    log.warning("crypto invoice %s %s by %s %%", callback.external_id, way, shown)
    email_admin(ctx, tx, f"Crypto invoice for order {callback.external_id} {way} by "
                f"{shown} %", "crypto_mispaid", callback.external_id,
                key=f"email-crypto-{way}-{callback.external_id}", way=way, share=shown,
                tolerance=tolerance, status=callback.status,
                expected=str(Money.of_decimal(expected, currency)),
                received=str(Money.of_decimal(received, currency)),
                balance=str(callback.balance),
                overpaid=str(Money.of_decimal(callback.overpaid_fiat, currency)),
                coins=f"{callback.amount_coin} {callback.coin}", by_total=by_total)


def orders_of(payload: dict[str, Any]) -> tuple[OrderRef, ...]:
    """The order `receive_payment` completes: the kinds of the orders of its number (read
    to route it, `Callback.routed`) and the order of the kind its prefix names; none when
    the callback is only logged."""
    callback = Callback.parse(payload)
    if not callback.to_be_processed:
        return ()
    return (OrderRef(None, callback.external_id),
            OrderRef(callback.order_type, callback.external_id))


def tell_other_currency(ctx: EngineContext, tx: Transaction, callback: Callback,
                        order: OrderBase) -> None:
    """An invoice in another currency than its order's price: its amount cannot be set
    against the order's total, and a person must look. One in the order's own currency
    is the normal case, whatever that currency (most orders of a CRTC shop are in CAD).
    Once per order (the mail's key)."""
    priced_in = _priced_in(order)
    if callback.fiat_currency == priced_in:
        return
    log.warning("crypto invoice %s is in %s; its order is priced in %s",
                callback.external_id, callback.fiat_currency, priced_in)
    email_admin(ctx, tx, f"Crypto invoice for order {callback.external_id} is in "
                f"{callback.fiat_currency}; the order is priced in {priced_in}",
                "crypto_other_currency", callback.external_id,
                key=f"email-crypto-other-currency-{callback.external_id}",
                currency=callback.fiat_currency, order_currency=priced_in,
                amount=f"{callback.amount_fiat} {callback.fiat_currency}",
                amount_coin=f"{callback.amount_coin} {callback.coin}")


def log_notice(ctx: EngineContext, payload: dict[str, Any], tx: Transaction) -> None:
    """`unconfirmed` notices: kept in the inbox, logged, no more."""
    _log_notice(Callback.parse(payload))


def _log_notice(callback: Callback) -> None:
    log.info("crypto %s notice for %s: %s %s (%s %s), transactions %s; nothing to do yet",
             callback.status, callback.external_id, callback.amount_coin, callback.coin,
             callback.amount_fiat, callback.fiat,
             ", ".join(filter(None, (*callback.txids, callback.notice_txid))) or "none")


def receive_partial(ctx: EngineContext, payload: dict[str, Any], tx: Transaction) -> None:
    """PARTIAL: kept and logged, the order waits for the rest; history when older than a
    listing handled already. One whose transactions already pay the invoice is told to
    the administrator (`tell_partial_covered`)."""
    callback = Callback.parse(payload)
    if history(tx, callback):
        return
    _log_notice(callback)
    tell_partial_covered(ctx, tx, callback.routed(tx))


def listed_net(callback: Callback) -> decimal.Decimal:
    """What the listed transactions paid less SHKeeper's fee: their own amounts without
    their fees when they give them, else their sum less the fee percentage."""
    listed = [t for t in callback.transactions if t.txid]
    if any(t.fee_fiat for t in listed):
        return sum((t.amount_fiat - t.fee_fiat for t in listed), decimal.Decimal(0))
    return sum((t.amount_fiat for t in listed), decimal.Decimal(0)) / (
        1 + callback.fee_percent / 100)


def _priced_in(order: OrderBase) -> str:
    """The currency of the order's price: its own, USD for a kind that has none."""
    return getattr(order, "currency", None) or "USD"


def _total_in(order: OrderBase, currency: str) -> Money | None:
    """The order's total when it has one in `currency`."""
    total = getattr(order, "total_cents", None)
    priced_in = _priced_in(order)
    if not total or Money.of(0, priced_in).currency != Money.of(0, currency).currency:
        return None
    return Money.of(total, priced_in)


def tell_partial_covered(ctx: EngineContext, tx: Transaction, callback: Callback) -> None:
    """A PARTIAL callback whose listed transactions already pay the invoice: SHKeeper
    counts a balance short of them when it took several transactions at once, and then
    never calls again, so the order would wait for ever. Told once per order. The
    invoice's amount is not in the callback: against the order's total (within
    CRYPTO_PAYMENT_TOLERANCE_PERCENT, less SHKeeper's fee) when it has one in the
    invoice's currency; else when the transactions add up to more than the balance
    SHKeeper counts. Before the order is known, the callback is tried again."""
    if not callback.listed:
        return
    order = tx.order(callback.order_type, callback.external_id)
    if order is None:
        # Its total decides, and the order comes later: looked at again then.
        tx.retry_later(f"PARTIAL listing not checked: no {callback.order_type} order "
                       f"{callback.external_id}")
        return
    currency = callback.fiat_currency
    expected = _total_in(order, currency)
    listed = sum((t.amount_fiat for t in callback.transactions if t.txid), decimal.Decimal(0))
    if expected is not None:
        short_by = decimal.Decimal(ctx.settings.crypto_payment_tolerance_percent) / 100
        if listed_net(callback) < expected.amount * (1 - short_by):
            return
    elif listed <= callback.amount_fiat:
        return
    log.warning("crypto invoice %s is PARTIAL, its %s transactions pay it", callback.external_id,
                len(callback.txids))
    email_admin(ctx, tx, f"Crypto invoice for order {callback.external_id} is paid, "
                "SHKeeper says PARTIAL", "crypto_partial_paid", callback.external_id,
                key=f"email-crypto-partial-paid-{callback.external_id}",
                listed=str(Money.of_decimal(listed, currency)),
                net=str(Money.of_decimal(listed_net(callback), currency)),
                balance=str(callback.balance), expected=expected and str(expected),
                transactions=", ".join(callback.txids),
                coins=f"{callback.amount_coin} {callback.coin}")


def arrived_at(ctx: EngineContext, tx: Transaction) -> datetime.datetime:
    """When the callback was first stored: the fallback txid built from it is then the
    same on every retry of the event, so a retry cannot add a second ledger entry."""
    return tx.event.received_at if tx.event else ctx.clock()


def record_receipt(ctx: EngineContext, tx: Transaction, callback: Callback,
                   arrival: datetime.datetime) -> bool:
    """Write the treasury job and a ledger entry per received transaction together, as a
    part that may fail alone: the transactions listed replace the order's fallback entry;
    a callback listing none writes (or updates) that entry. A failure is logged, the
    enclosing transaction goes on (BEHAVIOUR.md 4.3 rule 6) and False is returned; a
    deadlock with another process is no failure of ours: the whole unit is run again."""
    txid = callback.txid(arrival)
    with tx.apart(f"crypto payment {txid} for {callback.external_id}: treasury job / "
                  "ledger entry not written") as part:
        _save_treasury_job(ctx, tx, callback, txid)
        if callback.listed:
            tx.drop_ledger_entry(fallback_key(callback.external_id))
            for transaction in callback.received(arrival):
                _add_ledger_entry(ctx, tx, callback, transaction, arrival)
        else:
            _save_fallback_entry(ctx, tx, callback, callback.received(arrival)[0], arrival)
    return not part.failed


def _save_treasury_job(ctx: EngineContext, tx: Transaction, callback: Callback,
                       txid: str) -> None:
    """One job per order. While it is still `received` its amounts (and key) follow the
    newest state of the invoice its callbacks showed, whatever order they came in
    (`_not_older`); once the settlement worker has taken it further it is left as it is."""
    tx.save_treasury_job(
        order_id=callback.external_id, order_type=callback.order_type,
        coin=callback.coin, amount_coin=callback.amount_coin,
        fiat_currency=callback.fiat_currency,
        amount_fiat_cents=callback.fiat_minor(callback.amount_fiat),
        amount_usd_cents=callback.usd_cents(callback.amount_fiat),
        idempotency_key=f"crypto-settle:{callback.external_id}:{txid}",
        fallback=not callback.listed, at=ctx.clock())


def ledger_key(order_id: str, txid: str) -> str:
    """One entry per order and transaction: a later callback of the same invoice lists the
    transaction again and adds nothing, while one transaction paying several invoices (an
    exchange's batch payout: SHKeeper lists the same txid in each) is an entry for each."""
    return f"{PROVIDER}:{order_id}:{txid}"


def fallback_key(order_id: str) -> str:
    """The key of the order's one fallback entry (a callback listing no transaction):
    a later such callback updates it, one listing transactions replaces it."""
    return f"{PROVIDER}:{order_id}:fallback"


def _add_ledger_entry(ctx: EngineContext, tx: Transaction, callback: Callback,
                      transaction: InvoiceTransaction, arrival: datetime.datetime) -> None:
    """One entry per transaction of the order (`ledger_key`): the entries of an order sum
    to the invoice. An entry already recorded (an earlier listing had it) takes this
    listing's status, and keeps its acquired_at: the callback handled is the newest
    listing of its invoice, and the transaction's time is SHKeeper's in every listing."""
    tx.save_ledger_entry(_entry(ctx, callback, transaction, ledger_key(
        callback.external_id, transaction.txid), fallback=False, arrival=arrival))


def _save_fallback_entry(ctx: EngineContext, tx: Transaction, callback: Callback,
                         transaction: InvoiceTransaction, arrival: datetime.datetime) -> None:
    """The order's fallback entry: the invoice's balance under the fallback txid, written
    unless an entry of a listed transaction is stored, updated to a larger balance (and
    the arrival of the callback that told it)."""
    tx.save_fallback_entry(_entry(ctx, callback, transaction,
                                  fallback_key(callback.external_id), fallback=True,
                                  arrival=arrival))


def _entry(ctx: EngineContext, callback: Callback, transaction: InvoiceTransaction,
           key: str, fallback: bool, arrival: datetime.datetime) -> LedgerFields:
    """The entry's columns; acquired_at is when SHKeeper stored the transaction (the
    callback's arrival for the fallback entry), not when the callback is handled."""
    now = ctx.clock()
    return LedgerFields(
        order_id=callback.external_id, order_type=callback.order_type, coin=transaction.coin,
        movement_type="receive", amount_coin=transaction.amount_coin,
        fiat_currency=callback.fiat_currency,
        amount_fiat_cents=callback.fiat_minor(transaction.amount_fiat),
        amount_usd_cents=callback.usd_cents(transaction.amount_fiat), provider=PROVIDER,
        provider_ref=transaction.txid, provider_status=callback.status, state="confirmed",
        idempotency_key=key, fallback=fallback, acquired_at=transaction.stored_at(arrival),
        notes=(f"{callback.status}: received {transaction.amount_coin} {transaction.coin} "
               f"({transaction.amount_fiat} {callback.fiat_currency}, "
               f"fee {transaction.fee_fiat})"),
        created_at=now, updated_at=now)
