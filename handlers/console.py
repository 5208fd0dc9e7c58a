"""The operator console under /console: server-rendered pages (Jinja2, autoescaped, no
script at all) to see what came in, what went out and what failed, and to act on it.

Off unless CONSOLE_PASSWORD_HASH is set (no /console route exists then). An operator
logs in with a name (kept in the record of actions) and the console's password; the
session is a signed cookie (COOKIE_SECRET) with an expiry, HttpOnly, SameSite=Strict,
Secure when the request came over HTTPS. Every POST carries Tornado's xsrf token; the
webhooks are not affected, the check is made by these handlers only. Login attempts are
rate limited per client address. Every action is recorded (ops.console.record_action).

Every action answers its POST with a redirect (303) to the page it came from, which
shows once what the action did and what comes next (the notice travels in a signed
cookie): a reload of that page asks nothing again.

Longer than most: one small handler a page or action, sharing the session, xsrf and
action-recording base defined here."""
import concurrent.futures
import datetime
import functools
import hmac
import json
import logging
import re
import secrets
import urllib.parse
from typing import Any, NoReturn

import markupsafe
import tornado.httputil
import tornado.ioloop
import tornado.web

from engine import lograte
from domain import filings, intake, links
from handlers.context import HandlerContext
from handlers.html import HtmlHandler
from handlers.addresses import client_key, peer_address
from handlers.ratelimit import LoginThrottle
from engine.claims import CLAIM_BATCH
from engine.inbox import WAITING
from engine.transaction import Transaction
from ops import console, operator, sessions
from ops.passwords import verify_password
from settings import Settings

log = logging.getLogger("receiver.console")
REPEATS = lograte.Repeats(log)

# Password checks, one at a time in a thread of their own: 20 guesses at once were 20
# scrypts at once, taking every core from the webhooks (and the default executor from
# the readiness probe).
PASSWORD_CHECKS = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="password")

SESSION_COOKIE = "console_session"
# What an action did, shown once by the page it redirects to.
NOTICE_COOKIE = "console_notice"
# A browser that has logged in: its login tries have a budget of their own
# (handlers.ratelimit.LoginThrottle). A random name, signed; it opens nothing.
KNOWN_BROWSER_COOKIE = "console_browser"
KNOWN_BROWSER_DAYS = 90
# A notice not shown within this long (the redirect was not followed) is dropped.
NOTICE_MAX_AGE_DAYS = 1 / 24 / 12
SESSION_LENGTH = datetime.timedelta(hours=12)
# Wrong passwords per address, and in all, per window (handlers.ratelimit.LoginThrottle).
LOGIN_FAILURES, LOGIN_FAILURES_TOTAL, LOGIN_WINDOW_SECONDS = 5, 30, 60
OPERATOR_NAME = re.compile(r"[^\x00-\x1f\x7f]{1,64}")
# No script anywhere; styles from our own stylesheet; nothing may frame a page.
CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'self'; img-src 'self'; "
                           "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
ERROR_TEXTS = {
    400: "The request was not understood.",
    403: "Refused: the form was stale or did not come from this console. Reload the page "
         "and try again.",
    404: "Nothing here.",
    429: "Too many wrong passwords. Wait a minute, then try again.",
    503: "The database is not answering. Try again in a minute.",
}
CHART_COLOURS = ("#3366cc", "#dc7633", "#2e8b57", "#8e44ad")


def cookie_secret(settings: Settings) -> str:
    """The key that signs session cookies. Without COOKIE_SECRET (development only:
    production refuses to start) a key of this process's own: sessions end at restart."""
    return settings.cookie_secret or secrets.token_urlsafe(32)


def path_part(value: str) -> str:
    """A value as one segment of a path: a "/" in an order number is escaped too."""
    return urllib.parse.quote(value, safe="")


def console_path(wanted: str, default: str) -> str:
    """`wanted` when it is a console page of ours (never another site, nor the login
    page), else `default`: where a login or an action sends the browser on."""
    if re.fullmatch(r"/console/[^\\\s]*", wanted) and not wanted.startswith("/console/login"):
        return wanted
    return default


