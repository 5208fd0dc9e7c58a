#!/usr/bin/env python3
"""The order-fulfilment webhook receiver: entry point, application factory and CLI.

    python receiver.py            # same as `serve`
    python receiver.py serve      # apply migrations, then listen on RECEIVER_HOST:RECEIVER_PORT
    python receiver.py migrate    # apply migrations and exit
    python receiver.py events list|show|replay, outbox list|retry, settle, backfill
                                  # the operator's commands (each has --help)

Settings come from the environment (see README.md). The operator's commands open the
database from DATABASE_URL and never start the HTTP server. Exit codes: 0 done, 1 not
done (not found, refused, failed, database unavailable), 2 bad usage or settings.
"""
import argparse
import asyncio
import datetime
import gc
import json
import logging
import os
import re
import signal
import sys
import time
import urllib.parse
import weakref

import stripe
import tornado.httpserver
import tornado.httputil
import tornado.ioloop
import tornado.web

import migrations
from handlers.base import NotFoundHandler, log_request
from handlers.routes import routes
from models import UTC, open_database
from plugins import registries
from scheduler import Scheduler
from services import backfill, operator, settlement, systemd
from services.context import Context
from services.db import UNAVAILABLE
from services.links import KINDS, print_signed_link
from settings import ConfigurationError, Settings

log = logging.getLogger("receiver")

# How long a shutdown waits for requests in flight; below systemd's TimeoutStopSec (30 s).
SHUTDOWN_GRACE_SECONDS = 20
# A client that has not sent its whole body this long after its headers is cut off.
BODY_TIMEOUT_SECONDS = 30


class ReceiverApplication(tornado.web.Application):
    """Counts the requests being handled, so that a shutdown can wait for them.

    A request counts from the moment a handler is chosen for it until the handler's
    access-log line (written once per request, also after an error or a lost client), or
    until its connection closes before the request was read in full: no handler runs to
    the log line then (a client that gave up mid-upload), and counting it would hold up
    every later shutdown for the whole grace."""

    body_timeout = BODY_TIMEOUT_SECONDS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A set, not a number, so that a request ended both ways is uncounted once.
        self.requests = weakref.WeakSet()

    @property
    def in_flight(self):
        return len(self.requests)

    def get_handler_delegate(self, request, target_class, target_kwargs=None,
                             path_args=None, path_kwargs=None):
        self.requests.add(request)
        return _CountedDelegate(self, request, super().get_handler_delegate(
            request, target_class, target_kwargs, path_args, path_kwargs))

    def log_request(self, handler):
        self.requests.discard(handler.request)
        super().log_request(handler)

    async def wait_idle(self, timeout):
        """Wait until no request is in flight or `timeout` passed; returns those left."""
        deadline = time.monotonic() + timeout
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight


class _CountedDelegate(tornado.httputil.HTTPMessageDelegate):
    """Tornado's delegate for one request, telling the application when the connection
    closed before the request was read in full (tornado calls on_connection_close then
    only), and closing a connection whose body has not come in full in time.

    The body's deadline is a timer of ours rather than HTTPServer's body_timeout, which
    wraps every body read in a task of its own: that cost 5-9% of the CPU of a webhook
    (docs/PERFORMANCE.md)."""

    cut_off = False

    def __init__(self, app, request, inner):
        self.app, self.request, self.inner = app, request, inner
        self.deadline = asyncio.get_running_loop().call_later(app.body_timeout,
                                                              self.body_too_slow)

    def headers_received(self, start_line, headers):
        return self.inner.headers_received(start_line, headers)

    def data_received(self, chunk):
        return self.inner.data_received(chunk)

    def finish(self):
        self.deadline.cancel()
        if self.cut_off:
            # The body's last bytes were read in the same turn of the loop as the deadline
            # ran out: the connection is closed, so nobody would get the answer.
            self.on_connection_close()
            return
        self.inner.finish()

    def on_connection_close(self):
        self.deadline.cancel()
        self.app.requests.discard(self.request)
        self.inner.on_connection_close()

    def body_too_slow(self):
        self.cut_off = True
        log.info("request body from %s not in after %s s; connection closed",
                 self.request.remote_ip, self.app.body_timeout)
        self.request.connection.close()


def make_app(ctx):
    registries()
    return ReceiverApplication(
        routes(ctx),
        default_handler_class=NotFoundHandler,
        default_handler_args={"ctx": ctx},
        log_function=log_request,
        compress_response=False,
    )


def make_server(app, settings):
    return tornado.httpserver.HTTPServer(
        app,
        xheaders=True,
        # The handlers refuse oversize bodies with 413 from their Content-Length; this
        # cuts off a chunked body that keeps going.
        max_body_size=settings.max_body_bytes,
        idle_connection_timeout=60,
    )


