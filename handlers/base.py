"""What every handler shares: body limits, JSON answers, one error format, secrets."""
import hmac
import json
import logging
import re

import tornado.web

import lograte
from engine.db import UNAVAILABLE
from engine.payload import read_json

log = logging.getLogger("receiver.http")
REPEATS = lograte.Repeats(log)


def same_secret(given, expected):
    """Constant-time comparison; a missing value never matches."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


@tornado.web.stream_request_body
class ApiHandler(tornado.web.RequestHandler):
    """A JSON handler that reads its body itself, so an oversize body is refused with
    413 from its Content-Length before a byte of it is read (or, sent in chunks, as soon
    as it has gone past the limit), and the raw bytes are kept unmodified for signature
    checks. The HTTP server leaves the size of these bodies to the handler
    (app.server), so every oversize body gets the same answer and one log line."""

    # The largest body this endpoint's senders send; MAX_BODY_BYTES caps every endpoint.
    body_limit = None

    def initialize(self, ctx):
        self.ctx = ctx
        self._body = bytearray()
        self._too_large = False

    @property
    def max_body_bytes(self):
        limit = self.ctx.settings.max_body_bytes
        return limit if self.body_limit is None else min(limit, self.body_limit)

    def set_default_headers(self):
        self.clear_header("Server")
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")

    def prepare(self):
        declared = self.request.headers.get("Content-Length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            self.fail(413, "request body too large")

    def data_received(self, chunk):
        if self._too_large:
            return
        if len(self._body) + len(chunk) > self.max_body_bytes:
            # A chunked body gone past the limit: answered now, and the connection is
            # closed once the answer is out, so the rest is never read (nor handled).
            self._too_large = True
            self._body = bytearray()
            self.answer(413, {"error": "request body too large"})
            return
        self._body += chunk

    @property
    def raw_body(self):
        return bytes(self._body)

    def json_body(self):
        """The body as a JSON object, or a 400 answer."""
        try:
            body = read_json(self.raw_body)
        except ValueError:
            self.fail(400, "invalid JSON body")
        if not isinstance(body, dict):
            self.fail(400, "invalid JSON body")
        return body

    def answer(self, status, body):
        self.set_status(status)
        self.finish(json.dumps(body))

    def fail(self, status, message):
        """Answer `{"error": message}` with `status` and stop handling the request."""
        self.answer(status, {"error": message})
        raise tornado.web.Finish()

    def write_error(self, status_code, exc_info=None, **kwargs):
        if exc_info and isinstance(exc_info[1], UNAVAILABLE):
            # The sender will retry a 503; it must not take us for having stored it.
            self.set_status(503)
            self.set_header("Retry-After", "30")
            message = "temporarily unavailable"
        else:
            message = {404: "not found", 405: "method not allowed"}.get(
                status_code, "internal error" if status_code >= 500 else self._reason.lower())
        self.finish(json.dumps({"error": message}))

    def log_exception(self, typ, value, tb):
        if isinstance(value, UNAVAILABLE):
            # Every call in an outage fails so: one line, then a count.
            REPEATS.error(("unavailable", self.request.path), "database unavailable: %s %s: %s",
                          self.request.method, self.request.path, value)
        else:
            super().log_exception(typ, value, tb)


class NotFoundHandler(ApiHandler):
    def prepare(self):
        self.fail(404, "not found")


# Paths that carry personal data, and what the access log writes instead: the route's
# pattern. Anything below /api/v1/referral/ but `check` is a customer's e-mail address
# (also a path no route matched: a mistyped one still holds the address).
PERSONAL_PATHS = ((re.compile(r"/api/v1/referral/(?!check\Z)."), "/api/v1/referral/<email>"),)


def logged_path(path):
    for pattern, shown in PERSONAL_PATHS:
        if pattern.match(path):
            return shown
    return path


def log_request(handler):
    """One access-log line per request. The path only (query strings can carry tokens),
    and a route's pattern instead of a path that holds personal data."""
    status = handler.get_status()
    level = logging.INFO if status < 400 else logging.WARNING if status < 500 else logging.ERROR
    logging.getLogger("receiver.access").log(
        level, "%d %s %s %.1fms", status, handler.request.method,
        logged_path(handler.request.path), 1000.0 * handler.request.request_time())
