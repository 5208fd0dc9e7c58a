"""The context every plugin and handler receives: settings, clients, clock, templates.

Nothing reaches for globals: tests build a Context with their own settings, peers and
clock."""
import asyncio
import concurrent.futures
import dataclasses
import datetime
import functools
import logging
import os
import typing
import zoneinfo

import jinja2

from clients.http import HttpClient
from clients.mailer import Mailer
from clients.telegram import TelegramClient
from clients.workflow import WorkflowClient
from clients.worker import WorkerClient
from models import utcnow
from engine.commits import GroupCommit, Unit, without_budget
from handlers.budget import BodyBudget
from handlers.ratelimit import RateLimiter
from engine.destinations import Destinations
from engine.outbox import tell_credentials_refused, tell_destination_went
from ops.metrics import Metrics
from plugins import registries
from settings import Settings

log = logging.getLogger("receiver")
T = typing.TypeVar("T")

TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "templates")


def template_environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        autoescape=jinja2.select_autoescape(["html", "htm", "xml"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True, lstrip_blocks=True)


@dataclasses.dataclass
class Context:
    settings: Settings
    workflow: WorkflowClient
    worker: WorkerClient
    mailer: Mailer
    telegram: TelegramClient
    templates: jinja2.Environment
    http: HttpClient
    # Failed authentications per client address (handlers.base.ApiHandler).
    auth_failures: RateLimiter
    # The request bodies held in memory (handlers.budget).
    bodies: BodyBudget
    clock: typing.Callable = utcnow
    background_tasks: set = dataclasses.field(default_factory=set)
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    commits: GroupCommit = dataclasses.field(default_factory=GroupCommit)
    # Which plugin handles a stored event: {source: Registry}. The engine reads it from
    # here, so it never imports the plugins above it.
    plugins: dict = dataclasses.field(default_factory=registries)
    # Set by `serve` once the scheduler runs (anything with `.running`); /readyz asks it.
    scheduler: typing.Any = None
    # What this process has learnt of each destination's health, and its calls in flight.
    destinations: Destinations = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.destinations = Destinations(self)
        self.destinations.when_refused(functools.partial(tell_credentials_refused, self))
        self.destinations.when_went(functools.partial(tell_destination_went, self))

    @classmethod
    def create(cls, settings: Settings,
               clock: typing.Callable[[], datetime.datetime] = utcnow) -> "Context":
        http = HttpClient()
        mail_threads = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="smtp")
        return cls(
            settings=settings,
            workflow=WorkflowClient(http, settings),
            worker=WorkerClient(http, settings),
            mailer=Mailer(settings, mail_threads),
            telegram=TelegramClient(http, settings),
            templates=template_environment(),
            http=http,
            clock=clock,
            auth_failures=RateLimiter(settings.auth_failure_limit,
                                      settings.auth_failure_window_seconds),
            bodies=BodyBudget.from_settings(settings),
            metrics=Metrics(cache_seconds=settings.metrics_cache_seconds))

    @property
    def business_tz(self) -> zoneinfo.ZoneInfo:
        return zoneinfo.ZoneInfo(self.settings.business_tz)

    async def db(self, unit: Unit[T]) -> T:
        """The one door to the database: run `unit()` (plain synchronous code that reads
        or writes, and returns what its caller needs) in the database thread, in the
        group commit's next turn (engine.commits); returns what it returned once its
        transaction is committed. Read-only units go the same way. Nothing on the loop
        talks to the database otherwise (the test suite refuses it)."""
        return await self.commits.run(unit)

    def background(self, coroutine: typing.Coroutine[typing.Any, typing.Any, typing.Any]
                   ) -> asyncio.Task:
        """Run `coroutine` after the answer is sent; kept so shutdown can wait for it.
        It is not bound by the call's database budget (engine.commits.budget)."""
        task = asyncio.get_running_loop().create_task(coroutine, context=without_budget())
        self.background_tasks.add(task)
        task.add_done_callback(self.background_tasks.discard)
        return task

    async def drain_background(self) -> None:
        while self.background_tasks:
            await asyncio.gather(*list(self.background_tasks), return_exceptions=True)

    async def close(self, within: float | None = None) -> None:
        """After the background work (`within` seconds at most: what is still running
        then is cancelled, and what it had leased is taken again after the lease, as
        after a crash), the peers' connections are closed."""
        if within is None:
            await self.drain_background()
        elif self.background_tasks:
            _, left = await asyncio.wait(set(self.background_tasks), timeout=max(within, 0))
            if left:
                log.warning("stopping: %d background task(s) still busy; cancelling them",
                            len(left))
                for task in left:
                    task.cancel()
                await asyncio.gather(*left, return_exceptions=True)
        await self.http.close()
