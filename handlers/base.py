"""What every handler shares: body limits, JSON answers, one error format, secrets."""
import hmac
import json
import logging
import re
from types import TracebackType
from typing import Any, NoReturn

import tornado.web

from engine import lograte
from engine.commits import set_budget
from engine.db import UNAVAILABLE
from engine.payload import read_json
from handlers.addresses import client_key, peer_address
from handlers.context import HandlerContext

log = logging.getLogger("receiver.http")
REPEATS = lograte.Repeats(log)

# What tornado hands write_error: the exception being answered.
ExcInfo = tuple[type[BaseException], BaseException, TracebackType]


def same_secret(given: str | None, expected: str | None) -> bool:
    """Constant-time comparison; a missing value never matches.

    A header value is text decoded from its bytes as latin-1 (HTTP's rule), so a
    non-ASCII secret sent as UTF-8, as every client sends it, arrives as other text:
    its bytes are compared too. Both comparisons always run."""
    if not given or not expected:
        return False
    wanted = expected.encode("utf-8")
    try:
        sent = given.encode("latin-1")
    except UnicodeEncodeError:  # not from a header: text as it is
        sent = given.encode("utf-8")
    as_text = hmac.compare_digest(given.encode("utf-8"), wanted)
    return hmac.compare_digest(sent, wanted) | as_text


def takes_body(handler_class: type[tornado.web.RequestHandler]) -> bool:
    """Whether a route's handler answers POST or PUT (tornado's own answer 405)."""
    return (handler_class.post is not tornado.web.RequestHandler.post
            or handler_class.put is not tornado.web.RequestHandler.put)


