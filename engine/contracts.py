"""What the engine's callers and its parts hand each other, as types that mypy checks
(`make typecheck`): the context the engine runs in, what a stored call and a handled
one come to, what a send comes to. A unit of work is engine.commits.Unit."""
import asyncio
import datetime
from typing import Any, Coroutine, NamedTuple, Protocol, TypeAlias, TypeVar

import jinja2

from clients.http import Result
from clients.mailer import Mailer
from clients.telegram import TelegramClient
from clients.worker import WorkerClient
from clients.workflow import WorkflowClient
from models import WebhookEvent
from settings import Settings
from engine.commits import GroupCommit, Unit
from engine.destinations import Destinations

T = TypeVar("T")


class Metrics(Protocol):
    """What the engine counts (ops.metrics.Metrics keeps it, above the engine)."""

    def event_handled(self, event: WebhookEvent, outcome: str, seconds: float) -> None: ...

    def event_duplicate(self, source: str, event_type: str) -> None: ...

    def effect_sent(self, kind: str, result: str) -> None: ...


class EngineContext(Protocol):
    """What the engine asks of the context it is given (app.context.Context)."""
    settings: Settings
    commits: GroupCommit
    destinations: Destinations
    metrics: Metrics
    templates: jinja2.Environment
    worker: WorkerClient
    workflow: WorkflowClient
    mailer: Mailer
    telegram: TelegramClient
    # Which plugin handles a stored event: {source: its registry}.
    plugins: dict[str, Any]
    # The service's scheduler (scheduler.Scheduler: `run_soon(name)`), None where none runs.
    scheduler: Any

    @property
    def business_tz(self) -> datetime.tzinfo: ...

    def clock(self) -> datetime.datetime: ...

    def background(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task: ...

    async def db(self, unit: Unit[T]) -> T: ...


class Stored(NamedTuple):
    """A call stored in the inbox: its event, and whether it is new (False: a copy of
    one stored before, which `event` is)."""
    event: WebhookEvent
    created: bool


class Accepted(NamedTuple):
    """A call kept and, when new, handled. `event` is None when the call went to the
    spool (the database is unavailable; the drain stores and handles it). `outcome`
    (processed, failed, rejected, ignored...) is None when the call was not handled here:
    spooled, a copy of one stored before, or handled in the background."""
    event: WebhookEvent | None
    created: bool
    outcome: str | None


# What one send of an outbox row came to: its Result, recorded on the row; or None when
# another sender took the row over before its request went out (that sender sends it).
SendOutcome: TypeAlias = Result | None
