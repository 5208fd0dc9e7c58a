"""The one place where an outbound HTTP call is made and its outcome classified."""
import dataclasses
import json
import socket

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.iostream import StreamClosedError
from tornado.netutil import DefaultLoopResolver, is_valid_ip

# Statuses worth asking again; any other 4xx is the peer refusing for good.
RETRYABLE_STATUSES = {408, 425, 429}


@dataclasses.dataclass(frozen=True)
class Result:
    ok: bool
    retryable: bool = False
    error: str = ""
    status: int = 0
    body: object = None
    # False when the peer is not configured at all: no try has been made, so the effect
    # waits for the configuration instead of using up its attempts.
    configured: bool = True

    def __bool__(self):
        return self.ok

    @classmethod
    def failed(cls, error, retryable=True, status=0, configured=True):
        return cls(ok=False, retryable=retryable, error=error, status=status,
                   configured=configured)


class AddressResolver(DefaultLoopResolver):
    """Resolves an IP address to itself on the spot; Tornado's own resolver hands every
    host, addresses too (a worker at 127.0.0.1, say), to a thread for getaddrinfo."""

    async def resolve(self, host, port, family=socket.AF_UNSPEC):
        if is_valid_ip(host):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            if family in (socket.AF_UNSPEC, address_family):
                return [(address_family, (host, port))]
        return await super().resolve(host, port, family)


def new_http_client(max_clients=200):
    """A client of our own: a slow peer may hold many requests open at once without
    queueing anybody else's behind it (Tornado's shared default allows only 10)."""
    return AsyncHTTPClient(force_instance=True, max_clients=max_clients,
                           resolver=AddressResolver())


async def post_json(http, url, body, headers=None, timeout=10.0):
    """POST `body` as JSON; a 2xx with a JSON reply is ok, anything else is a failed Result."""
    request = HTTPRequest(
        url, method="POST", body=json.dumps(body),
        headers={"Content-Type": "application/json", "Accept": "application/json",
                 **(headers or {})},
        connect_timeout=min(timeout, 5.0), request_timeout=timeout)
    try:
        response = await http.fetch(request, raise_error=False)
    except Exception as exc:  # network errors of every kind
        return Result.failed(describe(exc))
    if response.code == 599:
        return Result.failed(f"connection failed: {response.error}")
    if not 200 <= response.code < 300:
        retryable = response.code >= 500 or response.code in RETRYABLE_STATUSES
        return Result.failed(f"HTTP {response.code}: {_excerpt(response.body)}",
                             retryable=retryable, status=response.code)
    try:
        parsed = json.loads(response.body or b"null")
    except ValueError:
        return Result.failed(f"HTTP {response.code} with an unreadable reply: "
                             f"{_excerpt(response.body)}", status=response.code)
    return Result(ok=True, status=response.code, body=parsed)


# Errors whose text says what went wrong on the network and nothing else. Any other
# error's text may quote the request, and so a URL with a token in it (Telegram's).
NETWORK_ERRORS = (OSError, StreamClosedError, HTTPClientError)


def describe(exc):
    if isinstance(exc, NETWORK_ERRORS):
        return f"{type(exc).__name__}: {exc}"
    return type(exc).__name__


def _excerpt(body, limit=200):
    text = (body or b"").decode("utf-8", "replace")
    return text if len(text) <= limit else text[:limit] + "…"


