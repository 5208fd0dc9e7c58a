"""The application and its HTTP server, and the serve lifecycle: migrate, drain the spool,
listen, start the scheduler, tell systemd, and on SIGTERM finish the requests in flight
before stopping. A database down at start (unreachable, or not answering) does not stop
it: it listens, calls go to the spool, and the migrations run, then the spool is drained,
when the database answers. A database that does not exist, or refuses our credentials,
is a setting to fix: it stops (CannotStart, exit 1) with the server's reason."""
import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import sys
import time
import weakref
from typing import Any, Awaitable, Callable, cast

import tornado.http1connection
import tornado.httputil
import tornado.ioloop
import tornado.netutil
import tornado.web

from engine import lograte
import migrations
from app.connections import ReceiverServer, connection_cap, descriptor_limit
from app.context import Context
from handlers.addresses import client_key, forwarded_for, forwarded_protocol
from handlers.base import ApiHandler, NotFoundHandler, log_request, takes_body
from handlers.console import cookie_secret
from handlers.routes import routes
from engine.db import UNAVAILABLE, Circuit, refused_settings, why_unavailable
from engine.connection import (ClassifiedSqliteDatabase, ReconnectingPostgresqlDatabase,
                               open_database)
from ops import systemd
from scheduler import STOP_GRACE_SECONDS, Scheduler
from settings import Settings

log = logging.getLogger("receiver")
REPEATS = lograte.Repeats(log)

# How long a shutdown waits for requests in flight, at most; all of the stop keeps within
# STOP_TIMEOUT_SECONDS (systemd's TimeoutStopSec) less STOP_MARGIN_SECONDS, left for
# closing the connections and the database and exiting.
SHUTDOWN_GRACE_SECONDS = 20
STOP_MARGIN_SECONDS = 2
# A client that has not sent its whole body this long after its headers is cut off.
BODY_TIMEOUT_SECONDS = 30
# ... and one that has not started it this long after its headers: a sender's body comes
# with its headers; a connection that holds its place without one is keeping others out.
BODY_START_TIMEOUT_SECONDS = 5
# What the server's own body limit becomes for a handler that keeps to a limit of its own.
UNLIMITED = 2 ** 62
# The body a form of the console may carry (a name, a password, a token, a few fields).
FORM_BODY_BYTES = 4096
REFUSALS = {413: ("Payload Too Large", b"request body too large\n"),
            429: ("Too Many Requests", b"too many requests\n"),
            503: ("Service Unavailable", b"temporarily unavailable\n")}


def body_limit(handler_class: type[tornado.web.RequestHandler]) -> int | None:
    """The body a route's handler may be sent: its own `body_limit` (a handler that reads
    its body itself: None), else 0 for a route without POST, else a form's."""
    if issubclass(handler_class, ApiHandler):
        return None
    if not takes_body(handler_class):
        return 0
    return getattr(handler_class, "body_limit", FORM_BODY_BYTES)


