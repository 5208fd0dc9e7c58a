"""The one place where an outbound HTTP call is made and its outcome classified."""
import asyncio
import dataclasses
import json
import logging
import re
from typing import Any, Callable

import aiohttp

log = logging.getLogger("receiver.http")

# Statuses worth asking again; any other 4xx is the peer refusing for good.
RETRYABLE_STATUSES = {408, 425, 429}
# What is read of a reply to a POST (a job, an action, an alert): its status is the
# outcome, and what the attempt log keeps of the body (`MAX_ERROR_CHARS`, an excerpt of
# 200) comes from its start; Frappe's account of a refusal (its exc_type and messages,
# after a traceback of a few KiB) fits too. The rest is not read: the connection is
# closed, so a peer answering 50 MB costs no more memory than one answering "ok".
POST_REPLY_BYTES = 64 * 1024
# What is read of a reply to a GET of Frappe's (a list page of 100 documents, a
# document's history, a Workflow): what it answers is used whole, and a reply past this
# is unreadable rather than held.
READ_REPLY_BYTES = 4 * 1024 * 1024
# An idle connection is closed by us before any common server closes it (gunicorn's
# default keep-alive is 2 s): a request is then never written into a connection the peer
# is closing at that moment. Under load a connection is never idle that long.
KEEPALIVE_SECONDS = 1.0
# An error's text is kept on its row (last_error), shown on the console and mailed to the
# administrator: one line of printable text, this long at most.
MAX_ERROR_CHARS = 500
# NUL (which PostgreSQL cannot store in text), the other control characters and the
# line and paragraph separators: each run of them becomes one space.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def error_text(text: object, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` fit to be stored and shown as an error: what a peer or an exception says
    may hold anything, and a row whose error cannot be stored is never recorded."""
    text = _UNPRINTABLE.sub(" ", str(text)).strip()
    return text if len(text) <= limit else text[:limit - 1] + "…"


JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


@dataclasses.dataclass(frozen=True)
class Result:
    ok: bool
    retryable: bool = False
    error: str = ""
    status: int = 0
    # What the peer answered, as parsed JSON: any shape a peer may send.
    body: Any = None
    # False when the peer is not configured at all: no try has been made, so the effect
    # waits for the configuration instead of using up its attempts.
    configured: bool = True
    # True when the effect was written to our log instead of being sent, as the settings
    # ask (no Telegram, no SMTP): `error` says why. Final, but not delivered.
    logged: bool = False
    # An excerpt of what the peer answered, kept with the attempt.
    reply: str = ""
    # The peer refused our credentials (its client says so): every call to it will be
    # refused alike until they are fixed.
    credentials_refused: bool = False
    # The peer says our settings name something it does not have (a doctype): no retry
    # of this call will change that, and the peer itself is well.
    misconfigured: bool = False

    def __post_init__(self) -> None:
        # Cleaned where it is made, so no caller stores or shows an error it cannot.
        object.__setattr__(self, "error", error_text(self.error))

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def failed(cls, error: str, retryable: bool = True, status: int = 0,
               configured: bool = True) -> "Result":
        return cls(ok=False, retryable=retryable, error=error, status=status,
                   configured=configured)

    @classmethod
    def only_logged(cls, reason: str) -> "Result":
        return cls(ok=True, error=reason, logged=True)

    @property
    def peer_failed(self) -> bool:
        """The peer could not be reached or failed on its side (a network error, a
        timeout, a 5xx): what tells that a destination is down. A refusal (4xx) shows a
        peer that answers."""
        return not self.ok and self.configured and self.retryable and (
            self.status == 0 or self.status >= 500)


@dataclasses.dataclass(frozen=True)
class Request:
    """A JSON POST as a client sends it: what `post_json` is given, and what the console
    shows of an effect (with the credentials hidden)."""
    url: str
    body: dict
    headers: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    # The reply went on past the bound it was read to: `body` is its start.
    cut: bool = False
    # A redirect's Location (3xx), which is never followed.
    location: str = ""


class HttpClient:
    """Keep-alive connections to the peers, up to `max_connections` at once: a slow peer
    may hold many requests open without queueing anybody else's behind it. A new
    connection per request cost twice the CPU of the request itself (docs/PERFORMANCE.md).

    The pool belongs to the event loop it was opened in, so it is opened on first use."""

    def __init__(self, max_connections: int = 200) -> None:
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _current_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._loop = loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections,
                                               keepalive_timeout=KEEPALIVE_SECONDS),
                skip_auto_headers=("User-Agent",))
        return self._session

    async def call(self, method: str, url: str, body: bytes | None = None,
                   headers: dict[str, str] | None = None, timeout: float = 10.0,
                   limit: int = POST_REPLY_BYTES) -> Reply:
        """The peer's Reply, its body read up to `limit` bytes (the rest is not read, and
        the connection is closed); raises on a network error or when `timeout` (seconds,
        the wait for a free connection included) runs out. A redirect is never followed:
        aiohttp would follow a 302 as a GET without the body, and a job would be taken
        for delivered by whatever answers there."""
        # A connection that takes half the time leaves too little for the answer.
        limits = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout / 2, 5.0))
        async with self._current_session().request(
                method, url, data=body, headers=headers, timeout=limits,
                allow_redirects=False) as response:
            read, cut = await _read_up_to(response, limit)
            if cut:
                response.close()
            return Reply(response.status, read, cut, response.headers.get("Location", ""))

    async def close(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None


async def _read_up_to(response: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """(the first `limit` bytes of the reply's body, whether there was more)."""
    read = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        if len(read) + len(chunk) > limit:
            read += chunk[:limit - len(read)]
            return bytes(read), True
        read += chunk
    return bytes(read), False


def redirected(reply: Reply) -> str:
    """The error of a redirect, naming where it pointed: the URL setting to check."""
    return f"HTTP {reply.status}: redirected to {reply.location or '(no Location)'}, not " \
           f"followed"


async def post_json(http: HttpClient, url: str, body: Any,
                    headers: dict[str, str] | None = None, timeout: float = 10.0,
                    peer: str = "peer",
                    refusal: Callable[[Result, bytes], Result] | None = None) -> Result:
    """POST `body` as JSON; a 2xx is ok (its JSON reply as the body), anything else is a
    failed Result. A 2xx whose reply is not JSON is delivered all the same: the status
    is the peer's word that it took the call (a worker answering "OK" as text, or 204),
    and asking again would only do it twice; `peer` names it in the warning.
    `refusal(failed, body)`, when given, reads the peer's own account of a refusal in its
    reply and returns the failed Result it makes of it."""
    try:
        reply = await http.call("POST", url, json.dumps(body).encode(),
                                {**JSON_HEADERS, **(headers or {})}, timeout)
    except Exception as exc:  # network errors of every kind
        return Result.failed(describe(exc))
    if 300 <= reply.status < 400:
        # No retry changes where the URL points; the setting does (read at each send).
        return dataclasses.replace(
            Result.failed(redirected(reply), retryable=False, status=reply.status),
            reply=_excerpt(reply.body))
    if not 200 <= reply.status < 300:
        retryable = reply.status >= 500 or reply.status in RETRYABLE_STATUSES
        failed = Result.failed(f"HTTP {reply.status}: {_excerpt(reply.body)}",
                               retryable=retryable, status=reply.status)
        if refusal is not None:
            failed = refusal(failed, reply.body)
        return dataclasses.replace(failed, reply=_excerpt(reply.body))
    parsed = None
    try:
        parsed = None if reply.cut else json.loads(reply.body or b"null")
    except ValueError:
        log.warning("%s answered HTTP %s with a reply that is not JSON, taken as "
                    "delivered: %s", peer, reply.status, _excerpt(reply.body, 80))
    if reply.cut:
        log.warning("%s answered HTTP %s with a reply of more than %d bytes, not read "
                    "further, taken as delivered", peer, reply.status, len(reply.body))
    return Result(ok=True, status=reply.status, body=parsed, reply=_excerpt(reply.body))


def describe(exc: BaseException) -> str:
    """What went wrong on the network, and nothing else. Any other error's text may quote
    the request, and so a URL with a token in it (Telegram's): aiohttp's connection
    timeout does, so a timeout is named, not quoted."""
    name = type(exc).__name__
    if isinstance(exc, TimeoutError):
        return f"{name}: no answer in time"
    if (isinstance(exc, aiohttp.ClientConnectorError)
            and isinstance(exc.os_error, ConnectionRefusedError)):
        # aiohttp's text says only "Connect call failed": a peer down, not a slow one.
        return f"{name}: connection refused by {exc.host}:{exc.port}"
    if isinstance(exc, (OSError, aiohttp.ServerDisconnectedError)):
        return f"{name}: {exc}"
    return name


def _excerpt(body: bytes | None, limit: int = 200) -> str:
    return error_text((body or b"").decode("utf-8", "replace"), limit)
