"""Peewee models: every table, in one module as the design card fixes (it is longer than
the others for that reason). The table and column names marked as other systems' are
relied on by them: the workflow system and the worker read and write the order tables.

This module describes the schema only: the column types, the `database` proxy the
models are bound to (engine.connection.open_database chooses the Database behind it at
start-up, from DATABASE_URL), the models and their lists. Times are stored as
timezone-aware UTC, money as integer cents, coin amounts as exact decimals (every digit
kept, on SQLite too).
"""
import datetime
import decimal
from typing import Any, overload

from peewee import (
    AutoField, BigIntegerField, BooleanField, Database, DatabaseProxy, DateTimeField, Field,
    ForeignKeyField, IntegerField, Model, Node, PostgresqlDatabase, SQL, TextField,
)

database = DatabaseProxy()

UTC = datetime.timezone.utc

# Our two custom column kinds, spelled per database: PostgreSQL keeps time zones and
# arbitrary-precision numerics natively; SQLite keeps text so no digit is lost.
POSTGRES_FIELD_TYPES = {"UTCDATETIME": "TIMESTAMPTZ", "EXACTDECIMAL": "NUMERIC"}
SQLITE_FIELD_TYPES = {"UTCDATETIME": "DATETIME", "EXACTDECIMAL": "TEXT"}


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(UTC)


class UTCDateTimeField(DateTimeField):
    """A timezone-aware UTC timestamp; naive values read from the database are UTC."""

    field_type = "UTCDATETIME"

    def db_value(self, value: datetime.datetime | str | None) -> str | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.datetime.fromisoformat(value)
        if value.tzinfo is None:
            raise ValueError(f"{self.name}: refusing a naive datetime {value!r}")
        return value.astimezone(UTC).isoformat(sep=" ", timespec="microseconds")

    @overload
    def python_value(self, value: None) -> None: ...

    @overload
    def python_value(self, value: datetime.datetime | str) -> datetime.datetime: ...

    @overload
    def python_value(self, value: object) -> datetime.datetime | None: ...

    def python_value(self, value: object) -> datetime.datetime | None:
        """The time a column holds as the driver gives it: a datetime (PostgreSQL's), its
        text (SQLite's), or None."""
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.datetime.fromisoformat(value)
        assert isinstance(value, datetime.datetime), value
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class ExactDecimalField(Field):
    """A Decimal stored without rounding (NUMERIC on PostgreSQL, TEXT on SQLite)."""

    field_type = "EXACTDECIMAL"

    def db_value(self, value: decimal.Decimal | int | str | None) -> str | None:
        if value is None:
            return None
        return format(decimal.Decimal(value), "f")

    def python_value(self, value: object) -> decimal.Decimal | None:
        if value is None:
            return None
        return decimal.Decimal(str(value))


def is_postgres(db: Database | None = None) -> bool:
    """Whether the models' database (or `db`) is PostgreSQL: the schema's column types,
    and some statements, are spelled per database (the migrations ask it too, so it
    lives with the schema)."""
    target = db or database.obj
    return isinstance(target, PostgresqlDatabase)


class BaseModel(Model):
    # Peewee adds this primary key itself; declared, so that a type checker knows it.
    id = AutoField()
    created_at = UTCDateTimeField(default=utcnow)
    updated_at = UTCDateTimeField(default=utcnow)

    class Meta:
        database = database
        legacy_table_names = False


