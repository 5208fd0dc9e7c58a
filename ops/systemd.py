"""sd_notify(3) in a few lines: tell systemd (Type=notify) we are ready or stopping.

The protocol is one datagram of "KEY=value" lines to the unix socket named by
$NOTIFY_SOCKET; a name starting with "@" is in the abstract namespace. Without
$NOTIFY_SOCKET (not started by systemd) every call does nothing."""
import logging
import os
import socket
from typing import Mapping

log = logging.getLogger("receiver.systemd")


def notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send `message` (e.g. "READY=1"); return True when a notify socket took it."""
    address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("sd_notify %r not delivered: %s", message.split("\n", 1)[0], exc)
        return False
    return True


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when not asked for."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2_000_000
