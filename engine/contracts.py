"""What the engine's callers and its parts hand each other, as types that mypy checks
(`make typecheck`): the context the engine runs in, what a stored call and a handled
one come to, what a send comes to. A unit of work is engine.commits.Unit."""
import asyncio
import datetime
import zoneinfo
from typing import Any, Callable, Coroutine, NamedTuple, Protocol, Sequence, TypeAlias, TypeVar

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
from engine.store.orders import OrderRef

T = TypeVar("T")


class Metrics(Protocol):
    """What the engine counts (ops.metrics.Metrics keeps it, above the engine)."""

    def event_handled(self, event: WebhookEvent, outcome: str, seconds: float) -> None: ...

    def event_duplicate(self, source: str, event_type: str) -> None: ...

    def effect_sent(self, kind: str, result: str) -> None: ...


class Jobs(Protocol):
    """The service's scheduled jobs (scheduler.Scheduler), as the engine and the domain ask
    them."""

    @property
    def running(self) -> bool: ...

    def run_soon(self, name: str) -> None: ...


class Placed(NamedTuple):
    """Where a delivery stands in its sender's record, as its plugin declares it
    (plugins.registry.Placement): its dedup key (None: the receiver's), the stream whose
    events wait for each other (None: it waits for nothing) and its version there (None:
    its arrival)."""
    same: str | None
    stream: str | None
    version: str | None


class Registry(Protocol):
    """What the engine asks of a source's plugins (plugins.registry.Registry): the plugin
    for an event type (a function, plain or async, called with the context, the decoded
    payload and the event's effects), the payload decoded as the plugins receive it
    (arbitrary JSON), the orders a plugin's handling reads (engine.store.orders), where a
    delivery stands in its sender's record, whether it is handled after the answer."""

    def get(self, key: str) -> Any: ...

    def decode(self, payload: str) -> Any: ...

    def orders_of(self, key: str, payload: Any) -> Sequence[OrderRef]: ...

    def placed(self, key: str, payload: Any) -> Placed: ...

    def found_otherwise(self, key: str,
                        payload: str) -> Callable[[Any], list[WebhookEvent]] | None: ...

    def in_background(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...


class EngineContext(Protocol):
    """What the engine asks of the context it is given (app.context.Context)."""
    settings: Settings
    commits: GroupCommit
    destinations: Destinations
    templates: jinja2.Environment
    worker: WorkerClient
    workflow: WorkflowClient
    mailer: Mailer
    telegram: TelegramClient
    # Which plugin handles a stored event: {source: its registry}.
    plugins: dict[str, Registry]

    # Read only here: a context may keep a Metrics that counts more (ops.metrics).
    @property
    def metrics(self) -> Metrics: ...

    @property
    def scheduler(self) -> Jobs | None:
        """The service's scheduled jobs; None where none run (a command, a test)."""
        ...

    def clock(self) -> datetime.datetime: ...

    @property
    def business_tz(self) -> zoneinfo.ZoneInfo: ...

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
