"""Peewee models: every table, in one module as the design card fixes (it is longer than
the others for that reason). The table and column names marked as other systems' are
relied on by them: the workflow system and the worker read and write the order tables.

One Database is chosen at start-up from DATABASE_URL by `open_database`; models are
bound to it through a proxy. Times are stored as timezone-aware UTC, money as integer
cents, coin amounts as exact decimals (every digit kept, on SQLite too).
"""
import datetime
import decimal
import os

from peewee import (
    BigIntegerField, BooleanField, DatabaseProxy, DateTimeField, Field,
    ForeignKeyField, IntegerField, InterfaceError, Model, OperationalError,
    PostgresqlDatabase, SQL, SqliteDatabase, TextField,
)
from playhouse.db_url import parse
from playhouse.shortcuts import ReconnectMixin

database = DatabaseProxy()

UTC = datetime.timezone.utc

# Our two custom column kinds, spelled per database: PostgreSQL keeps time zones and
# arbitrary-precision numerics natively; SQLite keeps text so no digit is lost.
POSTGRES_FIELD_TYPES = {"UTCDATETIME": "TIMESTAMPTZ", "EXACTDECIMAL": "NUMERIC"}
SQLITE_FIELD_TYPES = {"UTCDATETIME": "DATETIME", "EXACTDECIMAL": "TEXT"}


def utcnow():
    return datetime.datetime.now(UTC)


class UTCDateTimeField(DateTimeField):
    """A timezone-aware UTC timestamp; naive values read from the database are UTC."""

    field_type = "UTCDATETIME"

    def db_value(self, value):
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.datetime.fromisoformat(value)
        if value.tzinfo is None:
            raise ValueError(f"{self.name}: refusing a naive datetime {value!r}")
        return value.astimezone(UTC).isoformat(sep=" ", timespec="microseconds")

    def python_value(self, value):
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.datetime.fromisoformat(value)
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class ExactDecimalField(Field):
    """A Decimal stored without rounding (NUMERIC on PostgreSQL, TEXT on SQLite)."""

    field_type = "EXACTDECIMAL"

    def db_value(self, value):
        if value is None:
            return None
        return format(decimal.Decimal(value), "f")

    def python_value(self, value):
        if value is None:
            return None
        return decimal.Decimal(str(value))


class ReconnectingPostgresqlDatabase(ReconnectMixin, PostgresqlDatabase):
    """Reconnects once when PostgreSQL dropped the connection (restart, failover)."""

    # psycopg2's words for a connection that is gone (ReconnectMixin only knows MySQL's).
    reconnect_errors = (
        (OperationalError, "server closed the connection"),
        (OperationalError, "could not connect"),
        (OperationalError, "connection to server"),
        (OperationalError, "terminating connection"),
        (InterfaceError, "connection already closed"),
    )


def open_database(url):
    """Create the Database for `url` (sqlite:///path or postgresql://...) and bind the models."""
    parsed = parse(url)
    scheme = url.split(":", 1)[0]
    if scheme == "sqlite":
        path = parsed.pop("database")
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        db = SqliteDatabase(
            path,
            field_types=SQLITE_FIELD_TYPES,
            pragmas={
                "journal_mode": "wal",
                # An acknowledged webhook must survive a power cut, not only a crash.
                "synchronous": "full",
                "busy_timeout": 5000,
                "foreign_keys": 1,
            },
        )
    elif scheme in ("postgres", "postgresql"):
        parsed.setdefault("connect_timeout", 3)
        db = ReconnectingPostgresqlDatabase(field_types=POSTGRES_FIELD_TYPES, **parsed)
    else:
        raise ValueError(
            f"DATABASE_URL must start with sqlite:// or postgresql://, got {scheme}://")
    database.initialize(db)
    return db


def is_postgres(db=None):
    target = db or database.obj
    return isinstance(target, PostgresqlDatabase)


class BaseModel(Model):
    created_at = UTCDateTimeField(default=utcnow)
    updated_at = UTCDateTimeField(default=utcnow)

    class Meta:
        database = database
        legacy_table_names = False


def database_default(sql):
    """A DEFAULT clause in the table itself: a peewee `default` is applied by peewee alone,
    and other systems insert orders with plain SQL naming only some columns."""
    return [SQL(f"DEFAULT {sql}")]