class ConsoleState:
    """What the console's handlers share: the login throttle, the chart's counts."""

    def __init__(self) -> None:
        self.login_throttle = LoginThrottle(LOGIN_FAILURES, LOGIN_FAILURES_TOTAL,
                                            LOGIN_WINDOW_SECONDS)
        self.event_counts = console.EventCounts()


class ConsoleHandler(HtmlHandler):
    # The login page and the stylesheet are for everyone; the rest for operators only.
    public = False
    content_security_policy = CONTENT_SECURITY_POLICY
    referrer_policy = "same-origin"

    # Whether the page looks the operator's session up (the stylesheet does not).
    needs_session = True

    def initialize(self, ctx: HandlerContext, state: ConsoleState) -> None:
        self.ctx = ctx
        self.state = state
        self.session_token: str | None = None
        self.current_user = None

    async def prepare(self) -> None:
        super().prepare()
        token = self.get_signed_cookie(SESSION_COOKIE, max_age_days=1)
        if token and self.needs_session:
            self.session_token = token.decode("ascii", "replace")
            # The operator's name, from a session neither ended nor expired.
            self.current_user = await self.ctx.db(functools.partial(
                sessions.operator_of, self.session_token,
                self.ctx.settings.console_password_hash, self.ctx.clock()))
        if self.request.method == "POST":
            self.check_xsrf_cookie()
        if not self.public and self.current_user is None:
            if self.request.method in ("GET", "HEAD"):
                self.redirect("/console/login?" + tornado.httputil.urlencode(
                    {"next": self.request.uri}))
                raise tornado.web.Finish()
            raise tornado.web.HTTPError(403)

    @property
    def xsrf_token(self) -> bytes:
        """With a session, the forms' token is derived from it: an `_xsrf` cookie planted
        in the operator's browser (a sibling site can set one) and the same value in a
        forged form no longer pass. Without one (the login form), Tornado's own."""
        if self.current_user is None or self.session_token is None:
            return super().xsrf_token
        secret = self.application.settings["cookie_secret"].encode("utf-8")
        return hmac.new(secret, b"xsrf:" + self.session_token.encode("utf-8"),
                        "sha256").hexdigest().encode("ascii")

    def check_xsrf_cookie(self) -> None:
        if self.current_user is None:
            super().check_xsrf_cookie()
            return
        given = (self.get_argument("_xsrf", None) or self.request.headers.get("X-Xsrftoken")
                 or self.request.headers.get("X-Csrftoken") or "")
        if not hmac.compare_digest(given.encode("utf-8"), self.xsrf_token):
            raise tornado.web.HTTPError(403, "'_xsrf' argument does not match the session")

    def set_cookie(self, name: str, value: str | bytes, *args: Any, **kwargs: Any) -> None:
        """Every console cookie (the session and the xsrf token alike) is for /console
        only, out of reach of page scripts, never sent with another site's request, and
        only over HTTPS when the console is reached over HTTPS."""
        kwargs.setdefault("path", "/console")
        kwargs.setdefault("httponly", True)
        kwargs.setdefault("samesite", "Strict")
        kwargs.setdefault("secure", self.request.protocol == "https")
        super().set_cookie(name, value, *args, **kwargs)

    def clear_cookie(self, name: str, **kwargs: Any) -> None:
        kwargs.setdefault("path", "/console")
        super().clear_cookie(name, **kwargs)

    def render_page(self, template: str, code: int = 200, **values: Any) -> None:
        self.set_status(code)
        page = self.ctx.templates.get_template(f"console/{template}.html")
        self.finish(page.render(
            operator=self.current_user if not self.public else None,
            xsrf=markupsafe.Markup(self.xsrf_form_html()), fmt=operator.format_time,
            now=self.ctx.clock(), path=self.request.path, here=self.request.uri,
            path_part=path_part, destination_of=operator.destination_of,
            in_flight=functools.partial(operator.in_flight, self.ctx),
            effect_name=functools.partial(console.effect_name, self.ctx),
            notice=None if self.public else self.take_notice(), **values))

    def redirect_with(self, default: str, text: str, refused: bool = False,
                      code: str | None = None) -> None:
        """The end of every action (POST/redirect/GET): back to the page the form was on
        (its `back` field, a console path) or to `default`, which shows `text` once;
        `refused`: the action was not done; `code`: a value shown apart (a signed link)."""
        self.set_signed_cookie(NOTICE_COOKIE, json.dumps(
            {"text": text, "refused": refused, "code": code}))
        self.redirect(console_path(self.get_body_argument("back", ""), default), status=303)

    def take_notice(self) -> dict[str, Any] | None:
        """The notice an action left for this page, once."""
        value = self.get_signed_cookie(NOTICE_COOKIE, max_age_days=NOTICE_MAX_AGE_DAYS)
        if NOTICE_COOKIE in self.request.cookies:
            self.clear_cookie(NOTICE_COOKIE)
        if not value:
            return None
        try:
            notice = json.loads(value)
        except ValueError:
            return None
        return notice if isinstance(notice, dict) and notice.get("text") else None

    def stop_with(self, template: str, code: int, **values: Any) -> NoReturn:
        self.render_page(template, code, **values)
        raise tornado.web.Finish()

    async def record(self, action: str, target: str | int = "", outcome: str = "",
                     who: str | None = None, at: datetime.datetime | None = None) -> None:
        await self.ctx.db(functools.partial(
            console.record_action, self.ctx, who or self.current_user,
            peer_address(self.request), action, target, outcome, at))

    def show_error(self, status: int) -> None:
        self.public = True  # an error page shows no operator's data
        self.render_page("error", status, text=ERROR_TEXTS.get(status, "Something went wrong."))

    def text_argument(self, name: str, max_length: int = 200) -> str:
        value = self.get_argument(name, "").strip()
        if len(value) > max_length or "\x00" in value:
            raise tornado.web.HTTPError(400)
        return value