class ReceiverApplication(tornado.web.Application):
    """Counts the requests being handled, so that a shutdown can wait for them; sets who
    each comes from (TRUSTED_PROXIES); and keeps every route's body to its limit.

    A request counts from the moment a handler is chosen for it until the handler's
    access-log line (written once per request, also after an error or a lost client), or
    until its connection closes before the request was read in full: no handler runs to
    the log line then (a client that gave up mid-upload), and counting it would hold up
    every later shutdown for the whole grace."""

    body_timeout = BODY_TIMEOUT_SECONDS
    body_start_timeout = BODY_START_TIMEOUT_SECONDS

    def __init__(self, *args: Any, ctx: Context, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ctx = ctx
        # A set, not a number, so that a request ended both ways is uncounted once.
        self.requests: weakref.WeakSet[tornado.httputil.HTTPServerRequest] = weakref.WeakSet()
        # The requests whose body is awaited and has not started (app.connections).
        self.waiting_for_body: weakref.WeakSet[_CountedDelegate] = weakref.WeakSet()

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    @property
    def trusted_proxies(self) -> tuple:
        return self.ctx.settings.trusted_proxies

    # Tornado types the return as its own delegate; what serves a request is any
    # HTTPMessageDelegate, as ours around it is.
    def get_handler_delegate(  # type: ignore[override]
            self, request: tornado.httputil.HTTPServerRequest,
            target_class: type[tornado.web.RequestHandler],
            target_kwargs: dict[str, Any] | None = None, path_args: list[bytes] | None = None,
            path_kwargs: dict[str, bytes] | None = None) -> tornado.httputil.HTTPMessageDelegate:
        self.requests.add(request)
        peer, proxies = request.remote_ip or "", self.trusted_proxies
        request.remote_ip = forwarded_for(peer, request.headers, proxies)
        request.protocol = forwarded_protocol(peer, request.headers, proxies, request.protocol)
        limit = body_limit(target_class)
        # A handler that reads its body itself refuses an oversize one with 413 and its
        # JSON error; the server's own limit would cut in first with a bare 400.
        _connection(request).set_max_body_size(UNLIMITED if limit is None else limit)
        return _CountedDelegate(self, request, super().get_handler_delegate(
            request, target_class, target_kwargs, path_args, path_kwargs), limit)

    def log_request(self, handler: tornado.web.RequestHandler) -> None:
        self.requests.discard(handler.request)
        super().log_request(handler)

    async def wait_idle(self, timeout: float) -> int:
        """Wait until no request is in flight or `timeout` passed; returns those left."""
        deadline = time.monotonic() + timeout
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight


def expects_body(headers: tornado.httputil.HTTPHeaders) -> bool:
    return (headers.get("Content-Length", "0").strip() not in ("", "0")
            or "chunked" in headers.get("Transfer-Encoding", "").lower())


class _CountedDelegate(tornado.httputil.HTTPMessageDelegate):
    """Tornado's delegate for one request, telling the application when the connection
    closed before the request was read in full (tornado calls on_connection_close then
    only), closing a connection whose body has not come in time, and, for a handler that
    lets the server read its body (`limit` not None), refusing a body over the route's
    limit or over its address's or the process's cap (handlers.budget) before reading it.

    The body's deadlines are a timer of ours rather than HTTPServer's body_timeout, which
    wraps every body read in a task of its own: that cost 5-9% of the CPU of a webhook
    (docs/PERFORMANCE.md)."""

    cut_off = False
    refused = False
    held = 0

    def __init__(self, app: ReceiverApplication, request: tornado.httputil.HTTPServerRequest,
                 inner: tornado.httputil.HTTPMessageDelegate, limit: int | None) -> None:
        self.app, self.request, self.inner, self.limit = app, request, inner, limit
        self.client = client_key(request.remote_ip or "")
        self.arrived = time.monotonic()
        self.body_started = not expects_body(request.headers)
        if not self.body_started:
            app.waiting_for_body.add(self)
        self.deadline = asyncio.get_running_loop().call_later(
            min(app.body_start_timeout, app.body_timeout), self.body_too_slow)

    def headers_received(self, start_line: tornado.httputil.RequestStartLine
                         | tornado.httputil.ResponseStartLine,
                         headers: tornado.httputil.HTTPHeaders) -> Awaitable[None] | None:
        if self.limit is not None:
            declared = headers.get("Content-Length", "").strip()
            size = int(declared) if declared.isdigit() else 0
            if size > self.limit:
                self.refuse(413)
                return None
            if size and not self.hold(size):
                return None
        return self.inner.headers_received(start_line, headers)

    def data_received(self, chunk: bytes) -> Awaitable[None] | None:
        if not self.body_started:
            self.body_started = True
            self.app.waiting_for_body.discard(self)
        if self.refused:
            return None
        if (self.limit is not None and "Content-Length" not in self.request.headers
                and not self.hold(len(chunk))):
            return None  # a chunked body, counted as it comes
        return self.inner.data_received(chunk)

    def hold(self, size: int) -> bool:
        """Count `size` more bytes of body against the caps; False (and refused) if over."""
        short = self.app.ctx.bodies.take(self.client, size)
        if short:
            REPEATS.warning(("bodies", short), "request bodies in memory at the %s cap "
                            "(%s): refusing more", short, self.client)
            self.refuse(429 if short == "client" else 503)
            return False
        self.held += size
        return True

    def release(self) -> None:
        self.app.ctx.bodies.give_back(self.client, self.held)
        self.held = 0

    def refuse(self, status: int) -> None:
        """Answer now, before the body is read; the connection is closed once the answer is
        out, so the rest of the body is never read, nor a handler run."""
        self.refused = True
        self.release()
        self.app.requests.discard(self.request)
        if status == 413:
            REPEATS.warning(("too large", self.request.path), "%s %s from %s: body over the "
                            "route's limit of %d bytes; refused", self.request.method,
                            self.request.path, self.client, self.limit)
        reason, body = REFUSALS[status]
        headers = tornado.httputil.HTTPHeaders({
            "Content-Type": "text/plain; charset=utf-8", "Content-Length": str(len(body)),
            "Connection": "close", "Cache-Control": "no-store"})
        if status != 413:
            headers["Retry-After"] = "5"
        connection = _connection(self.request)
        # Nothing of the body is to be kept: what is read before the close is dropped.
        connection.set_max_body_size(UNLIMITED)
        connection.write_headers(
            tornado.httputil.ResponseStartLine("HTTP/1.1", status, reason), headers, body)
        connection.finish()

    def finish(self) -> None:
        self.deadline.cancel()
        self.app.waiting_for_body.discard(self)
        self.release()
        if self.cut_off:
            # The body's last bytes were read in the same turn of the loop as the deadline
            # ran out: the connection is closed, so nobody would get the answer.
            self.on_connection_close()
            return
        if not self.refused:
            self.inner.finish()

    def on_connection_close(self) -> None:
        self.deadline.cancel()
        self.app.waiting_for_body.discard(self)
        self.release()
        self.app.requests.discard(self.request)
        if not self.refused:
            self.inner.on_connection_close()

    def body_too_slow(self) -> None:
        waited = time.monotonic() - self.arrived
        if self.body_started and waited < self.app.body_timeout:
            # Started in time: the whole body has until the full deadline.
            self.deadline = asyncio.get_running_loop().call_later(
                self.app.body_timeout - waited, self.body_too_slow)
            return
        self.cut_off = True
        if self.body_started:
            log.info("request body from %s not in after %s s; connection closed",
                     self.client, self.app.body_timeout)
        else:
            log.info("request body from %s not started after %s s; connection closed",
                     self.client, min(self.app.body_start_timeout, self.app.body_timeout))
        _connection(self.request).close()

    def evict(self) -> None:
        """Closed to make room for another connection (app.connections)."""
        self.cut_off = True
        _connection(self.request).close()


def _connection(request: tornado.httputil.HTTPServerRequest
                ) -> tornado.http1connection.HTTP1Connection:
    """The request's connection: this server's are HTTP/1.1 ones, which tornado's types
    name by the interface (without a body limit or a close)."""
    return cast(tornado.http1connection.HTTP1Connection, request.connection)


def make_app(ctx: Context) -> ReceiverApplication:
    # Only the console signs cookies and checks xsrf tokens (its handlers do it
    # themselves): Tornado's xsrf_cookies setting would refuse every webhook POST.
    console = ({"cookie_secret": cookie_secret(ctx.settings)}
               if ctx.settings.console_enabled else {})
    return ReceiverApplication(
        routes(ctx),
        ctx=ctx,
        default_handler_class=NotFoundHandler,
        default_handler_args={"ctx": ctx},
        log_function=log_request,
        compress_response=False,
        **console,
    )


def make_server(app: ReceiverApplication, settings: Settings) -> ReceiverServer:
    cap = connection_cap(settings.max_connections, descriptor_limit())
    if cap < settings.max_connections:
        log.warning("at most %d connections at once: the file descriptor limit leaves no "
                    "more (MAX_CONNECTIONS=%d; raise LimitNOFILE)", cap,
                    settings.max_connections)
    return ReceiverServer(
        app,
        max_connections=cap,
        # X-Real-IP / X-Forwarded-For are read by the application, from TRUSTED_PROXIES
        # only (handlers.addresses).
        xheaders=False,
        # Each route sets its own before its body is read (ReceiverApplication).
        max_body_size=settings.max_body_bytes,
        idle_connection_timeout=60,
    )


# The database thread (engine.commits) waits on a socket for every statement and then
# needs the GIL back from the loop; Python's default switch interval (5 ms) would be
# each statement's worst wait for it.
GIL_SWITCH_SECONDS = 0.0005


async def serve(settings: Settings, ready: Callable[[], object] | None = None) -> None:
    """Serve until SIGTERM or SIGINT; `ready()`, when given, is called once it listens."""
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    db, circuit = _open_database(settings)
    settings.warn_about_placeholders()
    prepare_spool(settings.spool_dir)
    sockets = bind(settings)
    ctx, app, server = await _start(settings, circuit, sockets)
    watchdog = start_watchdog()
    if ready:
        ready()

    await stop_requested()
    await _stop(settings, ctx, app, server)
    if watchdog:
        watchdog.stop()
    await circuit.detach()
    db.close()
    log.info("stopped")


Database = ClassifiedSqliteDatabase | ReconnectingPostgresqlDatabase


def _open_database(settings: Settings) -> tuple[Database, Circuit]:
    """The database, migrated; or, down at start, with its circuit holding the migrations
    until it answers. CannotStart when it refuses our settings."""
    db = open_database(settings.database_url, timeout_ms=settings.database_timeout_ms)
    circuit = Circuit(db)
    down = None
    try:
        run_migrations(db)
    except UNAVAILABLE as failure:
        refused = refused_settings(failure)
        if refused is not None:
            db.close()
            raise CannotStart(refused_database_settings(refused), 1) from None
        down = failure
    # Attached once the first try is over: a refusal of our settings opens no circuit (it
    # would log an outage, probed every second, of a service that is not going to run).
    circuit.attach()
    if down is not None:
        log.warning("database unavailable at start (%s): serving all the same, calls go to "
                    "the spool; the migrations wait for the database", why_unavailable(down))
        circuit.hold_until(lambda: run_migrations(db), "migrations wait for it", down)
    return db, circuit


async def _start(settings: Settings, circuit: Circuit, sockets: list[socket.socket]
                 ) -> tuple[Context, ReceiverApplication, ReceiverServer]:
    """The context, the application and its server, listening on `sockets` once the
    scheduler has started (and drained the spool); systemd told it is ready."""
    ctx = Context.create(settings)
    app = make_app(ctx)
    server = make_server(app, settings)
    ctx.scheduler = Scheduler(ctx)
    # Drains the spool first: calls left there by an earlier run are handled before any
    # new one (the connections that come meanwhile wait in the socket's backlog).
    await ctx.scheduler.start()
    circuit.when_back(lambda: ctx.scheduler.run_soon("spool"))
    server.add_sockets(sockets)
    log.info("listening on http://%s:%d", settings.host, settings.port)
    # Frappe's credentials and doctypes, checked now rather than by the first webhook.
    ctx.background(ctx.destinations.check())
    freeze_startup_objects()
    systemd.notify(f"READY=1\nSTATUS=listening on {settings.host}:{settings.port}")
    return ctx, app, server


async def _stop(settings: Settings, ctx: Context, app: ReceiverApplication,
                server: ReceiverServer) -> None:
    """Stop serving: the requests in flight finished (or cut off after the grace), the
    connections closed, the scheduler and the background work stopped."""
    # Everything below ends within the stop budget (systemd's TimeoutStopSec), so the
    # process exits by itself rather than by SIGKILL.
    deadline = time.monotonic() + settings.stop_timeout_seconds - STOP_MARGIN_SECONDS

    def remaining(at_most: float) -> float:
        return max(0.0, min(at_most, deadline - time.monotonic()))
    systemd.notify("STOPPING=1")
    log.info("stopping: no new connections; finishing requests in flight")
    server.stop()
    grace = remaining(SHUTDOWN_GRACE_SECONDS)
    left = await app.wait_idle(grace)
    if left:
        log.warning("%d request(s) still running after %.0f s; cutting them off",
                    left, grace)
    # What is left are idle keep-alive connections (or the requests given up on above).
    await server.close_all_connections()
    await ctx.scheduler.stop(grace=remaining(STOP_GRACE_SECONDS))
    await ctx.close(within=remaining(settings.stop_timeout_seconds))
    lograte.flush_all()


def run_migrations(db: ClassifiedSqliteDatabase | ReconnectingPostgresqlDatabase) -> None:
    with db.unbounded():
        applied = migrations.migrate(db)
    if applied:
        log.info("migrations applied: %s", ", ".join(applied))


def refused_database_settings(reason: str) -> str:
    """What to tell an operator whose database refuses our settings (`refused_settings`)."""
    return (f"the database refuses our settings: {reason}; check DATABASE_URL (the "
            "database's name, the user and its password)")


class CannotStart(Exception):
    """The service cannot start; the message says what and what to do, `status` is the
    exit status (1: not done, try again once the cause is gone; 2: the settings)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def bind(settings: Settings) -> list[socket.socket]:
    """The listening sockets, bound before anything is started that would need stopping."""
    address = f"{settings.host}:{settings.port}"
    try:
        return tornado.netutil.bind_sockets(settings.port, settings.host)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise CannotStart(
                f"cannot listen on {address}: the port is in use (is the service already "
                "running?); stop that process or set RECEIVER_PORT to a free port", 1
            ) from None
        raise CannotStart(f"cannot listen on {address}: {exc.strerror or exc}; check "
                          "RECEIVER_HOST and RECEIVER_PORT", 2) from None


def freeze_startup_objects() -> None:
    """What exists once the service is up (modules, classes, the application, the pools)
    lives as long as the process: the garbage collector need not look at it again. A full
    collection under load then took about 1 ms instead of 20 ms, every request in flight
    waiting (docs/PERFORMANCE.md)."""
    gc.collect()
    gc.freeze()


def prepare_spool(folder: str) -> None:
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


async def stop_requested() -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()


def start_watchdog() -> tornado.ioloop.PeriodicCallback | None:
    """Ping systemd's watchdog (WatchdogSec=) while the event loop runs, so a hung loop
    gets the service restarted."""
    interval = systemd.watchdog_interval()
    if not interval:
        return None
    ping = tornado.ioloop.PeriodicCallback(_ping_watchdog, interval * 1000)
    ping.start()
    return ping


def _ping_watchdog() -> None:
    systemd.notify("WATCHDOG=1")
