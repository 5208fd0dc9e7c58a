"""The systems effects go to, each with what this process has learnt about it.

Health: after OUTBOUND_DOWN_AFTER consecutive sends that found the peer unwell (a
network error, a timeout, a 5xx) a destination is `down`: its rows are left alone, and
one of them is tried (a probe) after a backoff of 5 s that doubles up to
OUTBOUND_PROBE_MAX_SECONDS (engine.retry.probes; the first comes soon, at the scheduler's
next tick or with the next webhook's effect: an outage is often a restart). The first send that reaches the peer (any answer but a
5xx) makes it `up` again. A webhook's own effect may be the probe, so a destination that
comes back under traffic is found back within the probe's backoff. Kept in this
process's memory: each process learns on its own, which costs at most
OUTBOUND_DOWN_AFTER sends per process.

Misconfiguration is told apart from a sick peer (the client says which, clients.http.Result):
- `credentials refused`: the peer refused our credentials (a rotated API key). Every
  call would be refused alike, so the destination is taken out of use at once, as a down
  one is (its rows wait, a probe now and then), and the administrator is told once; the
  first call the peer takes again (a probe, the start-up or readiness check) ends it.
- `misconfigured`: our settings name something the peer does not have (a misspelled
  doctype). The call is given up at once and not counted as the peer failing; the state
  is shown until a call goes through.

In flight: at most OUTBOUND_MAX_IN_FLIGHT calls to one destination at once, so a peer
coming back is not flooded by the backlog. A quarter of them (at least one) are kept for
the request path's own sends: the scheduled sender's backlog never holds them all, so a
live webhook's effect waits only behind other live ones.
"""
import asyncio
import contextlib
import datetime
import logging
from typing import AsyncIterator, Callable, Iterator, Protocol

from clients.http import Result
from clients.mailer import Mailer
from clients.telegram import TelegramClient
from clients.worker import WorkerClient
from clients.workflow import WorkflowClient
from settings import Settings

from engine import retry

log = logging.getLogger("receiver.outbox")

# Which destination each kind of effect goes to.
DESTINATION_OF = {"job": "worker", "workflow_action": "workflow", "alert": "telegram",
                  "email": "smtp"}
# The kinds whose effects of one order go out in the order they were caused: a worker
# job must not overtake an earlier one, nor a workflow action an earlier action. Alerts
# and mails are independent messages, ordered behind or ahead of nothing.
ORDERED_KINDS = ("job", "workflow_action")
# How long the answer of a configuration check (`Destination.check`) stands: /readyz
# asks again at most this often, so a probe every few seconds costs the peer nothing.
CHECK_SECONDS = 60


class Peer(Protocol):
    """A client of a destination's system (clients/)."""

    @property
    def configured(self) -> bool: ...


class Peers(Protocol):
    """What Destinations takes from its context (app.context.Context)."""
    settings: Settings
    worker: WorkerClient
    workflow: WorkflowClient
    telegram: TelegramClient
    mailer: Mailer

    def clock(self) -> datetime.datetime: ...