class StyleHandler(ConsoleHandler):
    public = True
    needs_session = False

    def get(self) -> None:
        self.set_header("Content-Type", "text/css; charset=utf-8")
        self.set_header("Cache-Control", "max-age=3600")
        loader = self.ctx.templates.loader
        assert loader is not None  # app.context.template_environment sets one
        self.finish(loader.get_source(self.ctx.templates, "console/console.css")[0])


class LoginHandler(ConsoleHandler):
    public = True

    def get(self) -> None:
        self.render_page("login", next=self.next_path(), problem=None)

    async def post(self) -> None:
        name = self.get_body_argument("name", "").strip()
        password = self.get_body_argument("password", "")
        if not OPERATOR_NAME.fullmatch(name):
            self.stop_with("login", 400, next=self.next_path(),
                           problem="Give your name (up to 64 characters): it goes in the "
                                   "record of what was done.")
        throttle = self.state.login_throttle
        known = self.known_browser()
        wait = throttle.take_a_check(known)
        if wait:
            self.ctx.metrics.login_failed("unchecked")
            if known is None:
                REPEATS.warning("unchecked", "console: the budget of wrong passwords is "
                                "spent; logins refused unchecked for a while (browsers "
                                "that have logged in before have their own)")
            self.refuse_login(wait)
        # scrypt takes a tenth of a second (and 32 MiB) on purpose: off the event loop,
        # one at a time.
        right = await tornado.ioloop.IOLoop.current().run_in_executor(
            PASSWORD_CHECKS, verify_password, password, self.ctx.settings.console_password_hash)
        if not right:
            # Counted and logged, not recorded: the record of actions is the operators',
            # and a name typed by a stranger has no place in it.
            self.ctx.metrics.login_failed("wrong_password")
            client = client_key(peer_address(self.request))
            REPEATS.warning(("wrong password", client), "console: wrong password from %s",
                            client)
            wait = throttle.wrong(client, known)
            if wait:
                self.refuse_login(wait)
            self.stop_with("login", 403, next=self.next_path(), problem="Wrong password.")
        throttle.right(known)
        self.set_signed_cookie(KNOWN_BROWSER_COOKIE, known or secrets.token_urlsafe(16),
                               expires_days=KNOWN_BROWSER_DAYS)
        now = self.ctx.clock()
        token = await self.ctx.db(functools.partial(
            sessions.open_session, name, self.ctx.settings.console_password_hash, now,
            SESSION_LENGTH))
        self.set_signed_cookie(SESSION_COOKIE, token, expires=now + SESSION_LENGTH)
        await self.record("login", outcome="ok", who=name)
        self.redirect(self.next_path())

    def known_browser(self) -> str | None:
        """This browser's name, when it has logged in before (signed by this console)."""
        value = self.get_signed_cookie(KNOWN_BROWSER_COOKIE, max_age_days=KNOWN_BROWSER_DAYS)
        return value.decode("ascii", "replace") if value else None

    def refuse_login(self, wait: int) -> NoReturn:
        self.set_header("Retry-After", str(wait))
        self.stop_with("error", 429, text=ERROR_TEXTS[429])

    def next_path(self) -> str:
        """Where to go after logging in: a console page of ours, never another site."""
        return console_path(self.get_argument("next", ""), "/console/")


