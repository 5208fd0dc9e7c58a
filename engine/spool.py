"""The spool: where an accepted call goes while the database cannot be written.

One JSON object per line in SPOOL_DIR/inbox.jsonl (the arguments of `inbox.record`: source,
event_type, dedup_key, also_known_as, also_known_between, external_id, order_number,
status, last_error, the payload as text, received_at in ISO 8601), appended and fsynced
before the sender is acknowledged. Several processes may share the directory: a writer
holds an exclusive flock while it appends and checks that the path still names the file it
opened (a drain may have renamed it meanwhile). A last line without its newline was torn
by a writer that died mid-append (never acknowledged): the next append cuts it off first.

Arrival order: while any file is here (`backlog`), a new call joins the spool behind the
calls in it rather than going to the database, even when the database answers: it would
otherwise be handled before calls that came earlier. A file goes only once its calls are
stored and handled.

Draining renames the live file to `inbox-<ns>-<pid>.draining` first, so new calls go to
a fresh file, then stores every line in the inbox under its dedup key, has the new ones
handled, and deletes the file. A crash anywhere in between leaves the `.draining` file
for the next drain, which stores the lines again: the dedup keys make that a no-op for
the ones already stored.

A line the database refuses (rather than cannot take now: engine.errors.is_down) would stop the
drain at every tick, and every call spooled after it with it. It is quarantined instead:
appended to SPOOL_DIR/unstorable.jsonl with the reason, and the drain goes on with the
next line. A line that cannot be read is quarantined too, its bytes kept as they were
(`raw_base64`), with the reason: it was acknowledged. Only a last line without its newline
was never acknowledged (torn by a writer that died mid-append), and is dropped.
`quarantined()` reads them back for the CLI, /metrics and /readyz.
"""
import asyncio
import base64
import datetime
import fcntl
import glob
import json
import logging
import os
import time
from typing import IO, Any, Awaitable, Callable

from engine import lograte
from models import UTC, WebhookEvent
from engine.contracts import Stored
from engine.db import UNAVAILABLE, why_unavailable

log = logging.getLogger("receiver.spool")
# The drain ticks every few seconds through an outage: one line per minute, with a count.
NOT_DRAINED = lograte.Repeats(log)

LIVE_NAME = "inbox.jsonl"
UNSTORABLE_NAME = "unstorable.jsonl"
DRAINING_SUFFIX = ".draining"
# A refusal's text can quote the refused value (PostgreSQL's index row error does not,
# a driver's may); the reason kept with a quarantined call is cut to this.
MAX_REASON_CHARS = 500
# Spooled calls handed to the inbox at once: one transaction of the group commit.
STORE_BATCH = 50


# A spooled call: the inbox's fields of it (engine.inbox), JSON-ready.
Entry = dict[str, Any]


def append(spool_dir: str, entry: Entry, name: str = LIVE_NAME) -> None:
    """Append `entry` (a JSON-ready dict) durably; raises OSError if it could not be."""
    os.makedirs(spool_dir, exist_ok=True)
    line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
    path = os.path.join(spool_dir, name)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not _path_still_opens(path, fd):
                continue  # renamed by a drain between our open and our lock
            size = _cut_torn_tail(fd)
            created = size == 0
            try:
                _write_all(fd, line)
                os.fsync(fd)
            except OSError:
                # A part written (disk full, say) would be glued to the next line; the
                # call is not acknowledged, so none of it may stay.
                os.ftruncate(fd, size)
                raise
            if created:
                _fsync_directory(spool_dir)
            return
        finally:
            os.close(fd)


class Unusable(Exception):
    """SPOOL_DIR cannot be used (not a directory, no permission...); the message says
    which and what to do. It stays so until the operator fixes it."""


class LastingProblem:
    """Logs a problem that lasts on one line: the first time, then again only when it
    changes or `interval` has passed, instead of at every scheduler tick."""

    def __init__(self, logger: logging.Logger, interval: datetime.timedelta) -> None:
        self.logger, self.interval = logger, interval
        self.said: str | None = None
        self.said_at = datetime.datetime.min.replace(tzinfo=UTC)

    def warn(self, now: datetime.datetime, message: str) -> None:
        if message == self.said and now - self.said_at < self.interval:
            return
        self.said, self.said_at = message, now
        self.logger.warning(message)


class Drained:
    """What one file's drain did: calls read, the events new to the inbox, and the calls
    quarantined (each a spooled entry with its `unstorable` reason)."""

    def __init__(self) -> None:
        self.read = 0
        self.created: list[WebhookEvent] = []
        self.quarantined: list[Entry] = []


def backlog(spool_dir: str) -> bool:
    """Whether calls wait here (a live file, or one being drained): a new call must join
    them. One directory listing, cheap enough for every call; a spool that cannot be
    listed holds nothing back."""
    try:
        names = os.listdir(spool_dir)
    except OSError:
        return False
    return any(name == LIVE_NAME or name.endswith(DRAINING_SUFFIX) for name in names)


async def store_all(spool_dir: str, store: Callable[[Entry], Awaitable[Stored]],
                    handle: Callable[[Drained], Awaitable[None]]) -> int:
    """Hand every spooled call to `await store(entry) -> (event, is_new)`, file by file;
    then `await handle(drained)` with what the file gave (a Drained), and delete the
    file. STORE_BATCH calls are handed over at once (the group commit stores them in one
    transaction); the loop answers other requests between batches, so a long outage's
    spool does not hold it.

    Returns the number of calls read. A database still down leaves the files as they are
    for the next run."""
    _rotate(spool_dir)
    read = 0
    for path in sorted(glob.glob(os.path.join(spool_dir, "*" + DRAINING_SUFFIX))):
        read += await _store_file(path, store, handle) or 0
    return read


