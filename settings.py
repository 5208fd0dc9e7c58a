"""Settings, read once from the environment (a systemd EnvironmentFile sets them).

The names are fixed: other systems and operators depend on them.

Longer than most: every setting is here, where an operator looks them up.
"""
import dataclasses
import decimal
import ipaddress
import logging
import os
import re
import urllib.parse
import zoneinfo
from typing import Any, Callable, Mapping, TypeVar

log = logging.getLogger("receiver.settings")

T = TypeVar("T")
# The environment variables (os.environ, or a test's own).
Environ = Mapping[str, str]
# TRUSTED_PROXIES, read.
Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

PLACEHOLDER_WEBHOOK_SECRET = "change-me-webhook-secret"
PLACEHOLDER_LINK_SECRET = "change-me-link-secret"

# CONSOLE_PASSWORD_HASH, as `receiver.py console hash-password` writes it:
# scrypt$<log2 n>$<r>$<p>$<salt>$<key>, salt and key in url-safe base64 without padding.
# The cost is in the string, so a hash made today still verifies after the default rises.
PASSWORD_HASH = re.compile(
    r"scrypt\$(?P<log_n>\d{1,2})\$(?P<r>\d{1,2})\$(?P<p>\d{1,2})"
    r"\$(?P<salt>[A-Za-z0-9_-]{22,})\$(?P<key>[A-Za-z0-9_-]{43,})")
# Below this cost a stolen hash is cheap to guess from: production refuses it.
MIN_PASSWORD_LOG_N = 14
# Every secret the shop makes for the service (the workflow's webhook secret and signing
# secret, the orders API key, the links' and the console cookies' signing keys), as
# production wants it: random, this long or more (python3 -c 'import secrets;
# print(secrets.token_urlsafe(32))' gives 43 characters). The keys a processor issues
# (Stripe's, SHKeeper's) are taken as issued.
MIN_SECRET_LENGTH = 32
MAKE_A_SECRET = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"

DEFAULT_DATABASE_URL = "sqlite:///var/receiver.sqlite3"

# Who may call the service (SENDERS), and what production needs of each a shop uses:
# workflow (Frappe's webhooks and the worker's fulfilment reports), card (Stripe), crypto
# (SHKeeper), orders (the shop, through the orders API). A sender the shop does not use
# needs nothing, and its endpoints stay closed without their keys: no sender is open by
# default (docs/SETTINGS.md).
SENDER_KEYS = {
    "workflow": ("WEBHOOK_SECRET",),
    "card": ("STRIPE_SECRET_KEY", "STRIPE_WEBHOOK_SECRET"),
    "crypto": ("CRYPTO_PROCESSOR_API_KEY",),
    "orders": ("ORDERS_API_KEY",),
}
# The three senders there were before the orders API: a deployment from before SENDERS
# starts as it did.
DEFAULT_SENDERS = ("workflow", "card", "crypto")


class ConfigurationError(Exception):
    """The settings cannot run the service; the message says which one and why."""