class LogoutHandler(ConsoleHandler):
    async def post(self) -> None:
        # The session ends here, for every copy of its cookie.
        assert self.session_token is not None  # prepare lets in a session's operator only
        await self.ctx.db(functools.partial(sessions.end_session, self.session_token,
                                            self.ctx.clock()))
        await self.record("logout", outcome="ok")
        self.clear_cookie(SESSION_COOKIE)
        self.redirect("/console/login")


class OverviewHandler(ConsoleHandler):
    async def get(self) -> None:
        overview, actions, waiting, facts = await self.ctx.db(lambda: (
            console.overview(self.ctx, self.state.event_counts), console.recent_actions(10),
            intake.waiting_calls(Transaction(self.ctx)),
            intake.facts_waiting(Transaction(self.ctx))))
        self.render_page("overview", overview=overview, chart=chart(overview.events_by_day),
                         actions=actions, last_success=self.last_success, waiting=waiting,
                         facts=facts)

    @staticmethod
    def last_success(timestamp: float | None) -> str:
        if not timestamp:
            return "never"
        return operator.format_time(
            datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc))


def chart(events_by_day: dict[str, list[int]], width: int = 560, height: int = 160,
          gap: int = 2) -> dict[str, Any]:
    """Bars for a server-rendered SVG: one group per 24-hour window, one bar per source."""
    sources = list(events_by_day)
    days = console.CHART_DAYS
    top = max((count for counts in events_by_day.values() for count in counts), default=0)
    group = width / days
    bar = max(1.0, (group - 4 * gap) / max(1, len(sources)))
    bars = []
    for s, source in enumerate(sources):
        for day, count in enumerate(events_by_day[source]):
            tall = 0 if not top else round((height - 20) * count / top, 1)
            bars.append({"x": round(day * group + 2 * gap + s * bar, 1), "y": height - 20 - tall,
                         "width": round(bar - gap, 1), "height": tall, "count": count,
                         "source": source, "colour": CHART_COLOURS[s % len(CHART_COLOURS)]})
    labels = [{"x": round(day * group + group / 2, 1),
               "text": "last 24 h" if day == days - 1 else f"{days - 1 - day} d before"}
              for day in range(days)]
    legend = [{"source": source, "colour": CHART_COLOURS[s % len(CHART_COLOURS)]}
              for s, source in enumerate(sources)]
    return {"width": width, "height": height, "bars": bars, "labels": labels,
            "legend": legend, "top": top}


EVENT_FILTERS = ("source", "type", "status", "q", "since", "until")


class EventFilterHandler(ConsoleHandler):
    """A page or action that takes the events page's filter."""

    def bulk_filter(self) -> console.EventFilter:
        """The filter of a bulk action: by one of the two statuses of failure, or by
        `waiting` (the facts waiting for their order), as the events page offers it."""
        filters = self.event_filter()
        if filters.status not in operator.GIVEN_UP_FROM:
            raise tornado.web.HTTPError(400)
        return filters

    def event_filter(self) -> console.EventFilter:
        return console.EventFilter(
            source=self.text_argument("source"), event_type=self.text_argument("type"),
            status=self.text_argument("status"), search=self.text_argument("q"),
            since=self.time_argument("since"), until=self.time_argument("until"))

    def time_argument(self, name: str) -> datetime.datetime | None:
        text = self.text_argument(name, 40)
        if not text:
            return None
        try:
            return operator.parse_time(text)
        except ValueError:
            raise tornado.web.HTTPError(400) from None

    def events_page(self) -> str:
        """The events page of this filter, where a bulk action goes back to."""
        query = {name: self.get_argument(name, "") for name in EVENT_FILTERS}
        return "/console/events?" + tornado.httputil.urlencode(
            {name: value for name, value in query.items() if value})


