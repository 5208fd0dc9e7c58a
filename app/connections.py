"""The HTTP server's connections: how many may be open at once, and what happens past
that or when the process runs out of file descriptors.

Each connection is a file descriptor. About 1,020 idle connections used up the 1,024 a
process gets by default; every accept then failed with EMFILE, and as the listening
socket stayed readable the loop retried at once, writing a traceback each time (99.6%
CPU, 87 MB of log in 23 s), while real webhooks could not get in.

So: connections are capped at MAX_CONNECTIONS, and below what the descriptor limit
leaves once the service's own files are counted (the database, up to 200 outbound
connections, the spool). At the cap, an idle connection (one with no request in
progress: a keep-alive, or a client that has sent nothing) is closed to make room, so
that an idle crowd cannot keep a sender out; with none idle, the oldest request still
waiting for a body that has not started (complete headers, then nothing: 1,000 of them
from one address kept every sender out) of the address with the most connections; with
none of those either, the new connection gets a canned 503 and is closed.

One address (an IPv6 one by its /64) may hold an ADDRESS_SHARE of the cap; past it, its
own idle connection or its oldest body-less request makes room, or its new connection
is refused. A trusted proxy (TRUSTED_PROXIES) speaks for many clients: it is not held
to the share.

A failed accept pauses accepting for a moment instead of retrying at once. Each
condition is logged once, then counted (lograte).
"""
import collections
import errno
import logging
import resource
import socket
import typing
import weakref

import tornado.httpserver
import tornado.iostream
import tornado.httputil
import tornado.ioloop

from engine import lograte
from handlers.addresses import client_key, is_trusted

log = logging.getLogger("receiver.connections")
REPEATS = lograte.Repeats(log)

# Descriptors kept for the service's own use: a quarter of the limit, at most 256.
MAX_RESERVE = 256
# How long accepting pauses after an accept failed for want of descriptors or memory.
ACCEPT_PAUSE_SECONDS = 0.5
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 5\r\nContent-Length: 0\r\n"
        b"Connection: close\r\n\r\n")
ACCEPTS_PER_TURN = 128
# The part of the connection cap one address may hold.
ADDRESS_SHARE = 0.25


