"""Repeated identical failures logged once with a count, not once per call.

During an outage the same failure comes from every call (a database that is down, a
peer that refuses, a spool that cannot be written): one line per call buried the first,
useful one under hundreds of thousands. `Repeats.log` writes the first occurrence of a
failure as it is (traceback and all), then only counts the same failure for `interval`
seconds; the next occurrence after that writes one summary line with the count before
logging anew. `flush` writes the summaries still owed (the scheduler's tick and the
shutdown call it), so a count is never lost when the failures simply stop.
"""
import dataclasses
import logging
import threading
import time
import weakref
from typing import Any, Callable, Hashable

DEFAULT_INTERVAL_SECONDS = 60
# Every Repeats made, so that flush_all reaches them; weak, so tests' ones can go.
_ALL: "weakref.WeakSet[Repeats]" = weakref.WeakSet()


def flush_all() -> None:
    for repeats in list(_ALL):
        repeats.flush()


@dataclasses.dataclass
class _Seen:
    since: float
    level: int
    what: str
    count: int = 0


class Repeats:
    """One per place that can flood; keys name what makes two failures "the same"."""

    def __init__(self, logger: logging.Logger | str, interval: float = DEFAULT_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger if isinstance(logger, logging.Logger) else logging.getLogger(logger)
        self.interval = interval
        self.clock = clock
        self.seen: dict[Hashable, _Seen] = {}
        # Scheduler jobs run in threads, handlers in the loop: both may log here.
        self.lock = threading.Lock()
        _ALL.add(self)

    def log(self, level: int, key: Hashable, msg: object, *args: Any, **kwargs: Any) -> bool:
        """Log `msg % args` unless the same `key` was logged less than `interval` ago, in
        which case it is counted. Returns True when the line was written."""
        now = self.clock()
        with self.lock:
            seen = self.seen.get(key)
            if seen is not None and now - seen.since < self.interval:
                seen.count += 1
                return False
            if seen is not None:
                self._summarise(seen, now)
            self.seen[key] = _Seen(now, level, _text(msg, args))
        self.logger.log(level, msg, *args, **kwargs)
        return True

    def warning(self, key: Hashable, msg: object, *args: Any, **kwargs: Any) -> bool:
        return self.log(logging.WARNING, key, msg, *args, **kwargs)

    def error(self, key: Hashable, msg: object, *args: Any, **kwargs: Any) -> bool:
        return self.log(logging.ERROR, key, msg, *args, **kwargs)

    def exception(self, key: Hashable, msg: object, *args: Any, **kwargs: Any) -> bool:
        return self.log(logging.ERROR, key, msg, *args, exc_info=True, **kwargs)

    def flush(self) -> None:
        """Write the count of every failure repeated since its line and no longer
        repeating (its interval is over); forget those."""
        now = self.clock()
        with self.lock:
            over = [key for key, seen in self.seen.items() if now - seen.since >= self.interval]
            for key in over:
                self._summarise(self.seen.pop(key), now)

    def _summarise(self, seen: _Seen, now: float) -> None:
        if seen.count:
            self.logger.log(seen.level, "%s: repeated %d more time(s) in %d s",
                            seen.what, seen.count, round(now - seen.since))


def key_of(exc: BaseException) -> tuple[str, str]:
    """What makes two exceptions the same failure: their type and text."""
    return type(exc).__name__, str(exc)


def _text(msg: object, args: tuple[Any, ...]) -> str:
    try:
        return str(msg) % args if args else str(msg)
    except (TypeError, ValueError):
        return str(msg)