def quarantined(spool_dir: str) -> list[Entry]:
    """The quarantined calls, oldest first, as they were written (received_at as text).
    A drain that stopped mid-file (the database went away again) quarantines the same
    call again on its next run: it is listed once."""
    try:
        with open(os.path.join(spool_dir, UNSTORABLE_NAME), "rb") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []  # none yet, or no spool to read (/readyz's spool check says why)
    entries: dict[tuple, dict] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # torn by a crash mid-append; cut off by the next append
        key = entry.get("raw_base64") or (entry.get("source"), entry.get("dedup_key"))
        entries.setdefault(key, entry)
    return list(entries.values())


def _rotate(spool_dir: str) -> None:
    live = os.path.join(spool_dir, LIVE_NAME)
    target = os.path.join(spool_dir, f"inbox-{time.time_ns()}-{os.getpid()}{DRAINING_SUFFIX}")
    try:
        os.rename(live, target)
    except FileNotFoundError:
        return  # nothing spooled (append creates the directory when it must)
    except OSError as exc:
        raise Unusable(f"spool directory {spool_dir} cannot be used: {exc.strerror}; fix "
                       "SPOOL_DIR or its permissions (/readyz reports it too)") from None
    _fsync_directory(spool_dir)


async def _store_file(path: str, store: Callable[[Entry], Awaitable[Stored]],
                      handle: Callable[[Drained], Awaitable[None]]) -> int | None:
    """Store the lines of one draining file, have them handled, then delete it; None if
    another process is draining it or it is gone. A database failure leaves the file in
    place."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        if not _path_still_opens(path, fd):
            return None  # drained and deleted by another process just now
        with os.fdopen(os.dup(fd), "rb") as lines:
            entries, unreadable = _entries(lines, path)
        spool_dir, drained = os.path.dirname(path), Drained()
        for line, reason in unreadable:
            _quarantine(spool_dir, {"raw": line.decode("utf-8", "replace"),
                                    "raw_base64": base64.b64encode(line).decode()},
                        reason, drained)
        for start in range(0, len(entries), STORE_BATCH):
            batch = entries[start:start + STORE_BATCH]
            outcomes = await asyncio.gather(*(store(entry) for entry in batch),
                                            return_exceptions=True)
            for entry, outcome in zip(batch, outcomes):
                _store_entry(spool_dir, entry, outcome, drained)
        drained.read = len(entries) + len(unreadable)
        log.info("spool file drained: %d call(s) read, %d new to the inbox, %d quarantined",
                 drained.read, len(drained.created), len(drained.quarantined))
        await handle(drained)
        os.unlink(path)
        _fsync_directory(spool_dir)
        return drained.read
    except UNAVAILABLE as exc:
        reason = why_unavailable(exc)
        NOT_DRAINED.warning(reason, "spool not drained, the database is still unavailable: %s",
                            reason)
        return None
    finally:
        os.close(fd)


def _store_entry(spool_dir: str, entry: Entry, outcome: Stored | BaseException,
                 drained: Drained) -> None:
    """Account for one spooled call's storing; quarantine it if the database refused it.
    A database down raises, leaving the file for the next drain."""
    if isinstance(outcome, UNAVAILABLE):
        raise outcome
    if isinstance(outcome, Exception):
        _quarantine(spool_dir, {**entry, "received_at": entry["received_at"].isoformat()},
                    f"{type(outcome).__name__}: {why_unavailable(outcome)}", drained)
        return
    if isinstance(outcome, BaseException):
        raise outcome  # the drain was cancelled: the file stays for the next one
    event, is_new = outcome
    if is_new:
        drained.created.append(event)


def _quarantine(spool_dir: str, entry: Entry, reason: str, drained: Drained) -> None:
    reason = reason[:MAX_REASON_CHARS]
    log.error("spooled %s call %.80s cannot be stored, quarantined in %s: %s",
              entry.get("source", "unreadable"), entry.get("dedup_key", "-"),
              UNSTORABLE_NAME, reason)
    kept = {**entry, "unstorable": reason}
    append(spool_dir, kept, name=UNSTORABLE_NAME)
    drained.quarantined.append(kept)


def _entries(lines: IO[bytes], path: str) -> tuple[list[Entry], list[tuple[bytes, str]]]:
    """The calls of a spool file, and its unreadable lines with the reason each. A last
    line without its newline was torn by a crash mid-append, and its call never
    acknowledged (the fsync comes before the answer): it is dropped. Any other line was
    acknowledged, whatever has become of it."""
    entries: list[Entry] = []
    unreadable: list[tuple[bytes, str]] = []
    for number, line in enumerate(lines, start=1):
        if not line.endswith(b"\n"):
            log.error("spool %s line %d torn by an interrupted append, dropped", path, number)
            break
        try:
            entries.append(_decode(json.loads(line)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            unreadable.append((line.rstrip(b"\n"),
                               f"unreadable line {number}: {type(exc).__name__}: {exc}"))
    return entries, unreadable


def _decode(entry: Entry) -> Entry:
    received_at = datetime.datetime.fromisoformat(entry["received_at"]).astimezone(UTC)
    return {**entry, "received_at": received_at}


def _path_still_opens(path: str, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (not renamed away meanwhile)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _cut_torn_tail(fd: int) -> int:
    """Truncate a last line left without its newline (a writer died mid-append; its call
    was never acknowledged), so the next line is not glued onto it and lost with it.
    Returns the size of the file that remains."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size
    while end > 0:
        start = max(0, end - 4096)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            end = start + newline + 1
            break
        end = start
    log.error("spool %d byte(s) torn by an interrupted append, cut off", size - end)
    os.ftruncate(fd, end)
    return end


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_directory(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
