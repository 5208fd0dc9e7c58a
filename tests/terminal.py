"""A command run with a terminal, as an operator runs it from a shell: stdin and stderr
on a pseudo-terminal (what getpass and a progress bar look for), stdout a pipe."""
import asyncio
import fcntl
import os
import pty
import signal
import struct
import termios
import threading

from tests.checked_service import CHECKED, refusals_file, refusals_to
from tests.ops_helpers import ROOT


class OnATerminal:
    """`receiver.py ARGS` started with its stdin and stderr on a pseudo-terminal; what
    it wrote there is `shown`, its stdout `stdout`."""

    def __init__(self, *args, env=None):
        # Every step drawn (tqdm reads TQDM_* defaults from the environment), not only
        # those 0.1 s apart: the test sees the last count, however fast the run.
        self.args, self.env = args, env and {**env, "TQDM_MININTERVAL": "0"}
        self.shown_bytes = bytearray()

    async def __aenter__(self):
        self.master, slave = pty.openpty()
        # A new pseudo-terminal is 0 columns wide; a terminal window is not.
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        env = {**(os.environ if self.env is None else self.env),
               **refusals_to(refusals_file())}
        self.process = await asyncio.create_subprocess_exec(
            *CHECKED, *self.args, cwd=ROOT, env=env,
            stdin=slave, stdout=asyncio.subprocess.PIPE, stderr=slave,
            start_new_session=True, preexec_fn=_take_the_terminal)
        os.close(slave)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self):
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # the child closed its end
                return
            if not chunk:
                return
            self.shown_bytes += chunk

    @property
    def shown(self):
        return self.shown_bytes.decode(errors="replace")

    async def wait_for(self, text, timeout=30):
        deadline = asyncio.get_running_loop().time() + timeout
        while text not in self.shown:
            assert asyncio.get_running_loop().time() < deadline, self.shown
            await asyncio.sleep(0.05)

    def type(self, keys):
        os.write(self.master, keys)

    async def finish(self, timeout=60):
        self.stdout = (await asyncio.wait_for(self.process.stdout.read(), timeout)).decode()
        self.returncode = await asyncio.wait_for(self.process.wait(), timeout)
        await asyncio.to_thread(self.reader.join, timeout)
        return self

    async def __aexit__(self, *exc_info):
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        os.close(self.master)


def _take_the_terminal():
    """In the child, a session leader: stdin's terminal becomes its controlling one, so
    Ctrl-C typed there is SIGINT to it, as in a shell. And SIGINT is taken as a shell's
    foreground job takes it, whatever the test run inherited: a run started in the
    background of a non-interactive shell ignores it, and would pass that on."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