def descriptor_limit() -> int:
    """The soft RLIMIT_NOFILE, raised to the hard limit first (systemd's LimitNOFILE=
    sets both; a shell's ulimit often leaves the soft one at 1,024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(wanted: int, limit: int) -> int:
    """MAX_CONNECTIONS, or less: what the descriptor limit leaves after the reserve."""
    if limit == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, limit - min(MAX_RESERVE, limit // 4)))


class CountingApplication(typing.Protocol):
    """What the server asks of its application (app.server.ReceiverApplication)."""
    requests: weakref.WeakSet
    waiting_for_body: weakref.WeakSet

    @property
    def trusted_proxies(self) -> tuple: ...


class ReceiverServer(tornado.httpserver.HTTPServer):
    """HTTPServer with the connection cap and the accept loop described above."""

    # Tornado passes the constructor's arguments on to `initialize`; this server needs
    # one more, and an application that counts its requests.
    def initialize(  # type: ignore[override]
            self, application: CountingApplication, *args: typing.Any,
            max_connections: int, **kwargs: typing.Any) -> None:
        super().initialize(typing.cast(tornado.httputil.HTTPServerConnectionDelegate,
                                       application), *args, **kwargs)
        self.application = application
        self.max_connections = max_connections

    def add_sockets(self, sockets: typing.Iterable[socket.socket]) -> None:
        for sock in sockets:
            self._sockets[sock.fileno()] = sock
            self._handlers[sock.fileno()] = Acceptor(self, sock).stop

    @property
    def per_address(self) -> int:
        return max(1, int(self.max_connections * ADDRESS_SHARE))

    def take(self, connection: socket.socket, address: typing.Any) -> None:
        """A connection accepted: handled, after making room if a cap is reached."""
        open_now = self.open_streams()
        peer = address[0] if isinstance(address, tuple) else ""
        key = client_key(peer)
        if not is_trusted(peer, self.application.trusted_proxies):
            own = [(stream, ip) for stream, ip in open_now if client_key(ip) == key]
            if len(own) >= self.per_address and not self.make_room(own, own=True):
                REPEATS.warning(("address full", key), "%d connections open from %s (its "
                                "share of MAX_CONNECTIONS): refusing new ones", len(own), key)
                refuse(connection)
                return
        if len(open_now) >= self.max_connections and not self.make_room(open_now):
            REPEATS.warning("full", "%d connections open (MAX_CONNECTIONS or the file "
                            "descriptor limit): refusing new ones", len(open_now))
            refuse(connection)
            return
        self._handle_connection(connection, address)

    def open_streams(self) -> list[tuple[tornado.iostream.IOStream, str]]:
        """(stream, peer address) of the connections still open (a closed one leaves the
        server's set a moment later)."""
        # Tornado types a connection's context as object; it is its request context.
        return [(conn.stream, getattr(conn.context, "remote_ip"))
                for conn in self._connections
                if conn.stream is not None and not conn.stream.closed()]

    def make_room(self, connections: list[tuple[tornado.iostream.IOStream, str]],
                  own: bool = False) -> bool:
        """Close an idle connection among `connections`, else the oldest request waiting
        for its body of the address holding the most of them; False if there is none."""
        app = self.application
        busy = {request.connection.stream for request in app.requests}
        for stream, _ in connections:
            if stream not in busy:
                REPEATS.warning("evict", "%d connections open%s: closing idle ones to let "
                                "new ones in", len(connections), " from one address" * own)
                stream.close()
                return True
        counts = collections.Counter(client_key(ip) for _, ip in connections)
        streams = {stream for stream, _ in connections}
        waiting = [delegate for delegate in app.waiting_for_body
                   if delegate.request.connection.stream in streams]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda delegate: (
            -counts[client_key(delegate.request.connection.context.remote_ip)],
            delegate.arrived))
        REPEATS.warning("evict waiting", "%d connections open%s: closing requests whose body "
                        "has not started to let new ones in", len(connections),
                        " from one address" * own)
        oldest.evict()
        return True


def refuse(connection: socket.socket) -> None:
    try:
        connection.setblocking(False)
        connection.send(BUSY)
    except OSError:
        pass
    connection.close()


class Acceptor:
    """Tornado's accept loop (netutil.add_accept_handler), but one that pauses on EMFILE
    and its kind instead of raising (and being called again at once, forever)."""

    def __init__(self, server: ReceiverServer, sock: socket.socket) -> None:
        self.server, self.sock = server, sock
        self.loop = tornado.ioloop.IOLoop.current()
        self.stopped = False
        self.loop.add_handler(sock, self.on_readable, tornado.ioloop.IOLoop.READ)

    def on_readable(self, fd: socket.socket, events: int) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            if self.stopped:
                return
            try:
                connection, address = self.sock.accept()
            except BlockingIOError:
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in OUT_OF_RESOURCES:
                    raise
                self.pause(exc)
                return
            self.server.take(connection, address)

    def pause(self, exc: OSError) -> None:
        REPEATS.error(("accept", exc.errno), "cannot accept connections: %s (%d open); "
                      "pausing %.1f s", exc.strerror, len(self.server._connections),
                      ACCEPT_PAUSE_SECONDS)
        self.loop.remove_handler(self.sock)
        self.loop.call_later(ACCEPT_PAUSE_SECONDS, self.resume)

    def resume(self) -> None:
        if not self.stopped:
            self.loop.add_handler(self.sock, self.on_readable, tornado.ioloop.IOLoop.READ)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            try:
                self.loop.remove_handler(self.sock)
            except (KeyError, ValueError):
                pass
