"""/api/v1/ifta/filed and /api/v1/ucr/filed: the "I already filed" links of the reminder
e-mails.

A GET records nothing: mail scanners (Microsoft Defender Safe Links, Mimecast,
Proofpoint, Gmail's prefetch) fetch every link of a mail, and would stop a customer's
reminders before the customer read it (RFC 8058 asks one-click unsubscribe to be a POST
for the same reason). The GET shows the question and one button; the button POSTs the
same order, cycle and token, and the POST records the time, once: every later POST shows
the page with that first time, and so does a GET once it is recorded. The token is
checked before the order is looked up, so a caller without a valid link learns nothing
about which orders exist."""
import datetime
import functools
from typing import Any, NoReturn

import tornado.web

from domain import filings, links
from engine.transaction import Transaction
from handlers.context import HandlerContext
from handlers.html import HtmlHandler
from handlers.ratelimit import RateLimited, RateLimiter
from models import OrderBase

KIND_TITLES = {"ifta": "IFTA fuel-tax return", "ucr": "UCR annual registration"}
ERROR_TEXTS = {
    429: ("Too many requests", "Please wait a minute, then open the link again."),
    503: ("Temporarily unavailable", "Please open the link again in a few minutes."),
}
GENERIC_ERROR = ("Something went wrong", "Please open the link again later.")


class PageHandler(HtmlHandler):
    """An HTML page: Jinja2 (autoescaped) from templates/pages/, and errors as pages."""

    # The page needs no script. The URL carries a token, which the default no-referrer
    # policy keeps from leaking onward; its one form posts back here, nowhere else.
    content_security_policy = ("default-src 'none'; style-src 'unsafe-inline'; "
                               "base-uri 'none'; form-action 'self'")

    def initialize(self, ctx: HandlerContext) -> None:
        self.ctx = ctx

    def show(self, status: int, template: str, **values: Any) -> None:
        self.set_status(status)
        page = self.ctx.templates.get_template(f"pages/{template}.html")
        self.finish(page.render(**values))

    def stop_with(self, status: int, template: str, **values: Any) -> NoReturn:
        self.show(status, template, **values)
        raise tornado.web.Finish()

    def show_error(self, status: int) -> None:
        heading, text = ERROR_TEXTS.get(status, GENERIC_ERROR)
        self.show(status, "error", heading=heading, text=text)


class FiledLinkHandler(RateLimited, PageHandler):
    # Tornado calls `initialize` with the route's own arguments (handlers.routes): each
    # handler takes its own, whatever its bases take.
    def initialize(  # type: ignore[override]
            self, ctx: HandlerContext, limiter: RateLimiter, kind: str) -> None:
        super().initialize(ctx, limiter)
        self.kind = kind

    def refuse_too_many(self) -> NoReturn:
        self.show_error(429)
        raise tornado.web.Finish()

    async def head(self) -> None:
        """Link checkers send HEAD: answered as GET would be."""
        await self.checked_link()
        self.set_status(200)

    async def get(self) -> None:
        """The question and its button; once recorded, the page with the first time."""
        order, cycle, token = await self.checked_link()
        filed_at = await self.ctx.db(functools.partial(
            links.self_filed_at, Transaction(self.ctx), self.kind, order.order_number, cycle))
        if filed_at is not None:
            self.show_filed(order, cycle, filed_at, first_time=False)
            return
        self.show(200, "confirm_filed", title=self.title, action=self.request.path,
                  order_number=order.order_number, cycle=cycle, token=token,
                  customer_name=order.customer_name or "")

    async def post(self) -> None:
        """The button: records the filing (once) and stops that cycle's reminders."""
        order, cycle, _ = await self.checked_link()
        filed_at, first_time = await self.ctx.db(functools.partial(
            links.record_self_filed, Transaction(self.ctx), self.kind, order.order_number, cycle,
            self.ctx.clock()))
        self.show_filed(order, cycle, filed_at, first_time)

    def show_filed(self, order: OrderBase, cycle: str, filed_at: datetime.datetime,
                   first_time: bool) -> None:
        self.show(200, "filed", title=self.title, kind=self.kind,
                  order_number=order.order_number, cycle=cycle,
                  customer_name=order.customer_name or "", filed_at=filed_at,
                  first_time=first_time)

    @property
    def title(self) -> str:
        return KIND_TITLES[self.kind]

    async def checked_link(self) -> tuple[OrderBase, str, str]:
        """(order, cycle, token) of a valid link to a known order of this kind, for a
        cycle of this kind, from the query (GET, HEAD) or the button's form (POST); else
        the 403 or 404 page (what `receiver.py link` refuses to sign, signed before it
        refused, records nothing)."""
        order_number, cycle, token = (self.get_argument(name, "").strip()
                                      for name in ("order", "cycle", "token"))
        if not links.token_valid(self.ctx.settings.link_secret, self.kind, order_number,
                                 cycle, token):
            self.stop_with(403, "invalid_link", title=self.title)
        try:
            order = await self.ctx.db(functools.partial(
                filings.check_link, Transaction(self.ctx), self.ctx.settings, self.kind,
                order_number, cycle))
            return order, cycle, token
        except filings.UnknownOrder:
            self.stop_with(404, "unknown_order", title=self.title)
        except (filings.LinkRefused, links.InvalidLinkPart):
            self.stop_with(404, "not_reminded", title=self.title)
