"""Log lines: plain text or one JSON object per line, with every secret redacted."""
import datetime
import json
import logging
import re
import sys
import urllib.parse
from typing import Iterable

from models import UTC
from settings import Settings

# Attributes every LogRecord has; anything else on a record was passed as `extra=`.
_STANDARD_RECORD_FIELDS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line; fields given as `extra=` (event_id, outcome, ms...) become
    keys of their own, so journald and log shippers can filter on them."""

    escapes_text = True

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.datetime.fromtimestamp(record.created, UTC).isoformat(),
                 "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        entry.update({key: value for key, value in vars(record).items()
                      if key not in _STANDARD_RECORD_FIELDS})
        if record.exc_text:
            # RedactingFormatter has formatted and redacted it already.
            entry["exception"] = record.exc_text
        elif record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class RedactingFormatter(logging.Formatter):
    """The last line of defence: whatever any library logs (an exception text, a URL), a
    configured secret or a credential in a query string comes out as [redacted]."""

    QUERY_CREDENTIAL = re.compile(
        r"([?&](?:token|key|api_key|secret|signature|sig)=)[^&\s\"'\\]+", re.IGNORECASE)
    # Shorter values would blank out ordinary words; real secrets are long.
    MIN_SECRET_LENGTH = 6

    def __init__(self, inner: logging.Formatter, secrets: Iterable[str]) -> None:
        super().__init__()
        self.inner = inner
        self.secrets = sorted({form for s in secrets if len(s) >= self.MIN_SECRET_LENGTH
                               for form in written_forms(s)}, key=len, reverse=True)

    def format(self, record: logging.LogRecord) -> str:
        if not getattr(self.inner, "escapes_text", False):
            # Every text is on the line as it was given: redacting the line is enough.
            return self.redact(self.inner.format(record))
        # Redact the texts before the inner formatter runs: JSON escapes ", \ and non-ASCII,
        # after which a secret holding them no longer matches. A copy, so that other
        # handlers of the record still see it as it was.
        clean = logging.makeLogRecord(vars(record))
        clean.msg, clean.args = self.redact(record.getMessage()), None
        if record.exc_info:
            clean.exc_text = self.redact(
                record.exc_text or self.inner.formatException(record.exc_info))
        if record.stack_info:
            clean.stack_info = self.redact(record.stack_info)
        for key, value in vars(record).items():
            if key not in _STANDARD_RECORD_FIELDS and isinstance(value, str):
                setattr(clean, key, self.redact(value))
        # Again on the whole line: what the inner formatter adds is redacted as well.
        return self.redact(self.inner.format(clean))

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "[redacted]")
        return self.QUERY_CREDENTIAL.sub(r"\1[redacted]", text)


def written_forms(secret: str) -> set[str]:
    """The ways a secret can be written in a log line: as it is, escaped as Python's repr
    escapes it (Tornado's "Invalid header value '...'" line: a backslash doubled), as
    JSON escapes it, and its UTF-8 bytes read as latin-1 (how a header carries a
    non-ASCII secret), plain and escaped."""
    misread = secret.encode("utf-8").decode("latin-1")
    return {form for text in (secret, misread)
            for form in (text, repr(text)[1:-1], json.dumps(text)[1:-1])}


def secrets_of(settings: Settings) -> list[str]:
    """Every secret value the settings hold, as it may appear in text (raw and %-quoted)."""
    values = [settings.webhook_secret, settings.workflow_webhook_signing_secret,
              settings.stripe_secret_key, *settings.stripe_webhook_secrets,
              settings.crypto_processor_api_key, settings.workflow_api_key,
              settings.workflow_api_secret, settings.telegram_bot_token, settings.link_secret,
              settings.cookie_secret, settings.console_password_hash,
              settings.metrics_token]
    for url in (settings.smtp_url, settings.database_url):
        password = urllib.parse.urlsplit(url).password
        if password:
            values += [password, urllib.parse.unquote(password)]
    return values


def configure_logging(settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    formatter: logging.Formatter
    if settings.log_format == "json":
        formatter = JsonLogFormatter()
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    handler.setFormatter(RedactingFormatter(formatter, secrets_of(settings)))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    # APScheduler says "Running job ..." at INFO on every tick of every job; our jobs log
    # what they did, and /metrics counts their runs.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
