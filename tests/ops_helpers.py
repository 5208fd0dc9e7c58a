"""The real service in a subprocess, and the systemd notify socket it talks to."""
import asyncio
import os
import socket
import sys
import time

import tornado.testing

from tests.checked_service import SERVE, refusals_to

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NotifySocket:
    """A unix datagram socket standing in for systemd's $NOTIFY_SOCKET."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)

    async def receive(self, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.sock.recv(4096).decode()
            except BlockingIOError:
                await asyncio.sleep(0.02)
        raise TimeoutError("no notification within %s s" % timeout)

    async def wait_for(self, line, timeout=30):
        """Messages up to and including the first that carries `line`."""
        seen = []
        while True:
            seen.append(await self.receive(timeout))
            if line in seen[-1].split("\n"):
                return seen

    def close(self):
        self.sock.close()


class Service:
    """`receiver.py serve` on a port of its own, under the thread check
    (tests/checked_service.py); its log goes to a file we can read."""

    def __init__(self, log_path, env):
        sock, self.port = tornado.testing.bind_unused_port()
        sock.close()
        self.log_path = log_path
        self.env = {**os.environ, "RECEIVER_HOST": "127.0.0.1",
                    "RECEIVER_PORT": str(self.port), **refusals_to(f"{log_path}.refused"),
                    **env}
        self.process = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    async def start(self):
        with open(self.log_path, "ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                *SERVE, cwd=ROOT, env=self.env,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)

    async def wait_ready(self, client, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.returncode is not None:
                raise AssertionError(f"service exited early:\n{self.log()}")
            try:
                response = await client.fetch(self.url + "/healthz", request_timeout=2)
                if response.code == 200:
                    return
            except ConnectionRefusedError:
                pass  # not listening yet
            await asyncio.sleep(0.1)
        raise TimeoutError(f"service not up within {timeout} s:\n{self.log()}")

    async def wait_exit(self, timeout=30):
        return await asyncio.wait_for(self.process.wait(), timeout)

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as log:
            return log.read()

    def kill(self):
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
