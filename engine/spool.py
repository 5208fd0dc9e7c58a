"""The spool: where an accepted call goes while the database cannot be written.

One JSON object per line in SPOOL_DIR/inbox.jsonl (the arguments of `inbox.record`: source,
event_type, dedup_key, also_known_as, external_id, order_number, status, last_error, the
payload as text, received_at in ISO 8601), appended and fsynced before the sender is
acknowledged. Several processes may share the directory: a writer holds an
exclusive flock while it appends and checks that the path still names the file it
opened (a drain may have renamed it meanwhile). A last line without its newline was torn
by a writer that died mid-append (never acknowledged): the next append cuts it off first.

Draining renames the live file to `inbox-<ns>-<pid>.draining` first, so new calls go to
a fresh file, then stores every line in the inbox under its dedup key and deletes the
file. A crash anywhere in between leaves the `.draining` file for the next drain, which
stores the lines again: the dedup keys make that a no-op for the ones already stored.
"""
import datetime
import fcntl
import glob
import json
import logging
import os
import time

from models import UTC
from engine.db import UNAVAILABLE, why_unavailable

log = logging.getLogger("receiver.spool")

LIVE_NAME = "inbox.jsonl"
UNSTORABLE_NAME = "unstorable.jsonl"
DRAINING_SUFFIX = ".draining"


def append(spool_dir, entry, name=LIVE_NAME):
    """Append `entry` (a JSON-ready dict) durably; raises OSError if it could not be."""
    os.makedirs(spool_dir, exist_ok=True)
    line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
    path = os.path.join(spool_dir, name)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not _still_named(fd, path):
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

    def __init__(self, logger, interval):
        self.logger, self.interval = logger, interval
        self.said, self.said_at = None, None

    def warn(self, now, message):
        if message == self.said and now - self.said_at < self.interval:
            return
        self.said, self.said_at = message, now
        self.logger.warning(message)


def store_all(spool_dir, store):
    """Hand every spooled call to `store(entry) -> (event, is_new)`, file by file, deleting
    each file once all its lines are stored.

    Returns (calls read, the events new to the inbox). A database still down leaves the
    files as they are for the next run."""
    _rotate(spool_dir)
    read = 0
    created = []
    for path in sorted(glob.glob(os.path.join(spool_dir, "*" + DRAINING_SUFFIX))):
        read += _store_file(path, store, created) or 0
    if read:
        log.info("spool drained: %d call(s) read, %d new to the inbox", read, len(created))
    return read, created


def _rotate(spool_dir):
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


def _store_file(path, store, created):
    """Store the lines of one draining file, then delete it; None if another process is
    draining it or it is gone. A database failure leaves the file in place."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        if not _still_named(fd, path):
            return None  # drained and deleted by another process just now
        with os.fdopen(os.dup(fd), "rb") as handle:
            entries = _entries(handle, path)
        for entry in entries:
            event, is_new = _store_entry(os.path.dirname(path), entry, store)
            if is_new:
                created.append(event)
        os.unlink(path)
        _fsync_directory(os.path.dirname(path))
        return len(entries)
    except UNAVAILABLE as exc:
        log.warning("spool not drained, the database is still unavailable: %s",
                    why_unavailable(exc))
        return None
    finally:
        os.close(fd)


def _store_entry(spool_dir, entry, store):
    """Store one spooled call. A call the inbox refuses for a reason other than the
    database being down would block the spool for good: it is set aside in
    UNSTORABLE_NAME for the operator instead (the spool size in /metrics shows it)."""
    try:
        return store(entry)
    except UNAVAILABLE:
        raise
    except Exception:
        log.exception("spooled %s call %s cannot be stored; set aside in %s",
                      entry.get("source"), entry.get("dedup_key"), UNSTORABLE_NAME)
        append(spool_dir,
               {**entry, "received_at": entry["received_at"].isoformat()},
               name=UNSTORABLE_NAME)
        return None, False


def _entries(handle, path):
    entries = []
    for number, line in enumerate(handle, start=1):
        try:
            entries.append(_decode(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            # Only a line torn by a crash mid-append can be unreadable, and its call was
            # never acknowledged (the fsync comes before the answer).
            log.error("spool %s line %d unreadable, skipped", path, number)
    return entries


def _decode(entry):
    received_at = datetime.datetime.fromisoformat(entry["received_at"]).astimezone(UTC)
    return {**entry, "received_at": received_at}


def _still_named(fd, path):
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _cut_torn_tail(fd):
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


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_directory(folder):
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
