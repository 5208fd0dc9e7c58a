"""Real HTTP and SMTP servers on loopback standing in for the systems we talk to.

Each records what it receives and can be told to fail, to refuse, or to be slow."""
import asyncio
import dataclasses
import email
import email.policy
import json
import threading
import weakref

import tornado.httpserver
import tornado.testing
import tornado.web
from aiosmtpd.controller import Controller


@dataclasses.dataclass
class Received:
    method: str
    path: str
    headers: dict
    body: bytes
    client_port: int = 0  # the sender's end of the connection: one port, one connection

    @property
    def json(self):
        return json.loads(self.body)


class _Record(tornado.web.RequestHandler):
    def initialize(self, peer):
        self.peer = peer

    async def _respond(self):
        peer = self.peer
        peer.requests.append(Received(
            self.request.method, self.request.path, dict(self.request.headers),
            self.request.body, self.request.connection.stream.socket.getpeername()[1]))
        peer.in_flight += 1
        peer.most_in_flight = max(peer.most_in_flight, peer.in_flight)
        try:
            if peer.hold is not None:
                await peer.hold.wait()
            if peer.delay:
                await asyncio.sleep(peer.delay)  # a peer slow on purpose
        finally:
            peer.in_flight -= 1
        status, body = peer.responses.pop(0) if peer.responses else (peer.status, peer.body)
        self.set_status(status)
        if status == 204:
            self.clear_header("Content-Type")
            self.finish()
            return
        self.set_header("Content-Type", peer.content_type)
        self.finish(body if isinstance(body, (bytes, str)) else json.dumps(body))

    get = post = put = _respond


class _ClosableServer(tornado.httpserver.HTTPServer):
    def initialize(self, *args, **kwargs):
        super().initialize(*args, **kwargs)
        self.open_streams = weakref.WeakSet()

    def handle_stream(self, stream, address):
        self.open_streams.add(stream)
        super().handle_stream(stream, address)

    def close_open_streams(self):
        for stream in list(self.open_streams):
            stream.close()


class HttpPeer:
    """A recording HTTP server. `status`/`body` answer every request (`content_type`
    says what the body is); `responses` queues one-off answers; `delay` makes every
    answer slow; `hold` (an asyncio.Event) keeps every answer back until the test sets
    it; `most_in_flight` is the most requests it held at once; `stop()` takes it off the
    network."""

    def __init__(self, name, body=None):
        self.name = name
        self.requests = []
        self.responses = []
        self.status = 200
        self.body = {"ok": True} if body is None else body
        self.content_type = "application/json"
        self.delay = 0
        self.hold = None
        self.in_flight = self.most_in_flight = 0
        sock, self.port = tornado.testing.bind_unused_port()
        self.listen([sock])


    @property
    def posts(self):
        """The POSTs received: a workflow action or a job, not the service's checks of
        the peer (Frappe's start-up check of credentials and doctypes reads with GETs)."""
        return [request for request in self.requests if request.method == "POST"]
    def listen(self, sockets):
        self.server = _ClosableServer(
            tornado.web.Application([(r".*", _Record, {"peer": self})]))
        self.server.add_sockets(sockets)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        """Like a peer going down: nothing new connects, and the connections our clients
        keep alive are closed."""
        self.server.stop()
        self.server.close_open_streams()

    def fail_with(self, status, body=None):
        self.status, self.body = status, {"error": "peer told to fail"} if body is None else body


class _MailBox:
    def __init__(self):
        self.messages = []
        self.refuse_with = None
        self.lock = threading.Lock()

    async def handle_DATA(self, server, session, envelope):
        if self.refuse_with:
            return self.refuse_with
        message = email.message_from_bytes(envelope.content, policy=email.policy.default)
        with self.lock:
            self.messages.append((envelope.rcpt_tos, message))
        return "250 Message accepted for delivery"


class SmtpPeer:
    """A real SMTP server (aiosmtpd) in its own thread."""

    def __init__(self):
        self.box = _MailBox()
        sock, self.port = tornado.testing.bind_unused_port()
        sock.close()
        self.controller = Controller(self.box, hostname="127.0.0.1", port=self.port)
        self.controller.start()

    @property
    def url(self):
        return f"smtp://127.0.0.1:{self.port}"

    @property
    def messages(self):
        with self.box.lock:
            return list(self.box.messages)

    def clear(self):
        with self.box.lock:
            self.box.messages.clear()
        self.box.refuse_with = None

    def stop(self):
        self.controller.stop()
