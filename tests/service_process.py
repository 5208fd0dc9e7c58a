"""Real faults for the durability tests: the service as a subprocess (`receiver.py serve`,
under the suite's thread check: tests/checked_service.py) that can be killed with SIGKILL
and restarted, a TCP proxy in front of PostgreSQL that can be cut and restored, and a
loopback peer that can go off the network and come back.

Everything waits asynchronously, so the peers living on the test's IOLoop keep answering
the subprocess while the test waits for it."""
import asyncio
import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest
import tornado.netutil
import tornado.testing

from models import database, is_postgres
from engine.connection import ClassifiedSqliteDatabase, open_database
from tests.conftest import WEBHOOK_SECRET
from tests.checked_service import SERVE, refusals_to
from tests.peers import HttpPeer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT_SECONDS = 20
# The subprocesses' claim lease: short, so a test sees an orphaned row taken over soon.
LEASE_SECONDS = 3


def unused_port():
    sock, port = tornado.testing.bind_unused_port()
    sock.close()
    return port


class ServiceProcess:
    """`python receiver.py serve` with the given settings, under the thread check
    (tests/checked_service.py); its log goes to `log_path`, what the check refused to
    `log_path` + ".refused", which fails the test (conftest's statements_through_the_door)."""

    def __init__(self, log_path, nofile=None, **env):
        """`nofile`: the process's file descriptor limit (soft and hard), as `ulimit -n`."""
        self.port = unused_port()
        self.log_path = log_path
        self.nofile = nofile
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "RECEIVER_HOST": "127.0.0.1",
            "RECEIVER_PORT": str(self.port),
            "WEBHOOK_SECRET": WEBHOOK_SECRET,
            "SCHEDULER_TICK_SECONDS": "1",
            "CLAIM_LEASE_SECONDS": str(LEASE_SECONDS),
            "OUTBOUND_TIMEOUT_SECONDS": "2",
            # Above the service's 1 s: on this shared machine a statement now and then
            # takes a second, and a database taken for down sends calls through the spool
            # (correct, but later than some tests look). The outage tests set it back.
            "DATABASE_TIMEOUT_MS": "3000",
            **refusals_to(f"{log_path}.refused"),
            **{name: str(value) for name, value in env.items()},
        }
        self.process = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    async def start(self):
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            SERVE, cwd=ROOT, env=self.env,
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=self._limit_files)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"service did not start; log:\n{self.log()[-3000:]}")
            await asyncio.sleep(0.05)
        return self

    def _limit_files(self):
        if self.nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def _answers(self):
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    async def kill(self):
        """SIGKILL: no shutdown code runs, as in a crash or an OOM kill."""
        self.process.kill()
        return await self.wait()

    async def terminate(self):
        self.process.send_signal(signal.SIGTERM)
        return await self.wait()

    async def wait(self, timeout=30):
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("service did not exit")
            await asyncio.sleep(0.05)
        return self.process.returncode

    @staticmethod
    async def a_lease_later():
        """Wait out a lease, so whatever a crash left behind would have gone out by now."""
        await asyncio.sleep(LEASE_SECONDS + 0.5)  # the service's own clock: not ours to move

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as handle:
            return handle.read()

    def stop_now(self):
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target, in threads of its own. `cut()` drops every
    open connection and refuses new ones (what a stopped server looks like to its
    clients); `restore()` forwards again. `freeze()` keeps every connection open and
    accepts new ones, but drops every byte either way (a hung server, or a partition
    whose packets vanish): nothing is refused, nothing answers. `thaw()` closes the
    connections that lost bytes and forwards again. `slow(seconds)` holds every reply
    (each read from the server) that long before passing it on: a database that answers
    everything, late; `slow(0)` ends it."""

    def __init__(self, target_host, target_port):
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open_sockets = set()
        self.lock = threading.Lock()
        self.is_cut = False
        self.is_frozen = False
        self.frozen_sockets = set()
        self.reply_delay = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @classmethod
    def in_front_of(cls, database_url):
        parts = urllib.parse.urlsplit(database_url)
        proxy = cls(parts.hostname, parts.port or 5432)
        netloc = f"{parts.username}@127.0.0.1:{proxy.port}" if parts.username else \
            f"127.0.0.1:{proxy.port}"
        return proxy, urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    def cut(self):
        with self.lock:
            self.is_cut = True
            sockets, self.open_sockets = self.open_sockets, set()
        for sock in sockets:
            _close(sock)

    def restore(self):
        self.is_cut = False

    def freeze(self):
        with self.lock:
            self.is_frozen = True
            self.frozen_sockets |= self.open_sockets

    def thaw(self):
        with self.lock:
            self.is_frozen = False
            sockets, self.frozen_sockets = self.frozen_sockets, set()
            self.open_sockets -= sockets
        for sock in sockets:
            _close(sock)

    def slow(self, seconds):
        self.reply_delay = seconds

    def close(self):
        self.closed = True
        self.thaw()
        self.cut()
        _close(self.listener)

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.is_cut:
                _close(client)
                continue
            if self.is_frozen:
                with self.lock:
                    self.frozen_sockets.add(client)
                threading.Thread(target=self._pipe, args=(client, None), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=3)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self.lock:
                self.open_sockets.update((client, upstream))
            for source, sink, replies in ((client, upstream, False),
                                          (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(source, sink, replies),
                                 daemon=True).start()

    def _pipe(self, source, sink, replies=False):
        """Forward `source` to `sink` (None: nowhere); bytes read while frozen are dropped.
        `replies`: the server's side, held back by `slow`."""
        try:
            while data := source.recv(65536):
                if replies and self.reply_delay:
                    time.sleep(self.reply_delay)  # a database slow to answer, on purpose
                if sink is not None and not self.is_frozen:
                    sink.sendall(data)
        except OSError:
            pass  # the other direction or cut() closed it
        finally:
            _close(source)
            if sink is not None:
                _close(sink)


def _close(sock):
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (any more)
    sock.close()


class RestartablePeer(HttpPeer):
    """An HttpPeer that can go off the network (connections refused) and come back on
    the same port."""

    def down(self):
        self.stop()

    def up(self):
        self.listen(tornado.netutil.bind_sockets(self.port, "127.0.0.1"))


@contextlib.contextmanager
def database_down(db):
    """Bind the models to a database of the same kind that cannot be reached (nothing
    listens on the port; the file cannot be opened), then back to `db`."""
    if is_postgres(db):
        down = open_database(f"postgresql://postgres@127.0.0.1:{unused_port()}/gone")
    else:
        down = ClassifiedSqliteDatabase("/dev/null/receiver.sqlite3")
    database.initialize(down)
    try:
        yield
    finally:
        database.initialize(db)


# The same test as conftest's: TEST_DATABASE_URL chooses PostgreSQL for the whole run.
ON_POSTGRES = os.environ.get("TEST_DATABASE_URL", "").startswith("postgres")
postgres_only = pytest.mark.skipif(
    not ON_POSTGRES, reason="needs PostgreSQL (TEST_DATABASE_URL): several processes share "
    "one PostgreSQL, and SQLite assumes a single process")