class OrderBase(BaseModel):
    """Columns shared by the four order tables. Other systems insert rows with only some
    of them, so every column but order_number is nullable or has a database default
    (migration 0006 adds those defaults to tables created before they were declared)."""

    # SQLite's CURRENT_TIMESTAMP is UTC text without a zone ("2026-11-22 03:14:57"), which
    # UTCDateTimeField reads as UTC; PostgreSQL's is a TIMESTAMPTZ.
    created_at = UTCDateTimeField(default=utcnow, constraints=database_default("CURRENT_TIMESTAMP"))
    updated_at = UTCDateTimeField(default=utcnow, constraints=database_default("CURRENT_TIMESTAMP"))
    order_number = TextField(unique=True)
    payment_status = TextField(default="pending_payment",
                               constraints=database_default("'pending_payment'"))
    notes = TextField(default="", constraints=database_default("''"))
    stripe_session_id = TextField(null=True)
    stripe_payment_intent_id = TextField(null=True, index=True)
    customer_email = TextField(null=True)
    customer_name = TextField(null=True)
    service_name = TextField(null=True)
    paid_at = UTCDateTimeField(null=True)
    parent_order_number = TextField(null=True)
    discount_code = TextField(null=True)
    # The order's document name in the workflow system, as its webhooks last gave it;
    # null until one arrives (calls about the order then name it by its order number).
    order_name = TextField(null=True)

    kind = None

    def append_note(self, line):
        self.notes = f"{self.notes}\n{line}" if self.notes else line

    class Meta:
        # save() writes only the columns this instance changed, so two writers that change
        # different columns of one order (a webhook and the settlement job) both keep theirs.
        only_save_dirty = True


class FormationOrder(OrderBase):
    kind = "formation"

    class Meta:
        table_name = "formation_orders"


class ComplianceOrder(OrderBase):
    kind = "compliance"
    service_slug = TextField(null=True)
    stripe_subscription_id = TextField(null=True, index=True)
    subscription_status = TextField(null=True)
    cancelled_at = UTCDateTimeField(null=True)
    fulfillment_status = TextField(null=True)
    intake_reminders_sent = IntegerField(default=0, constraints=database_default("0"))
    intake_reminded_at = UTCDateTimeField(null=True)

    class Meta:
        table_name = "compliance_orders"


class BundleOrder(OrderBase):
    kind = "bundle"

    class Meta:
        table_name = "bundle_orders"


class CrtcOrder(OrderBase):
    kind = "canada_crtc"
    payment_method = TextField(null=True)
    funds_available = BooleanField(default=False, constraints=database_default("FALSE"))
    funds_available_at = UTCDateTimeField(null=True)
    total_cents = BigIntegerField(null=True)
    amb_annual_price_cents = BigIntegerField(null=True)
    # The commission holdback: set once by crtc/delivered; released (the worker job sent)
    # or forfeited (a dispute before the release, with the reason), never both.
    delivered_at = UTCDateTimeField(null=True)
    holdback_ends_at = UTCDateTimeField(null=True)
    commission_released_at = UTCDateTimeField(null=True)
    commission_forfeited_at = UTCDateTimeField(null=True)
    commission_forfeit_reason = TextField(null=True)

    class Meta:
        table_name = "crtc_orders"
        indexes = ((("payment_status", "funds_available", "paid_at"), False),)


ORDER_MODELS = {m.kind: m for m in (FormationOrder, ComplianceOrder, BundleOrder, CrtcOrder)}


class TreasuryJob(BaseModel):
    order_id = TextField(unique=True)
    order_type = TextField()
    state = TextField(default="received")
    coin = TextField()
    amount_coin = ExactDecimalField(default=decimal.Decimal(0))
    amount_usd_cents = BigIntegerField(default=0)
    idempotency_key = TextField()
    received_at = UTCDateTimeField(default=utcnow)

    class Meta:
        table_name = "treasury_jobs"


class LedgerEntry(BaseModel):
    order_id = TextField(index=True)
    order_type = TextField()
    coin = TextField()
    movement_type = TextField(default="receive")
    amount_coin = ExactDecimalField(default=decimal.Decimal(0))
    amount_usd_cents = BigIntegerField(default=0)
    provider = TextField()
    provider_ref = TextField()
    provider_status = TextField()
    state = TextField(default="confirmed")
    idempotency_key = TextField(unique=True)
    acquired_at = UTCDateTimeField(default=utcnow)
    notes = TextField(default="")

    class Meta:
        table_name = "ledger_entries"


class WebhookEvent(BaseModel):
    """The inbox: every accepted call, stored raw before it is handled.

    status: received (stored, not yet handled), processed, failed (handling raised; the
    scheduler retries it), rejected (malformed; kept with the reason), ignored (nothing
    to do for it)."""

    source = TextField()
    event_type = TextField()
    dedup_key = TextField()
    external_id = TextField(null=True)
    order_number = TextField(null=True, index=True)
    payload = TextField()
    status = TextField(default="received")
    attempts = IntegerField(default=0)
    last_error = TextField(null=True)
    next_attempt_at = UTCDateTimeField(null=True)
    received_at = UTCDateTimeField(default=utcnow)
    processed_at = UTCDateTimeField(null=True)

    class Meta:
        table_name = "webhook_events"
        indexes = (
            (("source", "dedup_key"), True),
            (("status", "next_attempt_at"), False),
            (("received_at",), False),
            # The console's event list: newest first under each filter, a page at a time
            # (keyset on received_at, id), at any size of the table.
            (("source", "received_at", "id"), False),
            (("event_type", "received_at", "id"), False),
            (("status", "received_at", "id"), False),
            (("external_id",), False),
        )