class EventsHandler(EventFilterHandler):
    async def get(self) -> None:
        filters = self.event_filter()
        bulk = filters.status in operator.GIVEN_UP_FROM
        try:
            page, awaiting = await self.ctx.db(lambda: (
                console.event_page(filters, self.text_argument("after") or None),
                console.awaiting_an_operator(filters) if bulk else None))
        except console.BadCursor:
            raise tornado.web.HTTPError(400) from None
        query = {name: self.get_argument(name, "") for name in EVENT_FILTERS}
        next_query = {**{k: v for k, v in query.items() if v}, "after": page.after}
        self.render_page("events", page=page, query=query, sources=sorted(self.ctx.plugins),
                         statuses=operator.EVENT_STATUSES, awaiting=awaiting,
                         meanings=operator.EVENT_STATUS_MEANINGS,
                         next_link="/console/events?" + tornado.httputil.urlencode(next_query)
                         if page.after else None)


class RetryEventsHandler(EventFilterHandler):
    """Every event the filter finds that awaits an operator, back in line."""

    async def post(self) -> None:
        filters = self.bulk_filter()
        waiting = filters.status == WAITING
        count = await self.ctx.db(functools.partial(
            operator.retry_events, self.ctx, filters.conditions(),
            (self.current_user, peer_address(self.request)), waiting=waiting))
        await self.record("retry events", self.events_page(), f"{count} back in line")
        tick = self.ctx.settings.scheduler_tick_seconds
        if waiting:
            if count:
                intake.run_waiting_calls(self.ctx)
            self.redirect_with(self.events_page(), (
                f"{count} waiting fact(s) looked for again, due now: the scheduler handles "
                f"them at its next runs (up to {CLAIM_BATCH} a run, every {tick} s); each "
                "whose order is found now is handled, the others wait again.") if count else (
                "No fact looked for again: none of those this filter finds waits for its "
                "order."), refused=not count)
            return
        self.redirect_with(self.events_page(), (
            f"{count} event(s) back in line, due now: the scheduler handles them at its "
            f"next runs, oldest first (up to {CLAIM_BATCH} a run, every {tick} s); each "
            "one's page shows how it went.") if count else (
            "No event retried: none of those this filter finds failed and awaits you (an "
            "event being handled right now is left as it is)."), refused=not count)


class GiveUpEventsHandler(EventFilterHandler):
    """Every event the filter finds that awaits an operator, given up with a reason."""

    async def post(self) -> None:
        filters = self.bulk_filter()
        reason = self.required_reason()
        waiting = filters.status == WAITING
        count = await self.ctx.db(functools.partial(
            operator.give_up_events, self.ctx, filters.conditions(), reason,
            (self.current_user, peer_address(self.request)), waiting=waiting))
        await self.record("give up events", self.events_page(), f"{count} given up: {reason}")
        if waiting:
            self.redirect_with(self.events_page(), (
                f"{count} waiting fact(s) given up, with your reason: they are dead and "
                "final, and their order's arrival no longer handles them (a forced replay "
                "of one would).") if count else (
                "No fact given up: none of those this filter finds waits for its order."),
                refused=not count)
            return
        if count:
            # The calls of their orders held behind them go now, each in its turn.
            intake.run_waiting_calls(self.ctx)
        self.redirect_with(self.events_page(), (
            f"{count} event(s) given up, with your reason: they are dead and final, and no "
            "retry takes them up again (a forced replay of one would); the calls of their "
            "orders that waited behind them are handled now.") if count else (
            "No event given up: none of those this filter finds failed and awaits you (an "
            "event being handled right now is left as it is)."), refused=not count)

    def required_reason(self) -> str:
        reason = self.text_argument("reason")
        if not reason:
            raise tornado.web.HTTPError(400)
        return reason


