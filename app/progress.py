"""Progress of a long command (`backfill`, `events replay --failed`, `reconcile
workflow`): on a terminal, a tqdm bar on stderr with the count, the rate and what is
left, the log lines written above it; when stderr is not a terminal (journald, cron, a
pipe), nothing but the command's own summary line at the end."""
import contextlib
import sys
from typing import Optional, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


class TerminalProgress(contextlib.ExitStack):
    """Called as `progress(done, total)` by the loop it follows (total None while it
    is not known); a context manager, which clears the bar at the end."""

    def __init__(self, what: str, unit: str, stream: Optional[TextIO] = None) -> None:
        super().__init__()
        stream = stream or sys.stderr
        self.bar = tqdm(desc=what, unit=unit, file=stream, leave=False,
                        disable=not stream.isatty())
        self.callback(self.bar.close)
        if not self.bar.disable:
            # A log line written straight to stderr would break into the bar.
            self.enter_context(logging_redirect_tqdm(tqdm_class=tqdm))

    def __call__(self, done: int, total: Optional[int]) -> None:
        if total != self.bar.total:
            self.bar.total = total
            self.bar.refresh()
        self.bar.update(done - self.bar.n)
        if done == total:
            # tqdm draws a step only so many items after the last one drawn: the end is
            # drawn however few came since.
            self.bar.refresh()