# Attributes every LogRecord has; anything else on a record was passed as `extra=`.
_STANDARD_RECORD_FIELDS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line; fields given as `extra=` (event_id, outcome, ms...) become
    keys of their own, so journald and log shippers can filter on them."""

    escapes_text = True

    def format(self, record):
        entry = {"time": datetime.datetime.fromtimestamp(record.created, UTC).isoformat(),
                 "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        entry.update({key: value for key, value in vars(record).items()
                      if key not in _STANDARD_RECORD_FIELDS})
        if record.exc_info or record.exc_text:
            # exc_text when set: RedactingFormatter has formatted and redacted it already.
            entry["exception"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class RedactingFormatter(logging.Formatter):
    """The last line of defence: whatever any library logs (an exception text, a URL), a
    configured secret or a credential in a query string comes out as [redacted]."""

    QUERY_CREDENTIAL = re.compile(
        r"([?&](?:token|key|api_key|secret|signature|sig)=)[^&\s\"'\\]+", re.IGNORECASE)
    # Shorter values would blank out ordinary words; real secrets are long.
    MIN_SECRET_LENGTH = 6

    def __init__(self, inner, secrets):
        super().__init__()
        self.inner = inner
        self.secrets = sorted({s for s in secrets if len(s) >= self.MIN_SECRET_LENGTH},
                              key=len, reverse=True)

    def format(self, record):
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

    def redact(self, text):
        for secret in self.secrets:
            text = text.replace(secret, "[redacted]")
        return self.QUERY_CREDENTIAL.sub(r"\1[redacted]", text)


def secrets_of(settings):
    """Every secret value the settings hold, as it may appear in text (raw and %-quoted)."""
    values = [settings.webhook_secret, settings.workflow_webhook_signing_secret,
              settings.stripe_secret_key, *settings.stripe_webhook_secrets,
              settings.crypto_processor_api_key, settings.workflow_api_key,
              settings.workflow_api_secret, settings.telegram_bot_token, settings.link_secret]
    for url in (settings.smtp_url, settings.database_url):
        password = urllib.parse.urlsplit(url).password
        if password:
            values += [password, urllib.parse.unquote(password)]
    return values


def configure_logging(settings):
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_format == "json":
        formatter = JsonLogFormatter()
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    handler.setFormatter(RedactingFormatter(formatter, secrets_of(settings)))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    # APScheduler says "Running job ..." at INFO on every tick of every job; our jobs log
    # what they did, and /metrics counts their runs.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)


async def serve(settings):
    db = open_database(settings.database_url)
    applied = migrations.migrate(db)
    if applied:
        log.info("migrations applied: %s", ", ".join(applied))
    settings.warn_about_placeholders()
    prepare_spool(settings.spool_dir)
    ctx = Context.create(settings)
    app = make_app(ctx)
    server = make_server(app, settings)
    server.listen(settings.port, settings.host)
    log.info("listening on http://%s:%d", settings.host, settings.port)
    ctx.scheduler = Scheduler(ctx)
    await ctx.scheduler.start()
    set_aside_from_the_collector()
    systemd.notify(f"READY=1\nSTATUS=listening on {settings.host}:{settings.port}")
    watchdog = start_watchdog()

    await stop_requested()
    systemd.notify("STOPPING=1")
    log.info("stopping: no new connections; finishing requests in flight")
    server.stop()
    left = await app.wait_idle(SHUTDOWN_GRACE_SECONDS)
    if left:
        log.warning("%d request(s) still running after %d s; cutting them off",
                    left, SHUTDOWN_GRACE_SECONDS)
    # What is left are idle keep-alive connections (or the requests given up on above).
    await server.close_all_connections()
    await ctx.scheduler.stop()
    await ctx.close()
    if watchdog:
        watchdog.stop()
    db.close()
    log.info("stopped")


def set_aside_from_the_collector():
    """What exists once the service is up (modules, classes, the application, the pools)
    lives as long as the process: the garbage collector need not look at it again. A full
    collection under load then took about 1 ms instead of 20 ms, every request in flight
    waiting (docs/PERFORMANCE.md)."""
    gc.collect()
    gc.freeze()


def prepare_spool(folder):
    """Create SPOOL_DIR now rather than when the database first fails, and make its entry
    durable, so that /readyz can tell a spool that could not take a call before one comes.
    A failure is logged, not fatal: the service works while the database does, and
    /readyz says what is wrong with the spool."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        parent = os.open(os.path.dirname(os.path.abspath(folder)), os.O_RDONLY)
        try:
            os.fsync(parent)
        finally:
            os.close(parent)
    except OSError as exc:
        log.error("spool directory %s cannot be prepared: %s", folder, exc)