class EventHandler(ConsoleHandler):
    async def get(self, event_id: str) -> None:
        try:
            event, effects = await self.ctx.db(
                functools.partial(operator.event_with_effects, int(event_id)))
        except operator.NotFound:
            raise tornado.web.HTTPError(404) from None
        self.render_page("event", event=event, payload=console.shown_payload(event),
                         effects=effects, given_up_from=operator.GIVEN_UP_FROM,
                         needs_confirmation=event.given_up_at is not None or event.overtaken
                         or event.status not in (*operator.UNFINISHED,
                                                 *operator.GIVEN_UP_FROM))


class GiveUpEventHandler(GiveUpEventsHandler):
    # One event, by its path: its own arguments, as tornado gives every handler.
    async def post(self, digits: str) -> None:  # type: ignore[override]
        event_id = int(digits)
        page = f"/console/events/{event_id}"
        reason = self.required_reason()
        try:
            was = await self.ctx.db(functools.partial(operator.get_event, event_id))
            await self.ctx.db(functools.partial(
                operator.give_up_event, self.ctx, event_id, reason,
                (self.current_user, peer_address(self.request))))
        except operator.NotFound:
            raise tornado.web.HTTPError(404) from None
        except operator.Refused as refused:
            await self.record("give up event", event_id, f"refused: {refused}")
            self.redirect_with(page, f"Event #{event_id} not given up: {refused}.",
                               refused=True)
            return
        if was.status == WAITING:
            self.redirect_with(page, (
                f"Event #{event_id} given up, with your reason: it is dead and final, and "
                "its order's arrival no longer handles it (a forced replay would)."))
            return
        intake.run_waiting_calls(self.ctx)
        self.redirect_with(page, (
            f"Event #{event_id} given up, with your reason: it is dead and final; no retry "
            "takes it up again (a forced replay would). The calls of its order that waited "
            "behind it are handled now."))


class ReplayHandler(ConsoleHandler):
    async def post(self, digits: str) -> None:
        event_id = int(digits)
        page = f"/console/events/{event_id}"
        confirmed = self.get_body_argument("confirm", "") == "yes"
        try:
            outcome = await operator.replay(self.ctx, event_id, force=confirmed)
        except operator.NotFound:
            raise tornado.web.HTTPError(404) from None
        except operator.Refused:
            await self.record("replay event", event_id, "refused: not confirmed")
            event = await self.ctx.db(functools.partial(operator.get_event, event_id))
            why = (f"it was given up by {event.given_up_by} at "
                   f"{operator.format_time(event.given_up_at)} UTC: {event.given_up_reason}"
                   if event.given_up_at else
                   f"calls of order {event.order_number} that came after it have been "
                   "handled since, and it would go after them" if event.status == "dead"
                   else f"it was handled already ({event.status})")
            self.redirect_with(page, (
                f"Event #{event_id} not replayed: {why}. Tick the confirmation to handle "
                "it again (its database changes are made again; its effects are not sent "
                "twice)."), refused=True)
            return
        await self.record("replay event", event_id, outcome)
        self.redirect_with(page, f"Event #{event_id} replayed: it is now {outcome}. "
                                 f"{REPLAYED_NEXT.get(outcome, '')}".strip())


# What comes after a replay, by its outcome.
REPLAYED_NEXT = {
    "processed": "Its effects are listed below; each one's page shows how its send went.",
    "failed": "The scheduler handles it again at its next try (below), with a growing "
              "wait; give it up if it should not be.",
    "rejected": "It is final: the reason is its last error, below.",
    "ignored": "Nothing handles events of its type.",
    "held": "It waits behind an earlier call of its order that is not finished (below): "
            "it goes when that one is handled or given up.",
    WAITING: "Its order is still not known: it waits again for the ids below, and is "
             "handled as soon as one of them is linked to an order.",
}


class OrderSearchHandler(ConsoleHandler):
    def get(self) -> None:
        number = self.text_argument("number", 100)
        if not number:
            self.redirect("/console/")
            return
        self.redirect("/console/orders/" + path_part(number))