@tornado.web.stream_request_body
class ApiHandler(tornado.web.RequestHandler):
    """A JSON handler that reads its body itself, so an oversize body is refused with
    413 from its Content-Length before a byte of it is read (or, sent in chunks, as soon
    as it has gone past the limit), and the raw bytes are kept unmodified for signature
    checks. The HTTP server leaves the size of these bodies to the handler
    (app.server), so every oversize body gets the same answer and one log line."""

    # The largest body this endpoint's senders send; MAX_BODY_BYTES caps every endpoint.
    # A route without POST takes no body at all.
    body_limit: int | None = None

    def initialize(self, ctx: HandlerContext) -> None:
        self.ctx = ctx
        self._body = bytearray()
        self._refused = False
        self._held = 0
        # Whether the headers carried valid credentials (check_headers): the body then
        # counts in the process's body cap only, not in its address's.
        self.authenticated = False

    @property
    def client(self) -> str:
        """The address's key for its allowances (handlers.addresses)."""
        return client_key(peer_address(self.request))

    @property
    def max_body_bytes(self) -> int:
        if not takes_body(type(self)):
            return 0
        limit = self.ctx.settings.max_body_bytes
        return limit if self.body_limit is None else min(limit, self.body_limit)

    def set_default_headers(self) -> None:
        self.clear_header("Server")
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")

    def prepare(self) -> None:
        set_budget(self.ctx.settings.database_call_budget_seconds)
        declared = self.request.headers.get("Content-Length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            self.fail(413, "request body too large")
        if self.request.method == "POST" and takes_body(type(self)):
            self.authenticated = bool(self.check_headers())

    def check_headers(self) -> bool:
        """Refuse a POST on what its headers say, before a byte of its body is read (and
        held in memory): credentials sent in headers are checked here. Returns True when
        the headers carry credentials, all of them right."""
        return False

    def data_received(self, chunk: bytes) -> None:
        if self._refused:
            return
        if len(self._body) + len(chunk) > self.max_body_bytes:
            # A chunked body gone past the limit.
            self.refuse_body(413, "request body too large")
            return
        short = self.ctx.bodies.take(self.client, len(chunk),
                                     per_client=not self.authenticated)
        if short:
            # This address, or all of them together, hold as much body as we keep.
            REPEATS.warning(("bodies", short), "request bodies in memory at the %s cap "
                            "(%s): refusing more", short, self.client)
            self.set_header("Retry-After", "5")
            self.refuse_body(*((429, "too many requests") if short == "client"
                               else (503, "temporarily unavailable")))
            return
        self._held += len(chunk)
        self._body += chunk

    def refuse_body(self, status: int, message: str) -> None:
        """Answered now, while the body comes in: the connection is closed once the
        answer is out, so the rest is never read, nor the request handled."""
        self._refused = True
        self.release_body()
        self.answer(status, {"error": message})

    def release_body(self) -> None:
        self.ctx.bodies.give_back(self.client, self._held, per_client=not self.authenticated)
        self._held = 0
        self._body = bytearray()

    def on_finish(self) -> None:
        self.release_body()

    def on_connection_close(self) -> None:
        super().on_connection_close()
        self.release_body()

    def refuse_credentials(self, status: int, message: str, why: str) -> NoReturn:
        """A failed authentication, answered `status` `{"error": message}`: or 429 with
        Retry-After once this address has failed AUTH_FAILURE_LIMIT times within
        AUTH_FAILURE_WINDOW_SECONDS. Only failures are counted and only failures are
        refused so: a call with the right credentials is never throttled, whatever
        its address has failed before (Stripe, SHKeeper and Frappe each call from a
        few addresses, shared with whoever else is there)."""
        client = self.client
        wait = self.ctx.auth_failures.acquire(client)
        if wait:
            REPEATS.warning(("throttled", client), "%s %s: too many failed authentications "
                            "from %s; answering 429", self.request.method,
                            self.request.path, client)
            self.set_header("Retry-After", str(wait))
            self.fail(429, "too many requests")
        REPEATS.warning(("refused", client, why), "%s %s refused from %s: %s",
                        self.request.method, self.request.path, client, why)
        self.fail(status, message)

    @property
    def raw_body(self) -> bytes:
        return bytes(self._body)

    def json_body(self) -> dict[str, Any]:
        """The body as a JSON object, or a 400 answer."""
        try:
            body = read_json(self.raw_body)
        except ValueError:
            self.fail(400, "invalid JSON body")
        if not isinstance(body, dict):
            self.fail(400, "invalid JSON body")
        return body

    def answer(self, status: int, body: object) -> None:
        self.set_status(status)
        self.finish(json.dumps(body))

    def fail(self, status: int, message: str) -> NoReturn:
        """Answer `{"error": message}` with `status` and stop handling the request."""
        self.answer(status, {"error": message})
        raise tornado.web.Finish()

    def write_error(self, status_code: int, exc_info: ExcInfo | None = None,
                    **kwargs: Any) -> None:
        if exc_info and isinstance(exc_info[1], UNAVAILABLE):
            # The sender will retry a 503; it must not take us for having stored it.
            self.set_status(503)
            self.set_header("Retry-After", "30")
            message = "temporarily unavailable"
        else:
            message = {404: "not found", 405: "method not allowed"}.get(
                status_code, "internal error" if status_code >= 500 else self._reason.lower())
        self.finish(json.dumps({"error": message}))

    def log_exception(self, typ: type[BaseException] | None, value: BaseException | None,
                      tb: TracebackType | None) -> None:
        if isinstance(value, UNAVAILABLE):
            # Every call in an outage fails so: one line, then a count.
            REPEATS.error(("unavailable", self.request.path), "database unavailable: %s %s: %s",
                          self.request.method, self.request.path, value)
        else:
            super().log_exception(typ, value, tb)


class NotFoundHandler(ApiHandler):
    def prepare(self) -> None:
        self.fail(404, "not found")


# Paths that carry personal data, and what the access log writes instead: the route's
# pattern. Anything below /api/v1/referral/ but `check` is a customer's e-mail address
# (also a path no route matched: a mistyped one still holds the address).
PERSONAL_PATHS = ((re.compile(r"/api/v1/referral/(?!check\Z)."), "/api/v1/referral/<email>"),)


def logged_path(path: str) -> str:
    for pattern, shown in PERSONAL_PATHS:
        if pattern.match(path):
            return shown
    return path


ACCESS_REPEATS = lograte.Repeats("receiver.access")


def log_request(handler: tornado.web.RequestHandler) -> None:
    """One access-log line per request. The path only (query strings can carry tokens),
    and a route's pattern instead of a path that holds personal data. A client kept at
    bay with 429 would write a line per call at whatever rate it calls: those are
    written once a minute per path, with their count."""
    status = handler.get_status()
    level = logging.INFO if status < 400 else logging.WARNING if status < 500 else logging.ERROR
    path = logged_path(handler.request.path)
    ms = round(1000.0 * handler.request.request_time(), 1)
    line = ("%d %s %s %.1fms", status, handler.request.method, path, ms)
    # The same as fields of their own, for the JSON log's readers (app.logs).
    fields = {"status": status, "method": handler.request.method, "path": path, "ms": ms}
    if status == 429:
        ACCESS_REPEATS.log(level, (handler.request.method, path), *line, extra=fields)
    else:
        logging.getLogger("receiver.access").log(level, *line, extra=fields)