class Outbox(BaseModel):
    """An effect on another system, recorded in the same transaction as its cause.

    status: pending (to send at next_attempt_at), sent, dead (gave up; see last_error)."""

    event = ForeignKeyField(WebhookEvent, null=True, on_delete="SET NULL",
                            backref="effects", column_name="event_id")
    kind = TextField()
    order_number = TextField(null=True, index=True)
    payload = TextField()
    idempotency_key = TextField(unique=True)
    status = TextField(default="pending")
    attempts = IntegerField(default=0)
    next_attempt_at = UTCDateTimeField(default=utcnow)
    last_error = TextField(null=True)
    sent_at = UTCDateTimeField(null=True)

    class Meta:
        table_name = "outbox"
        indexes = (
            (("status", "next_attempt_at"), False),
            # The console's outbox list: the newest rows of a status (and destination).
            (("status", "id"), False),
            (("kind", "status", "id"), False),
        )


ALL_MODELS = [*ORDER_MODELS.values(), TreasuryJob, LedgerEntry, WebhookEvent, Outbox]



# Public endpoints (issue 6): "already filed" links, surveys and referral codes.

class SelfFiling(BaseModel):
    """A customer's "I already filed" click for one IFTA/UCR order and cycle; the first
    click's time is kept and reminders for that cycle stop."""

    kind = TextField()
    order_number = TextField()
    cycle = TextField()
    self_filed_at = UTCDateTimeField()

    class Meta:
        table_name = "self_filings"
        indexes = ((("kind", "order_number", "cycle"), True),)


class SurveyResponse(BaseModel):
    """The post-completion survey: one response per order."""

    order_number = TextField(unique=True)
    rating = IntegerField()
    comment = TextField(default="")

    class Meta:
        table_name = "survey_responses"


class ReferralCode(BaseModel):
    """A customer's referral code, written by the back office. The new customer gets
    percent_off; the referrer earns reward_cents per paid order that used the code."""

    code = TextField(unique=True)
    owner_email = TextField(index=True)
    percent_off = IntegerField()
    reward_cents = BigIntegerField(default=0)
    active = BooleanField(default=True)
    expires_at = UTCDateTimeField(null=True)

    class Meta:
        table_name = "referral_codes"


PUBLIC_MODELS = [SelfFiling, SurveyResponse, ReferralCode]


# Card processor (issue 3): the subscription cycles of compliance orders.

class SubscriptionCycle(BaseModel):
    """One paid renewal (Stripe invoice with billing_reason subscription_cycle) of a
    subscription, numbered 1, 2, ... in the order they were paid. Kept apart from the
    inbox, which is pruned, so the numbering survives."""

    subscription_id = TextField()
    invoice_id = TextField(unique=True)
    order_number = TextField()
    cycle = IntegerField()

    class Meta:
        table_name = "subscription_cycles"
        indexes = ((("subscription_id", "cycle"), True),)


CARD_MODELS = [SubscriptionCycle]


# The operator console (issue 16).

class ConsoleAction(BaseModel):
    """What an operator did in the console, kept for good: who (the name given at
    login), from which address, what (login, replay, retry...), on what, and how it went."""

    operator = TextField()
    address = TextField()
    action = TextField()
    target = TextField(default="")
    outcome = TextField(default="")

    class Meta:
        table_name = "console_actions"
        indexes = ((("created_at",), False),)


CONSOLE_MODELS = [ConsoleAction]


# Reminders (issue 14): what was sent, keyed, so that nothing is sent twice.

class SentReminder(BaseModel):
    """One reminder sent, under a unique key: `mail|<customer>|<day>` for a customer's
    consolidated reminder e-mail of a day (in BUSINESS_TZ), and
    `<ifta|ucr>|<order>|<cycle>|<days before due>` for one filing reminder. Two runs, in
    one process or two, cannot both insert a key, so neither sends it twice."""

    key = TextField(unique=True)
    kind = TextField()
    customer_email = TextField()
    order_number = TextField(null=True)
    cycle = TextField(null=True)
    day = TextField()

    class Meta:
        table_name = "reminders_sent"


REMINDER_MODELS = [SentReminder]