class OrderHandler(ConsoleHandler):
    async def get(self, order_number: str) -> None:
        order, moments = await self.ctx.db(
            functools.partial(console.timeline, self.ctx, order_number))
        self.render_page("order", 200 if order or moments else 404, order_number=order_number,
                         order=order, moments=moments,
                         amounts=console.order_amounts(order) if order else None)


class OutboxHandler(ConsoleHandler):
    async def get(self) -> None:
        status = self.text_argument("status") or "dead"
        destination = self.text_argument("destination")
        before = self.text_argument("before")
        if status not in operator.OUTBOX_STATUSES or (before and not before.isdigit()) \
                or (destination and destination not in operator.DESTINATIONS):
            raise tornado.web.HTTPError(400)
        page, counts, later = await self.ctx.db(lambda: (
            console.outbox_page(status, destination, int(before) if before else None),
            console.outbox_counts(), console.later_tries(self.ctx)))
        self.render_page("outbox", page=page, counts=counts, later=later,
                         destinations=[name for name in operator.DESTINATIONS
                                       if name in later
                                       or any(name == counted for counted, _ in counts)],
                         statuses=console.COUNTED_OUTBOX_STATUSES, status=status,
                         destination=destination, all_destinations=operator.DESTINATIONS,
                         all_statuses=operator.OUTBOX_STATUSES,
                         tick=self.ctx.settings.scheduler_tick_seconds)


class EffectHandler(ConsoleHandler):
    """One effect: what it is, the request as sent, every attempt, its cause, and the
    retry and give-up buttons."""

    async def get(self, row_id: str) -> None:
        try:
            page = await self.ctx.db(functools.partial(console.effect_page, self.ctx,
                                                       int(row_id)))
        except operator.NotFound:
            raise tornado.web.HTTPError(404) from None
        self.render_page("effect", effect=page, outcomes=console.ATTEMPT_OUTCOMES)


class RetryEffectHandler(ConsoleHandler):
    """Back to the page the button was on (the outbox, the event, the effect's own)."""

    async def post(self, digits: str) -> None:
        row_id = int(digits)
        asked_at = self.ctx.clock()
        try:
            row = await console.retry_now(self.ctx, row_id)
        except operator.NotFound:
            raise tornado.web.HTTPError(404) from None
        except operator.Refused as refused:
            await self.record("retry effect", row_id, f"refused: {refused}")
            self.redirect_with(f"/console/outbox/{row_id}",
                               f"Effect #{row_id} not retried: {refused}.", refused=True)
            return
        outcome = row.status if not row.last_error else f"{row.status}: {row.last_error}"
        await self.record("retry effect", row_id, outcome, at=asked_at)
        self.redirect_with(f"/console/outbox/{row_id}", await self.ctx.db(
            functools.partial(console.after_retry, self.ctx, row, asked_at)))


class GiveUpHandler(ConsoleHandler):
    async def post(self, digits: str) -> None:
        row_id = int(digits)
        reason = self.text_argument("reason")
        try:
            row = await self.ctx.db(functools.partial(console.give_up, self.ctx, row_id,
                                                      self.current_user, reason))
        except operator.NotFound:
            raise tornado.web.HTTPError(404) from None
        except operator.Refused as refused:
            await self.record("give up effect", row_id, f"refused: {refused}")
            self.redirect_with(f"/console/outbox/{row_id}",
                               f"Effect #{row_id} not given up: {refused}.", refused=True)
            return
        await self.record("give up effect", row_id, row.last_error or "")
        self.redirect_with(f"/console/outbox/{row_id}", (
            f"Effect #{row_id} given up: it is dead, and not sent unless someone retries "
            "it."))


class DestinationAction(ConsoleHandler):
    """An action on the effects of one destination (the outbox page's buttons)."""

    def destination(self) -> str:
        destination = self.get_body_argument("destination", "")
        if destination not in operator.DESTINATIONS:
            raise tornado.web.HTTPError(400)
        return destination

    def then(self, destination: str, count: int, done: str) -> None:
        """Back to the outbox, saying what was done to `count` effects and what comes
        next."""
        tick = self.ctx.settings.scheduler_tick_seconds
        next_step = (f"the scheduler sends them at its next run (within {tick} s); each "
                     "one's page shows how it went") if count else "nothing to send"
        self.redirect_with("/console/outbox",
                           f"{count} {destination} effect(s) {done}: {next_step}.")


