"""The console's password: made into a salted scrypt hash by `receiver.py console
hash-password`, kept in CONSOLE_PASSWORD_HASH, checked at login.

The hash names its own cost and salt (settings.PASSWORD_HASH), so no other setting is
needed to check it, and the password itself is never stored anywhere."""
import base64
import hashlib
import hmac
import os

from settings import PASSWORD_HASH

LOG_N, R, P = 15, 8, 1
SALT_BYTES = 16
KEY_BYTES = 32
# Operators type it; a phrase of a few words is easy to type and hard to guess.
MIN_PASSWORD_LENGTH = 12


class WeakPassword(ValueError):
    """The password is too short to protect state that moves money."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _derive(password: str, salt: bytes, log_n: int, r: int, p: int) -> bytes:
    n = 1 << log_n
    # scrypt needs 128 * n * r bytes; Python's default ceiling (32 MiB) is just that.
    return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=n, r=r, p=p,
                          maxmem=256 * n * r, dklen=KEY_BYTES)


def hash_password(password: str) -> str:
    if len(password) < MIN_PASSWORD_LENGTH:
        raise WeakPassword(f"the password must be at least {MIN_PASSWORD_LENGTH} characters")
    salt = os.urandom(SALT_BYTES)
    key = _derive(password, salt, LOG_N, R, P)
    return f"scrypt${LOG_N}${R}${P}${_b64(salt)}${_b64(key)}"


def verify_password(password: str | None, stored: str | None) -> bool:
    """Whether `password` is the one `stored` was made from (constant-time comparison)."""
    parts = PASSWORD_HASH.fullmatch(stored or "")
    if parts is None or not password:
        return False
    key = _derive(password, _unb64(parts["salt"]), int(parts["log_n"]), int(parts["r"]),
                  int(parts["p"]))
    return hmac.compare_digest(key, _unb64(parts["key"]))