def database_default(sql: str) -> list[Node]:
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
    # What is known of the order's payment, fact by fact; payment_status is worked out of
    # them (domain.payments), whatever order the processor's events came in. Null until
    # the first fact: payment_received then also keeps what a status written before
    # these columns (or by another system) said. Amounts are in minor units of
    # payment_currency (ISO 4217); each *_as_of is when the fact was true at the
    # processor (its event's `created`, or when the processor was asked).
    payment_received = BooleanField(null=True)
    payment_amount = BigIntegerField(null=True)
    payment_currency = TextField(null=True)
    payment_failed_at = UTCDateTimeField(null=True)
    dispute_id = TextField(null=True)
    dispute_status = TextField(null=True)
    dispute_amount = BigIntegerField(null=True)
    dispute_as_of = UTCDateTimeField(null=True)
    refunded_charge = TextField(null=True)
    refunded_amount = BigIntegerField(null=True)
    refund_complete = BooleanField(null=True)
    refunded_as_of = UTCDateTimeField(null=True)

    # The order's kind, as ORDER_MODELS names it: each order table's own.
    kind: str | None = None

    def append_note(self, line: str) -> None:
        self.notes = f"{self.notes}\n{line}" if self.notes else line

    def __setattr__(self, name: str, value: Any) -> None:
        # A column's value as read, kept at its first change since the row was read (or
        # since its changes were last taken): what the order's history records as the
        # old value when the row is saved (engine.store.orders). A row being built from
        # what the database gave has the column not yet in __data__, and keeps nothing.
        data = self.__dict__.get("__data__")
        if data is not None and name in data and name not in self.__dict__.get("_dirty", ()):
            self.__dict__.setdefault("_before", {}).setdefault(name, data[name])
        super().__setattr__(name, value)

    def take_changes(self) -> dict[str, tuple[Any, Any]]:
        """{column: (as read, as now)} of the columns changed since the row was read or
        since the last call; a column set back to what it was is none. The row's own
        updated_at is not a change of the order."""
        before = self.__dict__.pop("_before", {})
        return {name: (old, self.__data__.get(name)) for name, old in before.items()
                if name != "updated_at" and old != self.__data__.get(name)}

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
    # How often Frappe refused the funds action for this order, and when it last did:
    # a refused order goes to the back of the settlement batch (domain.settlement).
    funds_refusals = IntegerField(default=0, constraints=database_default("0"))
    funds_refused_at = UTCDateTimeField(null=True)
    total_cents = BigIntegerField(null=True)
    amb_annual_price_cents = BigIntegerField(null=True)
    # The ISO 4217 currency of total_cents and amb_annual_price_cents (cents: its minor
    # units), set by the shop with them (migration 0020).
    currency = TextField(default="USD", constraints=database_default("'USD'"))
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
    # The invoice's fiat amount in the minor unit of its currency (ISO 4217: cents of USD,
    # yen, thousandths of KWD; the name is older than that rule); amount_usd_cents is the
    # same amount when that currency is USD, and null when it is not.
    fiat_currency = TextField(default="USD", constraints=database_default("'USD'"))
    amount_fiat_cents = BigIntegerField(default=0, constraints=database_default("0"))
    amount_usd_cents = BigIntegerField(null=True, default=0)
    idempotency_key = TextField()
    received_at = UTCDateTimeField(default=utcnow)
    # Its amounts and key come from a callback that listed no transaction (the fallback
    # txid): the first callback that lists them replaces them (domain.treasury).
    fallback = BooleanField(default=False, constraints=database_default("FALSE"))

    class Meta:
        table_name = "treasury_jobs"


