"""The one retry policy: when anything that retries tries again, and when it gives up.

Every retrying thing asks its Policy: an inbox event's handling (`inbox`), an outbox
effect's send (`outbox`), a down destination's probes (`probes`). The delay before the
next try doubles from `base_seconds` up to `cap_seconds`, drawn between half and all of
that (jitter), so that what failed together does not come back together; probes keep
their exact times, one at a time. At `max_attempts` tries (settings INBOX_MAX_ATTEMPTS,
OUTBOX_MAX_ATTEMPTS), or at once for a refusal no retry can change, the thing is given
up: `dead`, and the administrator is told once (`outbox.tell_admin`, keyed by what was
given up). A try counts even when its outcome cannot be recorded as it is (the row then
records that instead). Probes never give up: a destination is tried until it is back.

Settlement (`settlement`) tries each waiting order at every run and never gives it up
(Frappe's document may yet move), but tells the administrator once, at
SETTLEMENT_REFUSALS_BEFORE_ALERT refusals of one order (domain.settlement). A spooled
call the database refuses does not retry: it is quarantined at once (no later try can
change a refusal).
"""
import dataclasses
import datetime
import random

from settings import Settings

HOUR = 3600


@dataclasses.dataclass(frozen=True)
class Policy:
    base_seconds: float
    cap_seconds: float
    # None: never given up.
    max_attempts: int | None = None
    jitter: bool = True

    def gives_up(self, attempts: int) -> bool:
        """Whether `attempts` tries made are all there will be."""
        return self.max_attempts is not None and attempts >= self.max_attempts

    def tells_admin_at(self, attempts: int) -> bool:
        """Whether the administrator is told now: at the try that reaches the bound, once."""
        return self.max_attempts is not None and attempts == self.max_attempts

    def delay(self, attempts: int) -> datetime.timedelta:
        """How long after the `attempts`-th failed try the next one comes."""
        ceiling = min(self.cap_seconds, self.base_seconds * 2 ** max(attempts - 1, 0))
        seconds = random.uniform(ceiling / 2, ceiling) if self.jitter else ceiling
        return datetime.timedelta(seconds=seconds)


def inbox(settings: Settings) -> Policy:
    """An event whose handling failed: 1 min, 2 min, 4 min ... 6 h."""
    return Policy(60, 6 * HOUR, settings.inbox_max_attempts)


def outbox(settings: Settings) -> Policy:
    """An effect whose send failed: 30 s, 1 min, 2 min ... 6 h."""
    return Policy(30, 6 * HOUR, settings.outbox_max_attempts)


def settlement(settings: Settings) -> Policy:
    """A CRTC order whose funds action Frappe refused: tried again at every settlement
    run; the administrator told at SETTLEMENT_REFUSALS_BEFORE_ALERT refusals."""
    every_run = 60 * settings.settlement_interval_minutes
    return Policy(every_run, every_run, settings.settlement_refusals_before_alert,
                  jitter=False)


def probes(settings: Settings) -> Policy:
    """A destination found down: one probe 5 s on, then 10 s, 20 s ... up to
    OUTBOUND_PROBE_MAX_SECONDS."""
    return Policy(5, settings.outbound_probe_max_seconds, jitter=False)
