"""What every HTML page of the service shares (the "I already filed" pages and the
operator console): headers that keep a page out of caches, search engines and other
sites' frames, and a database that does not answer shown as a 503 page."""
import logging
from types import TracebackType
from typing import Any, Awaitable

import tornado.web

from engine import lograte
from engine.commits import set_budget
from engine.db import UNAVAILABLE
from handlers.base import ExcInfo
from handlers.context import HandlerContext

log = logging.getLogger("receiver.http")
REPEATS = lograte.Repeats(log)


class HtmlHandler(tornado.web.RequestHandler):
    """A subclass shows its own error page: `show_error(status)`."""

    ctx: HandlerContext

    content_security_policy = "default-src 'none'; base-uri 'none'"
    referrer_policy = "no-referrer"

    def set_default_headers(self) -> None:
        self.clear_header("Server")
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("Content-Security-Policy", self.content_security_policy)
        self.set_header("X-Frame-Options", "DENY")
        self.set_header("Referrer-Policy", self.referrer_policy)
        self.set_header("X-Robots-Tag", "noindex")

    def prepare(self) -> Awaitable[None] | None:
        set_budget(self.ctx.settings.database_call_budget_seconds)
        return None

    def show_error(self, status: int) -> None:
        """Answer the error page of `status`."""
        raise NotImplementedError

    def write_error(self, status_code: int, exc_info: ExcInfo | None = None,
                    **kwargs: Any) -> None:
        if exc_info and isinstance(exc_info[1], UNAVAILABLE):
            self.set_header("Retry-After", "30")
            status_code = 503
        self.show_error(status_code)

    def log_exception(self, typ: type[BaseException] | None, value: BaseException | None,
                      tb: TracebackType | None) -> None:
        if isinstance(value, UNAVAILABLE):
            # Every page asked for in an outage fails so (4,378 traceback lines in 30 s
            # when each was written): one line per kind of page, then a count.
            REPEATS.error(("unavailable", type(self).__name__), "database unavailable: %s "
                          "%s: %s", self.request.method, self.request.path, value)
        else:
            super().log_exception(typ, value, tb)