class LedgerEntry(BaseModel):
    order_id = TextField(index=True)
    order_type = TextField()
    coin = TextField()
    movement_type = TextField(default="receive")
    amount_coin = ExactDecimalField(default=decimal.Decimal(0))
    # As on TreasuryJob: the transaction's fiat amount in the minor unit of the invoice's
    # currency, and in USD cents only when that currency is USD.
    fiat_currency = TextField(default="USD", constraints=database_default("'USD'"))
    amount_fiat_cents = BigIntegerField(default=0, constraints=database_default("0"))
    amount_usd_cents = BigIntegerField(null=True, default=0)
    # The invoice's balance, received under the fallback key (a callback that listed no
    # transaction): one such entry per order, replaced by the listed transactions'.
    fallback = BooleanField(default=False, constraints=database_default("FALSE"))
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
    scheduler retries it), waiting (a fact whose order is not known yet: handled again
    when one of `waiting_for` is linked to an order, or looked at again at
    next_attempt_at), dead (given up: by the retry policy after too many failures, or by
    an operator), rejected (malformed; kept with the reason), ignored (nothing to do for
    it).

    reconciled: not delivered by its sender but found by reconciliation (a workflow state
    change whose webhook never came, domain/reconcile.py) and handled as if it had come.

    given_up_by, given_up_at, given_up_reason: who gave the event up, when and why, when
    an operator did (ops.operator.give_up_events); it is then dead and final."""

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
    # Nullable only so that adding it to a large table is one quick ALTER (migration 0016).
    reconciled = BooleanField(default=False, null=True, constraints=database_default("FALSE"))
    given_up_by = TextField(null=True)
    given_up_at = UTCDateTimeField(null=True)
    given_up_reason = TextField(null=True)
    # Its place in its sender's record, as its plugin declares it (plugins.registry.
    # Placement): the events of one `stream` of a source are handled one after another,
    # in `version` order (text that sorts as the sender orders them; without one, the
    # arrival time). NULL stream: a fact that folds in any order and waits for nothing.
    stream = TextField(null=True)
    version = TextField(null=True)
    # The ids that will find a waiting fact's order, `kind:id` separated by spaces
    # (`payment_intent:pi_1 charge:ch_1`): the last wait's, kept once it is handled.
    waiting_for = TextField(null=True)
    # Not columns: what it waits behind as the operator reads it (ops.operator.note_holds);
    # whether other events of its stream were unfinished when it was handed over
    # (engine.inbox.position).
    held: str | None
    others_unfinished: bool
    # Not a column: whether its stream was another process's when it was placed
    # (engine.inbox.position), so that it is handed over again a moment later.
    stream_was_busy: bool
    # Not a column: when its handling in this process began, on the monotonic clock
    # (engine.inbox._wait: a link committed since may have come too late for it).
    handling_began: float
    # Not a column: whether later events of its stream are finished (a dead one; read by
    # ops.operator.event_with_effects for the console's replay).
    overtaken: bool

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


# A stream's events still to be finished, in their sender's order: "is an earlier event of
# this stream unfinished?" (engine.inbox, its ordering rule) asked for every event of a
# stream handed over, answered in one probe however many events the stream has.
WebhookEvent.add_index(
    WebhookEvent.index(WebhookEvent.source, WebhookEvent.stream, WebhookEvent.version,
                       WebhookEvent.received_at, WebhookEvent.id,
                       name="webhook_events_unfinished_by_stream")
    .where(WebhookEvent.status.in_(["received", "failed"])))
# The facts waiting for their order (engine.inbox.wake): "which of them wait for this id?"
# and "which are to be looked at again?" read these rows only, however large the table.
WebhookEvent.add_index(
    WebhookEvent.index(WebhookEvent.next_attempt_at, name="webhook_events_waiting")
    .where(WebhookEvent.status == "waiting"))
# A stream's handled events by version: "was a later change of this stream handled?"
WebhookEvent.add_index(
    WebhookEvent.index(WebhookEvent.source, WebhookEvent.stream, WebhookEvent.version,
                       name="webhook_events_handled_by_stream")
    .where(WebhookEvent.status == "processed"))


class Outbox(BaseModel):
    """An effect on another system, recorded in the same transaction as its cause.

    status: pending (to send at next_attempt_at), sent, dead (gave up; see last_error)."""

    event = ForeignKeyField(WebhookEvent, null=True, on_delete="SET NULL",
                            backref="effects", column_name="event_id")
    event_id: int | None  # the column itself, as peewee gives it
    # Not a column: whether an earlier row of its order must be sent first, set by
    # engine.outbox.note_whether_behind on the rows it is about to send.
    behind: bool
    kind = TextField()
    order_number = TextField(null=True, index=True)
    payload = TextField()
    idempotency_key = TextField(unique=True)
    status = TextField(default="pending")
    attempts = IntegerField(default=0)
    next_attempt_at = UTCDateTimeField(default=utcnow)
    last_error = TextField(null=True)
    sent_at = UTCDateTimeField(null=True)
    # The last attempt, written with its outcome; the database copies each into `attempts`.
    last_attempt_at = UTCDateTimeField(null=True)
    last_status_code = IntegerField(null=True)
    last_duration_ms = IntegerField(null=True)
    last_reply = TextField(null=True)

    class Meta:
        table_name = "outbox"
        indexes = (
            (("status", "next_attempt_at"), False),
            # The console's outbox list: the newest rows of a status (and destination).
            (("status", "id"), False),
            (("kind", "status", "id"), False),
        )


# Whether an earlier job or workflow action of the same order is still unsent, asked for
# every new effect and for every row the scheduler claims. The unsent rows are the few;
# with this index the answer is one probe, whatever the size of a backlog. Without it
# PostgreSQL, its statistics not yet caught up with a table that grew by thousands in
# an outage, answered through (kind, status, id): every earlier unsent row of the kind
# for every candidate, 2.2 s for one claim with 4,800 rows waiting.
Outbox.add_index(Outbox.index(Outbox.order_number, Outbox.kind, Outbox.id,
                              name="outbox_unsent_by_order")
                 .where(Outbox.status.in_(["pending", "waiting"])))

# The events operators gave up (the few): counted on their own, so the failures that
# await someone are the status index's counts less these, read from no event's row. An
# event stored has none, and costs this index nothing.
WebhookEvent.add_index(WebhookEvent.index(WebhookEvent.status, WebhookEvent.given_up_at,
                                          name="webhook_events_given_up")
                       .where(WebhookEvent.given_up_at.is_null(False)))




class Attempt(BaseModel):
    """One try at sending an outbox row: when, to which destination, the status code (none
    for a connection error or a mail server's refusal), how long it took, the error, a
    cleaned excerpt of the reply, and the row's status after it (sent, pending for a retry,
    dead, logged). Pruned after RETENTION_DAYS.

    Written by the database, not by the code: a trigger on outbox (ATTEMPT_TRIGGER, made
    by migration 0013) copies the row's last_* columns here whenever an UPDATE counts one
    more attempt, so the attempt costs no statement of its own, and no round trip, beside
    its outcome's."""

    outbox_id = BigIntegerField()
    destination = TextField()
    attempted_at = UTCDateTimeField()
    outcome = TextField()
    status_code = IntegerField(null=True)
    duration_ms = IntegerField(null=True)
    error = TextField(null=True)
    reply = TextField(null=True)

    class Meta:
        table_name = "attempts"
        indexes = ((("outbox_id", "id"), False), (("created_at",), False))