class RetryDeadHandler(DestinationAction):
    async def post(self) -> None:
        destination = self.destination()
        count = await self.ctx.db(functools.partial(
            console.retry_dead, self.ctx, destination,
            (self.current_user, peer_address(self.request))))
        await self.record("retry dead effects", destination, f"{count} back in line")
        self.then(destination, count, "given up on are back in line, due now")


class DueNowHandler(DestinationAction):
    async def post(self) -> None:
        destination = self.destination()
        count = await self.ctx.db(functools.partial(console.make_due_now, self.ctx,
                                                    destination))
        await self.record("make effects due now", destination, f"{count} due now")
        self.then(destination, count, "that waited for a later try are due now")


class SettlementHandler(ConsoleHandler):
    async def get(self) -> None:
        queue, holdbacks = await self.ctx.db(lambda: (
            console.settlement_queue(self.ctx), list(console.holdback_orders())))
        self.render_page("settlement", queue=queue, holdbacks=holdbacks)


class LinksHandler(ConsoleHandler):
    FIELDS = ("kind", "order", "cycle")

    def get(self) -> None:
        self.render_page("links", kinds=links.KINDS, problem=None,
                         form=dict.fromkeys(self.FIELDS, ""))

    async def post(self) -> None:
        form = {name: self.get_body_argument(name, "").strip() for name in self.FIELDS}
        try:
            await self.ctx.db(functools.partial(filings.check_link, Transaction(self.ctx),
                                                self.ctx.settings,
                                                form["kind"], form["order"], form["cycle"]))
            link = links.signed_link(self.ctx.settings, form["kind"], form["order"],
                                     form["cycle"])
        except (links.InvalidLinkPart, filings.LinkRefused) as exc:
            self.render_page("links", 400, kinds=links.KINDS, problem=str(exc),
                             form=form)
            return
        await self.record("sign link", f"{form['kind']} {form['order']} {form['cycle']}", "ok")
        self.redirect_with("/console/links", (
            f"Link for {form['kind'].upper()} {form['order']} {form['cycle']} signed, "
            "below: send it to the customer."), code=link)


class ActionsHandler(ConsoleHandler):
    async def get(self) -> None:
        self.render_page("actions", actions=await self.ctx.db(
            functools.partial(console.recent_actions, 200)))


def console_routes(ctx: HandlerContext) -> list[tuple[str, type[ConsoleHandler], dict[str, Any]]]:
    shared = {"ctx": ctx, "state": ConsoleState()}
    return [(pattern, handler, shared) for pattern, handler in (
        (r"/console/?", OverviewHandler),
        (r"/console/console.css", StyleHandler),
        (r"/console/login", LoginHandler),
        (r"/console/logout", LogoutHandler),
        (r"/console/events", EventsHandler),
        (r"/console/events/(\d{1,18})", EventHandler),
        (r"/console/events/(\d{1,18})/replay", ReplayHandler),
        (r"/console/events/(\d{1,18})/give-up", GiveUpEventHandler),
        (r"/console/events/retry", RetryEventsHandler),
        (r"/console/events/give-up", GiveUpEventsHandler),
        (r"/console/orders", OrderSearchHandler),
        (r"/console/orders/([^/]{1,300})", OrderHandler),
        (r"/console/outbox", OutboxHandler),
        (r"/console/outbox/(\d{1,18})", EffectHandler),
        (r"/console/outbox/(\d{1,18})/retry", RetryEffectHandler),
        (r"/console/outbox/(\d{1,18})/give-up", GiveUpHandler),
        (r"/console/outbox/retry-dead", RetryDeadHandler),
        (r"/console/outbox/due-now", DueNowHandler),
        (r"/console/settlement", SettlementHandler),
        (r"/console/links", LinksHandler),
        (r"/console/actions", ActionsHandler),
        (r"/console/.*", NotFoundPage),
    )]


class NotFoundPage(ConsoleHandler):
    """For an operator only, as every page: a stranger is sent to the login page from an
    unknown path as from a known one, and learns nothing of which exist."""

    def get(self) -> None:
        raise tornado.web.HTTPError(404)