class Destination:
    def __init__(self, name: str, client: Peer, settings: Settings,
                 clock: Callable[[], datetime.datetime],
                 recovered: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.client = client
        self.clock = clock
        self.recovered = recovered
        self.down_after = settings.outbound_down_after
        # However few sends there are to fail: a destination whose sends have all found
        # it unwell for this long is down (its probes then find it back within seconds).
        self.down_after_time = datetime.timedelta(
            seconds=settings.outbound_down_after_seconds)
        self.failing_since: datetime.datetime | None = None
        # The effects whose sends failed since: one effect failing again and again may be
        # its own trouble, two or more are the peer's.
        self.failing_effects: set[int] = set()
        # Found back up: its effects waiting on a backoff are made due at the sender's
        # next run (`outbox.send_due`), which this asks for at once.
        self.back = False
        self.probes = retry.probes(settings)
        self.failed_probes = 0
        self.up = True
        self.failures = 0
        # How long a destination that is down waits between probes (set when it goes down).
        self.probe_wait = self.probes.delay(1)
        self.probe_at: datetime.datetime | None = None
        self.probing = False
        self.down_since: datetime.datetime | None = None
        # The failure that took it down; whether its going down was told (`went`), so
        # that only an outage told is told over (one of credentials has its own notice).
        self.down_because: str | None = None
        self.down_told = False
        self.in_flight = 0
        # What the peer said when it refused our credentials, or named our settings wrong.
        self.credentials_refused: str | None = None
        self.misconfigured: str | None = None
        self.refused_credentials = lambda destination: None
        # Told when it goes down (`up` False) and when it is back (True, with when it went).
        self.went: Callable[[Destination, bool, datetime.datetime | None], None] = \
            lambda destination, up, since: None
        # The configuration check: its client's `check()`, when it has one.
        self.checked_at: datetime.datetime | None = None
        self.checking: asyncio.Future | None = None
        limit = settings.outbound_max_in_flight
        self._any = asyncio.Semaphore(limit)
        self._backlog = asyncio.Semaphore(max(1, limit - max(1, limit // 4)))

    @property
    def configured(self) -> bool:
        return self.client.configured

    @property
    def state(self) -> str:
        if not self.configured:
            return "not configured"
        if self.credentials_refused:
            return "credentials refused"
        if self.misconfigured:
            return "misconfigured"
        return "up" if self.up else "down"

    @property
    def problem(self) -> str | None:
        """What the peer said of our configuration, while it stands."""
        return self.credentials_refused or self.misconfigured

    @property
    def warnings(self) -> dict[str, str]:
        """What the last configuration check found wrong that leaves the destination in
        use (Frappe: the API user may not read Workflow; WORKFLOW_TIME_ZONE is not the
        site's), by what; {} for a client without such a check."""
        return dict(getattr(self.client, "findings", {}))

    def take_probe(self) -> bool:
        """True, once per probe time, while down: the caller sends one row as the probe."""
        if self.up or (self.probe_at is not None and self.clock() < self.probe_at):
            return False
        self.probe_at = self.clock() + self.probe_wait  # one probe at a time
        self.probing = True
        return True

    def observe(self, result: Result | None, effect: int | None = None) -> None:
        """Learn from a send's Result (None: nothing was sent); `effect`: the outbox row
        it was for."""
        if result is None or not result.configured:
            return
        if result.credentials_refused:
            self._refuse(result)
            return
        if result.misconfigured:
            if self.misconfigured is None:
                log.error("destination %s: our settings name what it does not have: %s",
                          self.name, result.error)
            self.misconfigured = result.error
        elif result.ok:
            self.misconfigured = None
        if not result.peer_failed:
            self.failures, self.failing_since = 0, None
            self.failing_effects.clear()
            if self.credentials_refused:
                self.credentials_refused = None
                log.warning("destination %s takes our credentials again", self.name)
            if not self.up:
                self._come_back()
                log.warning("destination %s is up again: sending its effects", self.name)
            return
        self.failures += 1
        self.failing_since = self.failing_since or self.clock()
        if effect is not None:
            self.failing_effects.add(effect)
        if self.up and (self.failures >= self.down_after or self._failing_too_long()):
            self._go_down(result.error)
        elif not self.up and self.probing:
            self.probing = False
            self.failed_probes += 1
            self.probe_wait = self.probes.delay(self.failed_probes + 1)
        else:
            return  # still up; or a send that was in flight when it went down
        self.probe_at = self.clock() + self.probe_wait

    def answered(self) -> None:
        """The peer answered a call of ours other than a send (Frappe: a reconciliation's
        list): if it was taken for down, it is back, and its effects go at once. What
        it said of our configuration stands."""
        if not self.up and not self.credentials_refused:
            self.failures, self.failing_since = 0, None
            self.failing_effects.clear()
            self._come_back()
            log.warning("destination %s answers again: sending its effects", self.name)

    def _failing_too_long(self) -> bool:
        return (self.failing_since is not None and len(self.failing_effects) >= 2
                and self.clock() - self.failing_since >= self.down_after_time)

    def _come_back(self) -> None:
        went_at = self.down_since
        self.up, self.probing, self.down_since = True, False, None
        self.back = True
        self.recovered()
        if self.down_told:
            self.down_told = False
            self.went(self, True, went_at)

    def _go_down(self, error: str) -> None:
        self.up, self.probing, self.down_since = False, False, self.clock()
        self.down_because = error
        self.failed_probes = 0
        self.probe_wait = self.probes.delay(1)
        log.error("destination %s is down after %d failed send(s) in a row over %d s (%s): "
                  "its effects wait, one is tried every %s s or so", self.name,
                  self.failures, (self.clock() - (self.failing_since or self.clock()))
                  .total_seconds(), error, int(self.probe_wait.total_seconds()))
        self.down_told = True
        self.went(self, False, None)

    def down_if_failing_too_long(self) -> None:
        """Down once every send for OUTBOUND_DOWN_AFTER_SECONDS has failed, for two effects
        or more, even when too few were made to count OUTBOUND_DOWN_AFTER (a few effects
        on their backoff): asked at every run of the scheduled sender."""
        if self.up and self.failures and self._failing_too_long():
            self._go_down("no send went through since "
                          f"{self.failing_since:%H:%M:%S} UTC")
            self.probe_at = self.clock() + self.probe_wait

    async def check(self, within: float | None = None) -> None:
        """Ask the peer whether our configuration works (credentials, the names our
        settings give it), when its client can (`check()`), and learn from the answer.
        An answer younger than CHECK_SECONDS stands. Waits at most `within` seconds:
        a check still running then goes on, and its answer is learnt when it comes."""
        if not self.configured or not hasattr(self.client, "check"):
            return
        if self.checking is None or self.checking.done():
            fresh = datetime.timedelta(seconds=CHECK_SECONDS)
            if self.checked_at is not None and self.clock() - self.checked_at < fresh:
                return
            self.checking = asyncio.ensure_future(self._check())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.checking), within)

    async def _check(self) -> None:
        result = await getattr(self.client, "check")()
        self.checked_at = self.clock()
        if result.ok:
            log.info("destination %s: its configuration check passed", self.name)
        elif not (result.credentials_refused or result.misconfigured):
            log.warning("destination %s: configuration not checked: %s", self.name,
                        result.error)
        self.observe(result)

    def _refuse(self, result: Result) -> None:
        """Out of use until the peer takes our credentials again; probed like a down
        destination."""
        self.failures = 0
        if self.credentials_refused is None:
            self.credentials_refused = result.error
            self.up, self.probing = False, False
            self.down_since = self.down_since or self.clock()
            self.failed_probes = 0
            self.probe_wait = self.probes.delay(1)
            log.error("destination %s refuses our credentials (%s): its effects wait until "
                      "they are fixed", self.name, result.error)
            self.refused_credentials(self)
        elif self.probing:
            self.probing = False
            self.failed_probes += 1
            self.probe_wait = self.probes.delay(self.failed_probes + 1)
        self.probe_at = self.clock() + self.probe_wait

    @contextlib.asynccontextmanager
    async def slot(self, live: bool) -> AsyncIterator[None]:
        """A place among the calls in flight; the backlog's sends may not take the share
        kept for live ones."""
        async with contextlib.AsyncExitStack() as stack:
            if not live:
                await stack.enter_async_context(self._backlog)
            await stack.enter_async_context(self._any)
            self.in_flight += 1
            try:
                yield
            finally:
                self.in_flight -= 1


class Destinations:
    """The four destinations of one Context, by name."""

    def __init__(self, ctx: Peers) -> None:
        clients: dict[str, Peer] = {"worker": ctx.worker, "workflow": ctx.workflow,
                                    "telegram": ctx.telegram, "smtp": ctx.mailer}
        self.by_name = {name: Destination(name, client, ctx.settings, lambda: ctx.clock(),
                                          self._recovered)
                        for name, client in clients.items()}
        self._when_recovered: list[Callable[[], None]] = []
        self._when_refused: list[Callable[[Destination], None]] = []
        self._when_went: list[Callable[[Destination, bool, datetime.datetime | None],
                                       None]] = []
        for destination in self:
            destination.refused_credentials = self._refused
            destination.went = self._went

    async def check(self, within: float | None = None) -> None:
        """Every destination's configuration check (`Destination.check`), at once."""
        await asyncio.gather(*(destination.check(within) for destination in self))

    def when_refused(self, callback: Callable[[Destination], None]) -> None:
        """Call `callback(destination)` whenever a destination starts refusing our
        credentials (the administrator is told)."""
        self._when_refused.append(callback)

    def _refused(self, destination: Destination) -> None:
        for callback in self._when_refused:
            callback(destination)

    def when_went(self, callback: Callable[[Destination, bool, datetime.datetime | None],
                                           None]) -> None:
        """Call `callback(destination, up, down_since)` whenever a destination goes down
        (`up` False) and when it is found back (True, with when it went down): the
        operator is told of both."""
        self._when_went.append(callback)

    def _went(self, destination: Destination, up: bool,
              since: datetime.datetime | None) -> None:
        for callback in self._when_went:
            callback(destination, up, since)

    def when_recovered(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever a destination that was down is found up again (the
        scheduler sends its backlog then, rather than at its next tick)."""
        self._when_recovered.append(callback)

    def _recovered(self) -> None:
        for callback in self._when_recovered:
            callback()

    def __iter__(self) -> Iterator[Destination]:
        return iter(self.by_name.values())

    def of(self, kind: str) -> Destination:
        return self.by_name[DESTINATION_OF[kind]]

    def kinds(self, which: Callable[[Destination], bool]) -> list[str]:
        """The kinds of effect whose destination `which(destination)` is true."""
        return [kind for kind, name in DESTINATION_OF.items() if which(self.by_name[name])]