# An UPDATE of outbox that counts one more attempt is one attempt made (a retry put back
# in line sets the count to 0; a row waiting for its destination's configuration keeps it).
_ATTEMPT_COPIED = (
    "(outbox_id, destination, attempted_at, outcome, status_code, duration_ms, error, "
    "reply, created_at, updated_at) VALUES (NEW.id, NEW.kind, "
    "COALESCE(NEW.last_attempt_at, NEW.updated_at), NEW.status, NEW.last_status_code, "
    "NEW.last_duration_ms, NEW.last_error, NEW.last_reply, NEW.updated_at, NEW.updated_at)")
# The statements that make the trigger (each safe to run again), by database.
ATTEMPT_TRIGGER = {
    "postgres": (
        "CREATE OR REPLACE FUNCTION outbox_attempt() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN INSERT INTO attempts {_ATTEMPT_COPIED}; RETURN NULL; END $$",
        "DROP TRIGGER IF EXISTS outbox_attempt ON outbox",
        "CREATE TRIGGER outbox_attempt AFTER UPDATE ON outbox FOR EACH ROW "
        "WHEN (NEW.attempts > OLD.attempts) EXECUTE FUNCTION outbox_attempt()"),
    "sqlite": (
        "CREATE TRIGGER IF NOT EXISTS outbox_attempt AFTER UPDATE OF attempts ON outbox "
        "FOR EACH ROW WHEN NEW.attempts > OLD.attempts "
        f"BEGIN INSERT INTO attempts {_ATTEMPT_COPIED}; END",),
}

ALL_MODELS = [*ORDER_MODELS.values(), TreasuryJob, LedgerEntry, WebhookEvent, Outbox]
ATTEMPT_MODELS = [Attempt]



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


class ConsoleSession(BaseModel):
    """A console login, until it expires or is ended (logout, `receiver.py console
    logout-all`). The cookie carries a random token; only its SHA-256 is kept, so the
    table's contents open no session. `password_tag` names the CONSOLE_PASSWORD_HASH it
    was opened with: another hash ends it."""

    token_hash = TextField(unique=True)
    operator = TextField()
    password_tag = TextField()
    expires_at = UTCDateTimeField()
    ended_at = UTCDateTimeField(null=True)

    class Meta:
        table_name = "console_sessions"


CONSOLE_MODELS = [ConsoleAction, ConsoleSession]


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


# An order's history.

class OrderChange(BaseModel):
    """One change of an order, kept for good, written in the transaction of the change:
    `field` the column changed, `old_value` and `new_value` its values before and after
    as JSON text (`null` for none, amounts as integers, times as ISO 8601 UTC); or, with
    `field` "order", its creation, `new_value` the shop's fields it was created with
    (old_value null). `changed_by`: who (the orders API and the caller's address, an
    import with its file and line, an event, a scheduled job); `event_id` the event whose
    handling changed it, if one did; `changed_at` when (aware UTC)."""

    kind = TextField()
    order_number = TextField()
    field = TextField()
    old_value = TextField(null=True)
    new_value = TextField(null=True)
    changed_by = TextField()
    event_id = BigIntegerField(null=True)
    changed_at = UTCDateTimeField()

    class Meta:
        table_name = "order_changes"
        indexes = ((("order_number", "changed_at"), False),)


HISTORY_MODELS = [OrderChange]


# Reconciliation with the workflow system (issue 25).

class ReconcileRun(BaseModel):
    """Where reconciliation with Frappe got to, per doctype: `cursor` is the newest
    `modified` (Frappe's own text, in its time zone) it has looked at, `succeeded_at` when
    a run last finished, `last_error` why the last run did not, or what a finished one
    found wrong (its window met none of Frappe's changes), `newest_seen` the newest
    `modified` a run saw in Frappe (migration 0019)."""

    doctype = TextField(unique=True)
    cursor = TextField(null=True)
    succeeded_at = UTCDateTimeField(null=True)
    last_error = TextField(null=True)
    newest_seen = TextField(null=True)

    class Meta:
        table_name = "reconcile_runs"


RECONCILE_MODELS = [ReconcileRun]
