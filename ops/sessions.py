"""The console's sessions, kept on the server (models.ConsoleSession) so that they end
when they should: at logout, when CONSOLE_PASSWORD_HASH changes, and for everyone at
`receiver.py console logout-all`. A signed cookie alone could not be taken back: a copy
worked for its 12 hours after logout and after a new password.

The cookie carries a random token; the table keeps only its SHA-256. Each function is a
unit for the database door (ctx.db)."""
import datetime
import hashlib
import secrets

from models import ConsoleSession


def password_tag(password_hash: str) -> str:
    """Names the password a session was opened with, without holding the hash itself."""
    return hashlib.sha256(password_hash.encode("utf-8")).hexdigest()[:16]


def _hashed(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def open_session(operator_name: str, password_hash: str, now: datetime.datetime,
                 length: datetime.timedelta) -> str:
    """A new session for `operator_name`; returns its token, for the cookie."""
    token = secrets.token_urlsafe(32)
    ConsoleSession.create(token_hash=_hashed(token), operator=operator_name,
                          password_tag=password_tag(password_hash), expires_at=now + length,
                          created_at=now, updated_at=now)
    return token


def operator_of(token: str, password_hash: str, now: datetime.datetime) -> str | None:
    """The operator's name, for a session neither ended nor expired and opened with
    today's password; None otherwise."""
    row = ConsoleSession.get_or_none(ConsoleSession.token_hash == _hashed(token))
    if (row is None or row.ended_at is not None or row.expires_at <= now
            or row.password_tag != password_tag(password_hash)):
        return None
    return row.operator


def end_session(token: str, now: datetime.datetime) -> int:
    return (ConsoleSession.update(ended_at=now, updated_at=now)
            .where(ConsoleSession.token_hash == _hashed(token),
                   ConsoleSession.ended_at.is_null()).execute())


def end_all(now: datetime.datetime) -> int:
    """End every open session; returns how many were open."""
    return (ConsoleSession.update(ended_at=now, updated_at=now)
            .where(ConsoleSession.ended_at.is_null(), ConsoleSession.expires_at > now)
            .execute())