async def stop_requested():
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()


def start_watchdog():
    """Ping systemd's watchdog (WatchdogSec=) while the event loop runs, so a hung loop
    gets the service restarted."""
    interval = systemd.watchdog_interval()
    if not interval:
        return None
    ping = tornado.ioloop.PeriodicCallback(
        lambda: systemd.notify("WATCHDOG=1"), interval * 1000)
    ping.start()
    return ping


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="receiver.py",
        description="Order-fulfilment webhook receiver. Settings come from the environment.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="apply migrations, then serve (the default)")
    commands.add_parser("migrate", help="apply pending database migrations and exit")
    link = commands.add_parser("link", help="print a signed 'I already filed' link")
    link.add_argument("kind", choices=KINDS)
    link.add_argument("order", help="order number (a compliance order)")
    link.add_argument("cycle", help="filing period, e.g. 2026-Q3 or 2027")
    add_operator_commands(commands)
    parser.set_defaults(run=None)
    args = parser.parse_args(argv)

    try:
        settings = Settings.from_env()
    except ConfigurationError as exc:
        print(f"receiver: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)

    if args.command == "link":
        return print_signed_link(settings, args.kind, args.order, args.cycle,
                                 sys.stdout, sys.stderr)
    if args.command == "migrate":
        try:
            applied = migrations.migrate(open_database(settings.database_url))
        except UNAVAILABLE as exc:
            return database_unavailable(exc)
        print("applied: " + ", ".join(applied) if applied else "schema is up to date")
        return 0
    if args.run:
        return run_operator_command(args.run, settings, args)
    asyncio.run(serve(settings))
    return 0


# --- The operator's commands: plain text on stdout, problems on stderr, an exit code. ---

def add_operator_commands(commands):
    events = commands.add_parser(
        "events", help="list, show and replay stored webhook events").add_subparsers(
            dest="action", metavar="ACTION", required=True)
    listing = events.add_parser("list", help="the newest events first, filtered")
    listing.add_argument("--source", help="workflow, card or crypto")
    listing.add_argument("--status", choices=operator.EVENT_STATUSES)
    listing.add_argument("--since", type=time_argument,
                         help="received at or after (ISO 8601; UTC when no offset)")
    listing.add_argument("--until", type=time_argument, help="received before (ISO 8601)")
    listing.add_argument("--limit", type=int, default=50, help="at most this many (50)")
    listing.set_defaults(run=events_list)
    show = events.add_parser("show", help="one event: its payload and its outbox rows")
    show.add_argument("id", type=int)
    show.set_defaults(run=events_show)
    replay = events.add_parser(
        "replay", help="handle an event again (see README: what replay can redo)")
    which = replay.add_mutually_exclusive_group(required=True)
    which.add_argument("id", type=int, nargs="?", help="the event's id")
    which.add_argument("--failed", action="store_true",
                       help="every failed event, and every dead one (given up on)")
    replay.add_argument("--force", action="store_true",
                        help="also an event already processed (its effects are not "
                             "sent twice)")
    replay.set_defaults(run=events_replay)

    outbox = commands.add_parser(
        "outbox", help="list effects on other systems; put dead ones back in line"
    ).add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = outbox.add_parser("list", help="the newest rows first")
    listing.add_argument("--status", choices=operator.OUTBOX_STATUSES)
    listing.add_argument("--limit", type=int, default=50, help="at most this many (50)")
    listing.set_defaults(run=outbox_list)
    retry = outbox.add_parser(
        "retry", help="back to pending, due now, attempts reset; the scheduler sends it")
    which = retry.add_mutually_exclusive_group(required=True)
    which.add_argument("id", type=int, nargs="?", help="the outbox row's id")
    which.add_argument("--dead", action="store_true", help="every dead row")
    retry.set_defaults(run=outbox_retry)

    commands.add_parser(
        "settle", help="run the CRTC settlement (balance.available routine) once now"
    ).set_defaults(run=settle)
    fill = commands.add_parser(
        "backfill", help="fetch card events whose webhook delivery failed from Stripe's "
                         "Events API and handle them (idempotent)")
    fill.add_argument("--since", type=time_argument, required=True,
                      help="events created at or after (ISO 8601; Stripe keeps 30 days)")
    fill.set_defaults(run=backfill_events)


def time_argument(text):
    try:
        return operator.parse_time(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time: {text!r} (e.g. 2026-11-20T08:00Z)") from None


def run_operator_command(command, settings, args):
    db = open_database(settings.database_url)
    try:
        return asyncio.run(_with_context(command, settings, args))
    except (operator.NotFound, operator.Refused, backfill.NotConfigured) as exc:
        print(f"receiver: {exc}", file=sys.stderr)
        return 1
    except UNAVAILABLE as exc:
        return database_unavailable(exc)
    finally:
        db.close()


def database_unavailable(exc):
    """One line an operator can act on, not a traceback; exit 1 (not done)."""
    print(f"receiver: database unavailable: {str(exc).strip().splitlines()[0]}",
          file=sys.stderr)
    return 1


async def _with_context(command, settings, args):
    ctx = Context.create(settings)
    try:
        return await command(ctx, args)
    finally:
        await ctx.close()


EVENT_COLUMNS = ("ID", "RECEIVED (UTC)", "SOURCE", "TYPE", "STATUS", "TRIES", "ORDER",
                 "EXTERNAL ID", "LAST ERROR")
OUTBOX_COLUMNS = ("ID", "EVENT", "KIND", "ORDER", "STATUS", "TRIES", "NEXT TRY (UTC)",
                  "LAST ERROR")


def event_row(event):
    return (event.id, operator.format_time(event.received_at), event.source,
            event.event_type, event.status, event.attempts, event.order_number,
            event.external_id, operator.clip(event.last_error))


def outbox_row(row):
    next_try = operator.format_time(row.next_attempt_at) if row.status == "pending" else ""
    return (row.id, row.event_id, row.kind, row.order_number, row.status, row.attempts,
            next_try, operator.clip(row.last_error))


async def events_list(ctx, args):
    events = operator.list_events(args.source, args.status, args.since, args.until,
                                  args.limit)
    print(operator.table(EVENT_COLUMNS, [event_row(event) for event in events]))
    return 0


async def events_show(ctx, args):
    event = operator.get_event(args.id)
    for label, value in (
            ("event", f"#{event.id}"), ("source", event.source), ("type", event.event_type),
            ("status", event.status), ("order", event.order_number or "-"),
            ("external id", event.external_id or "-"), ("attempts", event.attempts),
            ("received", operator.format_time(event.received_at)),
            ("processed", operator.format_time(event.processed_at)),
            ("next attempt", operator.format_time(event.next_attempt_at)),
            ("last error", event.last_error or "-")):
        print(f"{label + ':':<14}{value}")
    print("payload:")
    try:
        print(json.dumps(json.loads(event.payload), indent=2, sort_keys=True))
    except ValueError:
        print(event.payload)
    print("outbox:")
    print(operator.table(OUTBOX_COLUMNS, [outbox_row(row) for row in operator.effects_of(event)]))
    return 0


async def events_replay(ctx, args):
    if args.failed:
        replayed = await operator.replay_failed(ctx)
        for item in replayed:
            print(f"event #{item.event.id} {item.event.source} {item.event.event_type}: "
                  f"{item.outcome}")
        still_failing = sum(item.outcome == "failed" for item in replayed)
        print(f"replayed {len(replayed)} failed event(s); {still_failing} still failing")
        return 1 if still_failing else 0
    outcome = await operator.replay(ctx, args.id, force=args.force)
    print(f"event #{args.id}: {outcome}")
    return 1 if outcome == "failed" else 0


async def outbox_list(ctx, args):
    rows = operator.list_outbox(args.status, args.limit)
    print(operator.table(OUTBOX_COLUMNS, [outbox_row(row) for row in rows]))
    return 0


async def outbox_retry(ctx, args):
    if args.dead:
        print(f"{operator.retry_dead(ctx)} dead row(s) back to pending, due now")
        return 0
    row = operator.retry_outbox(ctx, args.id)
    print(f"outbox row #{row.id} ({row.kind}) back to pending, due now")
    return 0


async def settle(ctx, args):
    counts = await settlement.settle_crtc_orders(ctx)
    print(", ".join(f"{name.replace('_', ' ')}: {count}" for name, count in counts.items()))
    return 1 if counts["failed"] else 0


async def backfill_events(ctx, args):
    try:
        counts = await backfill.backfill(ctx, args.since)
    except stripe.StripeError as exc:
        reason = exc.user_message or type(exc).__name__
        print(f"receiver: Stripe refused or could not be reached: {reason}", file=sys.stderr)
        return 1
    print(f"listed {counts.listed} undelivered event(s) since "
          f"{operator.format_time(args.since)} UTC: {counts.stored} stored and handled, "
          f"{counts.already} already in the inbox, {counts.unreadable} unreadable")
    return 1 if counts.unreadable else 0


if __name__ == "__main__":
    sys.exit(main())