def _parsed(name: str, raw: str, parse: Callable[[str], T], kind: str) -> T:
    """`raw` (set, not blank) as `parse` reads it; what it refuses (ValueError) is a
    ConfigurationError saying what `name` must be."""
    try:
        return parse(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be {kind}, got {raw!r}") from None


def _each_set(environ: Environ, names: Mapping[str, str], parse: Callable[[str], T],
              kind: str) -> dict[str, T]:
    """{attribute: value} of the settings of `names` ({environment name: attribute}) that
    the environment sets, spaces around the value dropped; unset or blank, a setting is
    left out (it keeps its default)."""
    values = {}
    for name, attribute in names.items():
        raw = environ.get(name, "").strip()
        if raw:
            values[attribute] = _parsed(name, raw, parse, kind)
    return values


def _texts(environ: Environ) -> dict[str, str]:
    return _each_set(environ, TEXTS, str, "text")


def _base_urls(environ: Environ) -> dict[str, str]:
    """Without their trailing slashes: paths are joined on."""
    return _each_set(environ, BASE_URLS, lambda raw: raw.rstrip("/"), "a URL")


def _whole_numbers(environ: Environ) -> dict[str, int]:
    return _each_set(environ, WHOLE_NUMBERS, int, "a whole number")


def _durations(environ: Environ) -> dict[str, float]:
    return _each_set(environ, DURATIONS, float, "a number of seconds")


def _lists(environ: Environ) -> dict[str, tuple[str, ...]]:
    """A list that names nothing (only commas) keeps its default."""
    return {attribute: parts for name, attribute in LISTS.items()
            if (parts := _csv(environ.get(name, "")))}


def _percent(environ: Environ, name: str, default: decimal.Decimal) -> decimal.Decimal:
    raw = environ.get(name, "").strip()
    if not raw:
        return default

    def parse(raw: str) -> decimal.Decimal:
        try:
            value = decimal.Decimal(raw)
        except decimal.InvalidOperation:
            raise ValueError(raw) from None
        if not value.is_finite() or value < 0:
            raise ValueError(raw)
        return value
    return _parsed(name, raw, parse, "a percentage of 0 or more (such as 5 or 2.5)")


def _csv(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _networks(environ: Environ, name: str) -> Networks:
    """Comma-separated IP addresses or networks (`127.0.0.1, 10.0.0.0/8, ::1`)."""
    try:
        return tuple(ipaddress.ip_network(part, strict=False)
                     for part in _csv(environ.get(name, "")))
    except ValueError as exc:
        raise ConfigurationError(
            f"{name} must be IP addresses or networks (such as 127.0.0.1 or 10.0.0.0/8), "
            f"comma-separated: {exc}") from None


def _days(environ: Environ, name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """A comma-separated list of whole numbers of days, each 1 or more."""
    parts = _csv(environ.get(name, ""))
    if not parts:
        return default
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ConfigurationError(
            f"{name} must be whole numbers of days above zero, comma-separated, "
            f"got {environ[name]!r}")
    return tuple(sorted({int(part) for part in parts}, reverse=True))


def _state_paths(raw: str, waiting_state: str) -> tuple[tuple[str, str], ...]:
    """WORKFLOW_RECONCILE_STATES: `path=Frappe state` pairs, comma-separated, as a tuple
    of (path, state); unset, the defaults (the CRTC one names CRTC_WAITING_STATE)."""
    if not raw.strip():
        return tuple((path, waiting_state if path == "crtc/awaiting-funds" else state)
                     for path, state in DEFAULT_STATE_PATHS)
    pairs = []
    for part in _csv(raw):
        path, equals, state = part.partition("=")
        path, state = path.strip(), state.strip()
        if not equals or not state or not path.startswith(RECONCILED_PATH_PREFIXES):
            raise ConfigurationError(
                "WORKFLOW_RECONCILE_STATES must be path=Frappe state pairs, comma-separated, "
                f"each path starting with {' or '.join(RECONCILED_PATH_PREFIXES)}, got {part!r}")
        pairs.append((path, state))
    return tuple(pairs)


def _senders(environ: Environ) -> tuple[str, ...]:
    """SENDERS: which senders the shop uses, comma-separated, each one of SENDER_KEYS."""
    named = tuple(part.lower() for part in _csv(environ.get("SENDERS", "")))
    unknown = [name for name in named if name not in SENDER_KEYS]
    if unknown:
        raise ConfigurationError(
            f"SENDERS names {', '.join(repr(name) for name in unknown)}: the senders are "
            f"{', '.join(SENDER_KEYS)} (comma-separated)")
    return named or DEFAULT_SENDERS


def _placeholder(value: str) -> bool:
    """An unset key, or the example's stand-in for one."""
    return not value or value.lower().startswith("change-me")


def _check_url(name: str, value: str, schemes: tuple[str, ...]) -> None:
    if not value:
        return
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in schemes:
        raise ConfigurationError(
            f"{name} must start with {' or '.join(s + '://' for s in schemes)}, "
            f"got {parts.scheme + '://' if parts.scheme else 'no scheme'}")
    if parts.scheme not in ("sqlite",) and not parts.hostname:
        raise ConfigurationError(f"{name} names no host")
    if parts.scheme == "sqlite" and parts.netloc:
        # sqlite://var/x.sqlite3 would open x.sqlite3 in the working folder: `var` is read
        # as a host and dropped.
        raise ConfigurationError(
            f"{name}: a SQLite path follows three slashes (sqlite:///var/receiver.sqlite3, "
            "relative to the working folder) or four (sqlite:////srv/receiver.sqlite3)")


# Settings that must be whole numbers above zero, by their environment names.
POSITIVE_NUMBERS = {
    "MAX_BODY_BYTES": "max_body_bytes",
    "SETTLEMENT_INTERVAL_MINUTES": "settlement_interval_minutes",
    "SETTLEMENT_REFUSALS_BEFORE_ALERT": "settlement_refusals_before_alert",
    "OUTBOUND_TIMEOUT_SECONDS": "outbound_timeout_seconds",
    "SCHEDULER_TICK_SECONDS": "scheduler_tick_seconds",
    "CLAIM_LEASE_SECONDS": "claim_lease_seconds",
    "INBOX_MAX_ATTEMPTS": "inbox_max_attempts",
    "INBOX_HOLD_ALERT_MINUTES": "inbox_hold_alert_minutes",
    "CARD_FACT_WAIT_ALERT_MINUTES": "card_fact_wait_alert_minutes",
    "OUTBOX_MAX_ATTEMPTS": "outbox_max_attempts",
    "STOP_TIMEOUT_SECONDS": "stop_timeout_seconds",
    "RETENTION_DAYS": "retention_days",
    "OUTBOUND_MAX_IN_FLIGHT": "outbound_max_in_flight",
    "OUTBOUND_DOWN_AFTER": "outbound_down_after",
    "OUTBOUND_PROBE_MAX_SECONDS": "outbound_probe_max_seconds",
    "PUBLIC_RATE_WINDOW_SECONDS": "public_rate_window_seconds",
    "WORKFLOW_DEDUP_HOURS": "workflow_dedup_hours",
    "COMMISSION_HOLDBACK_DAYS": "commission_holdback_days",
    "AUTH_FAILURE_WINDOW_SECONDS": "auth_failure_window_seconds",
    "BODY_BUFFER_TOTAL_BYTES": "body_buffer_total_bytes",
    "BODY_BUFFER_PER_CLIENT_BYTES": "body_buffer_per_client_bytes",
    "METRICS_CACHE_SECONDS": "metrics_cache_seconds",
    "MAX_CONNECTIONS": "max_connections",
    "DATABASE_TIMEOUT_MS": "database_timeout_ms",
    "SPOOL_WAIT_LIMIT_SECONDS": "spool_wait_limit_seconds",
}

# The workflow paths reconciliation looks for, with the Frappe workflow state each is
# about (the states of docs/INTEGRATIONS.md's worked workflows). Only these path groups:
# their doctypes are WORKFLOW_DOCTYPE and CRTC_DOCTYPE.
RECONCILED_PATH_PREFIXES = ("formation/", "crtc/")
DEFAULT_STATE_PATHS = (
    ("formation/submitted", "Submitted"),
    ("formation/name-available", "Name Available"),
    ("formation/filed-needs-ein", "Filed Needs EIN"),
    ("formation/filed-skip-ein", "Filed Skip EIN"),
    ("formation/ein-obtained", "EIN Obtained"),
    ("formation/approved", "Approved"),
    ("formation/ready", "Ready"),
    ("crtc/awaiting-funds", "Awaiting Funds"),
    ("crtc/funds-available", "Client Selection"),
    ("crtc/incorporated", "Incorporated"),
)

# URL settings, when set, and the schemes each may use.
URL_SCHEMES = {
    "DATABASE_URL": ("database_url", ("sqlite", "postgres", "postgresql")),
    "WORKER_URL": ("worker_url", ("http", "https")),
    "WORKFLOW_URL": ("workflow_url", ("http", "https")),
    "TELEGRAM_API_URL": ("telegram_api_url", ("http", "https")),
    "PUBLIC_BASE_URL": ("public_base_url", ("http", "https")),
    "STRIPE_API_BASE": ("stripe_api_base", ("http", "https")),
    "SMTP_URL": ("smtp_url", ("smtp", "smtps", "smtp+starttls")),
}


# How each setting is read from its environment variable, by name. Unset or blank, a
# setting keeps its default; spaces around a value are dropped.
TEXTS = {
    "RECEIVER_HOST": "host",
    "RECEIVER_ENV": "env",
    "RECEIVER_LOG_FORMAT": "log_format",
    "DATABASE_URL": "database_url",
    "SPOOL_DIR": "spool_dir",
    "WEBHOOK_SECRET": "webhook_secret",
    "WORKFLOW_WEBHOOK_SIGNING_SECRET": "workflow_webhook_signing_secret",
    "STRIPE_SECRET_KEY": "stripe_secret_key",
    "STRIPE_API_BASE": "stripe_api_base",
    "CRYPTO_PROCESSOR_API_KEY": "crypto_processor_api_key",
    "ORDERS_API_KEY": "orders_api_key",
    "WORKFLOW_API_KEY": "workflow_api_key",
    "WORKFLOW_API_SECRET": "workflow_api_secret",
    "WORKFLOW_SITE_NAME": "workflow_site_name",
    "WORKFLOW_DOCTYPE": "workflow_doctype",
    "WORKFLOW_TIME_ZONE": "workflow_time_zone",
    "CRTC_DOCTYPE": "crtc_doctype",
    "CRTC_FUNDS_ACTION": "crtc_funds_action",
    "CRTC_WAITING_STATE": "crtc_waiting_state",
    "ADMIN_EMAIL": "admin_email",
    "MAIL_FROM": "mail_from",
    "SMTP_URL": "smtp_url",
    "TELEGRAM_BOT_TOKEN": "telegram_bot_token",
    "TELEGRAM_CHAT_ID": "telegram_chat_id",
    "LINK_SECRET": "link_secret",
    "BUSINESS_TZ": "business_tz",
    "CONSOLE_PASSWORD_HASH": "console_password_hash",
    "COOKIE_SECRET": "cookie_secret",
    "METRICS_TOKEN": "metrics_token",
}
# URLs that paths are joined on: without their trailing slash.
BASE_URLS = {
    "WORKFLOW_URL": "workflow_url",
    "WORKER_URL": "worker_url",
    "TELEGRAM_API_URL": "telegram_api_url",
    "PUBLIC_BASE_URL": "public_base_url",
}
WHOLE_NUMBERS = {
    **POSITIVE_NUMBERS,
    "RECEIVER_PORT": "port",
    "WORKFLOW_RECONCILE_MINUTES": "workflow_reconcile_minutes",
    "WORKFLOW_RECONCILE_SETTLE_SECONDS": "workflow_reconcile_settle_seconds",
    "PUBLIC_RATE_LIMIT": "public_rate_limit",
    "AUTH_FAILURE_LIMIT": "auth_failure_limit",
}
# Numbers of seconds, fractions allowed.
DURATIONS = {
    "WORKFLOW_RECONCILE_DATABASE_SECONDS": "workflow_reconcile_database_seconds",
    "OUTBOUND_DOWN_AFTER_SECONDS": "outbound_down_after_seconds",
    "WORKFLOW_ANSWER_BUDGET_SECONDS": "workflow_answer_budget_seconds",
    "DATABASE_CALL_BUDGET_SECONDS": "database_call_budget_seconds",
}
# Comma-separated.
LISTS = {
    "STRIPE_WEBHOOK_SECRET": "stripe_webhook_secrets",
    "IFTA_SERVICE_SLUGS": "ifta_service_slugs",
    "UCR_SERVICE_SLUGS": "ucr_service_slugs",
}


def local_base_url(host: str, port: int) -> str:
    """Where this machine reaches the service: PUBLIC_BASE_URL's default, so that a link
    printed on a machine without a public name points at the port really served."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclasses.dataclass(frozen=True)
class Settings:
    # Fields that hold a secret (or a URL with a password) stay out of repr(), so no
    # traceback or debug print shows them.
    host: str = "127.0.0.1"
    port: int = 8000
    env: str = "development"
    database_url: str = dataclasses.field(default=DEFAULT_DATABASE_URL, repr=False)
    webhook_secret: str = dataclasses.field(default=PLACEHOLDER_WEBHOOK_SECRET, repr=False)
    workflow_webhook_signing_secret: str = dataclasses.field(default="", repr=False)
    stripe_secret_key: str = dataclasses.field(default="", repr=False)
    stripe_webhook_secrets: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    stripe_api_base: str = ""
    crypto_processor_api_key: str = dataclasses.field(default="", repr=False)
    # The bearer token of the orders API (docs/ORDERS.md); unset, it refuses every call.
    orders_api_key: str = dataclasses.field(default="", repr=False)
    senders: tuple[str, ...] = DEFAULT_SENDERS
    workflow_url: str = ""
    workflow_api_key: str = dataclasses.field(default="", repr=False)
    workflow_api_secret: str = dataclasses.field(default="", repr=False)
    workflow_site_name: str = ""
    workflow_doctype: str = "Formation Order"
    crtc_doctype: str = "CRTC Order"
    crtc_funds_action: str = "Confirm Funds"
    # The CRTC workflow state an order waits for its funds in (Confirm Funds applies from it).
    crtc_waiting_state: str = "Awaiting Funds"
    # Reconciliation with Frappe (domain/reconcile.py): (path, Frappe state) pairs, how
    # often it runs (0: never by the scheduler), how long a change is left to its webhook,
    # and the time zone Frappe's `modified` times are written in (its System Settings).
    workflow_reconcile_states: tuple[tuple[str, str], ...] = tuple(DEFAULT_STATE_PATHS)
    workflow_reconcile_minutes: int = 5
    workflow_reconcile_settle_seconds: int = 120
    # The time one reconciliation run may wait on the database in all (engine.commits
    # .allowance): past it the run stops, and the next goes on from where the last
    # finished one left off.
    workflow_reconcile_database_seconds: float = 60.0
    # The Frappe site's time zone when set; Frappe's own word (System Settings) is used,
    # and this must agree with it (clients.workflow.WorkflowClient.check).
    workflow_time_zone: str = ""
    worker_url: str = ""
    admin_email: str = ""
    mail_from: str = "receiver@localhost"
    smtp_url: str = dataclasses.field(default="", repr=False)
    telegram_bot_token: str = dataclasses.field(default="", repr=False)
    telegram_chat_id: str = ""
    telegram_api_url: str = "https://api.telegram.org"
    link_secret: str = dataclasses.field(default=PLACEHOLDER_LINK_SECRET, repr=False)
    public_base_url: str = "http://127.0.0.1:8000"
    business_tz: str = "UTC"
    settlement_interval_minutes: int = 60
    # Refusals of one CRTC order's funds action after which the administrator is told
    # (once): a day of hourly settlement runs.
    settlement_refusals_before_alert: int = 24
    max_body_bytes: int = 1024 * 1024
    spool_dir: str = "var/spool"
    # How long acknowledged calls may wait in the spool while the database answers before
    # /readyz says not ready: the drain runs at every tick and as soon as the database is
    # back, so calls that wait longer are stuck, not on their way.
    spool_wait_limit_seconds: int = 60
    log_format: str = "text"
    outbound_timeout_seconds: int = 10
    scheduler_tick_seconds: int = 10
    claim_lease_seconds: int = 60
    # Tries of an inbox event's handling, and of an outbox effect's send, before it is
    # given up (`dead`) and the administrator told (engine.retry).
    inbox_max_attempts: int = 10
    outbox_max_attempts: int = 12
    # How long an order's events may wait behind an unfinished earlier one before the
    # administrator is told (once for each event that holds them).
    inbox_hold_alert_minutes: int = 60
    # How often a card fact waiting for its order is looked at again, and how long it
    # may wait before the administrator is told (once for each fact).
    card_fact_wait_alert_minutes: int = 60
    # How long a stop may take in all, as systemd's TimeoutStopSec gives it (deploy/).
    stop_timeout_seconds: int = 30
    outbound_max_in_flight: int = 16
    outbound_down_after: int = 5
    # ...or, however few sends there were, after all of them failed for this long.
    outbound_down_after_seconds: float = 20.0
    outbound_probe_max_seconds: int = 300
    retention_days: int = 30
    public_rate_limit: int = 30
    public_rate_window_seconds: int = 60
    # Frappe gives up on a webhook after 5 s; we answer before that.
    workflow_answer_budget_seconds: float = 4.0
    # A body without `modified`: the same body within this many hours is one delivery.
    workflow_dedup_hours: int = 36
    console_password_hash: str = dataclasses.field(default="", repr=False)
    cookie_secret: str = dataclasses.field(default="", repr=False)
    commission_holdback_days: int = 14
    # A crypto invoice paid more or less than expected by more than this share is told.
    crypto_payment_tolerance_percent: decimal.Decimal = decimal.Decimal(5)
    ifta_service_slugs: tuple[str, ...] = ("ifta",)
    ucr_service_slugs: tuple[str, ...] = ("ucr",)
    # Days before a filing's due date on which its reminder goes out (and on the due date).
    filing_reminder_days: tuple[int, ...] = (14, 7, 3, 1)
    auth_failure_limit: int = 10
    auth_failure_window_seconds: int = 60
    body_buffer_total_bytes: int = 64 * 1024 * 1024
    body_buffer_per_client_bytes: int = 8 * 1024 * 1024
    metrics_token: str = dataclasses.field(default="", repr=False)
    metrics_cache_seconds: int = 5
    max_connections: int = 4000
    database_timeout_ms: int = 1000
    # How long one inbound call may wait on the database in all (engine.commits.budget):
    # a database slow on every reply, under DATABASE_TIMEOUT_MS each, must not hold a
    # webhook past its sender's patience (Frappe's 5 s).
    database_call_budget_seconds: float = 2.0
    # Proxies whose X-Real-IP / X-Forwarded-For are believed (handlers.addresses): none
    # unless set; behind the shipped nginx, 127.0.0.1 (and ::1).
    trusted_proxies: Networks = ()

    @classmethod
    def from_env(cls, environ: Environ | None = None) -> "Settings":
        """The settings `environ` (os.environ) sets, the defaults for the rest; checked
        (`check`): a ConfigurationError names a setting that cannot run the service."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {**_texts(env), **_base_urls(env), **_whole_numbers(env),
                                  **_durations(env), **_lists(env)}
        values.setdefault("public_base_url", local_base_url(
            values.get("host", cls.host), values.get("port", cls.port)))
        settings = cls(
            **values,
            senders=_senders(env),
            workflow_reconcile_states=_state_paths(
                env.get("WORKFLOW_RECONCILE_STATES", ""),
                values.get("crtc_waiting_state", cls.crtc_waiting_state)),
            crypto_payment_tolerance_percent=_percent(
                env, "CRYPTO_PAYMENT_TOLERANCE_PERCENT", cls.crypto_payment_tolerance_percent),
            filing_reminder_days=_days(env, "FILING_REMINDER_DAYS", cls.filing_reminder_days),
            trusted_proxies=_networks(env, "TRUSTED_PROXIES"),
        )
        settings.check()
        return settings

    @property
    def production(self) -> bool:
        return self.env == "production"

    def check(self) -> None:
        """Refuse, at start-up, settings that could only fail later; in production, refuse
        placeholder or missing secrets. Messages name the setting, never its value."""
        if self.env not in ("development", "production"):
            raise ConfigurationError(
                f"RECEIVER_ENV must be development or production, got {self.env!r}")
        if self.log_format not in ("text", "json"):
            raise ConfigurationError(
                f"RECEIVER_LOG_FORMAT must be text or json, got {self.log_format!r}")
        for name, attribute in POSITIVE_NUMBERS.items():
            if getattr(self, attribute) <= 0:
                raise ConfigurationError(f"{name} must be a whole number above zero")
        if not 0 < self.outbound_down_after_seconds < float("inf"):
            raise ConfigurationError("OUTBOUND_DOWN_AFTER_SECONDS must be above zero")
        if not 0 < self.workflow_answer_budget_seconds < float("inf"):
            raise ConfigurationError("WORKFLOW_ANSWER_BUDGET_SECONDS must be above zero")
        if not 0 < self.database_call_budget_seconds < float("inf"):
            raise ConfigurationError("DATABASE_CALL_BUDGET_SECONDS must be above zero")
        if not 0 < self.workflow_reconcile_database_seconds < float("inf"):
            raise ConfigurationError("WORKFLOW_RECONCILE_DATABASE_SECONDS must be above zero")
        if self.workflow_reconcile_minutes < 0 or self.workflow_reconcile_settle_seconds < 0:
            raise ConfigurationError("WORKFLOW_RECONCILE_MINUTES and "
                                     "WORKFLOW_RECONCILE_SETTLE_SECONDS must be zero or more")
        if self.public_rate_limit < 0:
            raise ConfigurationError("PUBLIC_RATE_LIMIT must be zero (off) or more")
        if self.auth_failure_limit < 0:
            raise ConfigurationError("AUTH_FAILURE_LIMIT must be zero (off) or more")
        if self.claim_lease_seconds <= self.outbound_timeout_seconds:
            # A send still waiting on its peer would be claimed and sent a second time.
            raise ConfigurationError(
                "CLAIM_LEASE_SECONDS must be longer than OUTBOUND_TIMEOUT_SECONDS")
        for name, (attribute, schemes) in URL_SCHEMES.items():
            _check_url(name, getattr(self, attribute), schemes)
        for name, zone in (("BUSINESS_TZ", self.business_tz),
                           ("WORKFLOW_TIME_ZONE", self.workflow_time_zone or "UTC")):
            try:
                zoneinfo.ZoneInfo(zone)
            except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                raise ConfigurationError(
                    f"{name} must be an IANA time zone such as America/Toronto, "
                    f"got {zone!r}") from None
        if self.console_password_hash and not PASSWORD_HASH.fullmatch(self.console_password_hash):
            # Not a hash at all (a password pasted by mistake, a placeholder): nobody could
            # log in, and a password must never sit in the environment.
            raise ConfigurationError(
                "CONSOLE_PASSWORD_HASH must be what `receiver.py console hash-password` "
                "prints (scrypt$...)")
        if self.production:
            self._check_production_secrets()
            self._check_production_console()
            if not self.admin_email:
                # Nobody would hear of a dead effect, a rejected payment or a
                # quarantined call: they would reach only the log.
                raise ConfigurationError(
                    "RECEIVER_ENV=production needs ADMIN_EMAIL: dead effects, rejected "
                    "payments and quarantined calls are mailed there")

    def _check_production_secrets(self) -> None:
        """The keys of the senders the shop uses (SENDERS), and LINK_SECRET."""
        unset = {
            "WEBHOOK_SECRET": self.webhook_secret == PLACEHOLDER_WEBHOOK_SECRET,
            # Without the API key the card webhook acknowledges and drops every event.
            "STRIPE_SECRET_KEY": not self.stripe_secret_key,
            "STRIPE_WEBHOOK_SECRET": not self.stripe_webhook_secrets,
            "CRYPTO_PROCESSOR_API_KEY": _placeholder(self.crypto_processor_api_key),
            "ORDERS_API_KEY": _placeholder(self.orders_api_key),
        }
        missing = [name for sender in self.senders for name in SENDER_KEYS[sender]
                   if unset[name]]
        if self.link_secret == PLACEHOLDER_LINK_SECRET:
            missing.append("LINK_SECRET")
        if missing:
            raise ConfigurationError(
                f"RECEIVER_ENV=production needs real secrets for the senders in use "
                f"(SENDERS={','.join(self.senders)}); not set: " + ", ".join(missing))
        weak = [name for name, value in self._shop_made_secrets().items()
                if _placeholder(value) or len(value) < MIN_SECRET_LENGTH]
        if weak:
            raise ConfigurationError(
                f"RECEIVER_ENV=production needs each secret the shop makes to be "
                f"{MIN_SECRET_LENGTH} random characters or more, not a placeholder ({MAKE_A_SECRET}"
                f" makes one); too short: " + ", ".join(weak))

    def _shop_made_secrets(self) -> dict[str, str]:
        """The secrets the shop makes that open something in this deployment: a set one
        opens its endpoint whatever SENDERS says (the orders API key, Frappe's signing
        secret), a sender in use needs its own."""
        made = {"LINK_SECRET": self.link_secret}
        if "workflow" in self.senders:
            made["WEBHOOK_SECRET"] = self.webhook_secret
        if "orders" in self.senders or self.orders_api_key:
            made["ORDERS_API_KEY"] = self.orders_api_key
        if self.workflow_webhook_signing_secret:
            made["WORKFLOW_WEBHOOK_SIGNING_SECRET"] = self.workflow_webhook_signing_secret
        if self.console_enabled:
            made["COOKIE_SECRET"] = self.cookie_secret
        return made

    @property
    def workflow_secret(self) -> str:
        """The secret X-Webhook-Secret must match. In production the built-in placeholder
        matches nothing: a shop whose SENDERS leaves out the workflow has no
        WEBHOOK_SECRET to set, and its workflow endpoints stay closed."""
        if self.production and self.webhook_secret == PLACEHOLDER_WEBHOOK_SECRET:
            return ""
        return self.webhook_secret

    @property
    def console_enabled(self) -> bool:
        return bool(self.console_password_hash)

    def _check_production_console(self) -> None:
        if not self.console_enabled:
            return
        made = PASSWORD_HASH.fullmatch(self.console_password_hash)
        assert made is not None  # `check` refused any other hash
        if int(made["log_n"]) < MIN_PASSWORD_LOG_N:
            raise ConfigurationError(
                "RECEIVER_ENV=production refuses a weak CONSOLE_PASSWORD_HASH (made with a "
                "cost below the default); make a new one with `receiver.py console "
                "hash-password`")

    def warn_about_link_secret(self) -> None:
        """Said by serve and by the commands that sign links (`link`, `reminders run`):
        the service's pages refuse a link signed with another secret."""
        if self.link_secret == PLACEHOLDER_LINK_SECRET:
            log.warning("LINK_SECRET is not set: 'already filed' links are signed with a "
                        "placeholder. Set LINK_SECRET before sending reminders.")

    def warn_about_placeholders(self) -> None:
        if "crypto" in self.senders and not self.crypto_processor_api_key:
            log.warning("CRYPTO_PROCESSOR_API_KEY is not set: crypto-processor callbacks "
                        "are refused (401). Set it to the API key SHKeeper sends.")
        if "orders" in self.senders and not self.orders_api_key:
            log.warning("ORDERS_API_KEY is not set: the orders API refuses every call "
                        "(401). Set it to make orders through the API.")
        if self.webhook_secret == PLACEHOLDER_WEBHOOK_SECRET and not self.production:
            # (In production the placeholder matches nothing: `workflow_secret`.)
            log.warning("WEBHOOK_SECRET is not set: the workflow webhooks accept the "
                        "built-in placeholder secret. Set WEBHOOK_SECRET before going live.")
        self.warn_about_link_secret()
        if self.console_enabled and not self.cookie_secret:
            log.warning("COOKIE_SECRET is not set: console sessions are signed with a key "
                        "of this process and end when it restarts.")
