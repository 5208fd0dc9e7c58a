"""The decorator-based registry that maps an event's name to its plugin.

A plugin is `handle(ctx, payload, tx)` (or an object called so, a `WorkflowWebhook`),
plain or async: it handles one stored event's payload in the transaction `tx`. Each is
registered with its `Placement`: how the inbox tells its deliveries apart and orders them,
as the sender's record says. No plugin is registered without one."""
import dataclasses
import logging
from typing import Any, Awaitable, Callable, Iterable, Protocol, TypeVar

from engine.contracts import EngineContext, Placed
from engine.payload import exact_json, read_json
from engine.transaction import OrderRef, Transaction
from models import WebhookEvent

log = logging.getLogger("receiver.plugins")

Payload = dict[str, Any]
Plugin = Callable[[EngineContext, Payload, Transaction], Awaitable[None] | None]
OrdersOf = Callable[[Payload], Iterable[OrderRef]]
P = TypeVar("P", bound=Plugin)
# What finds a stored event that is this delivery's fact under another finder's key.
FoundOtherwise = Callable[[Transaction], list[WebhookEvent]]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a delivery of one event type stands in its sender's record, declared beside its
    plugin and read by the inbox (engine.inbox's ordering rule):

    - `same(payload)`: the key under which two deliveries are one fact (a copy is stored
      once); None leaves the key to the receiver (a workflow body without a version).
    - `stream(payload)`: the events that wait for each other, handled one after another
      in version order (a Frappe document's changes, an invoice's callbacks); None: a fact
      that folds in any order and waits for nothing (a Stripe event).
    - `version(payload)`: its place in its stream, as text that sorts in the sender's
      order (Frappe's `modified`); None: its arrival.
    - `found_otherwise(payload)`: for a fact another finder may have stored under a key of
      its own (a Frappe change its document's workflow log found first, or the other
      way), what finds the stored events of that fact, newest first: in the storing's
      transaction, the delivery is then the first one's copy, whichever way it came (the
      request, the spool drain); in the handling's, a copy handled already makes this one
      a copy too (two processes may each store theirs before seeing the other's). None,
      and for a type that declares none: only its keys find it.

    Each function gets the decoded payload and may raise on one it cannot read: the call
    is then placed by its arrival alone, and its handling says why it failed."""
    same: Callable[[Any], str | None]
    stream: Callable[[Any], str | None]
    version: Callable[[Any], str | None]
    found_otherwise: Callable[[Any], FoundOtherwise | None] | None = None


def undeclared(payload: Any) -> None:
    """A part of a `Placement` its sender's record does not give: the receiver's own key
    (`same`), no stream, or the arrival as the version."""
    return None


class PathPlugin(Protocol):
    """A plugin registered under its path (plugins.workflow.WorkflowWebhook)."""
    path: str

    @property
    def placement(self) -> Placement: ...

    def __call__(self, ctx: EngineContext, body: Payload, tx: Transaction) -> None: ...


W = TypeVar("W", bound=type[PathPlugin])


class Registry:
    """`decode` turns a stored payload into what the plugins of this registry receive."""

    def __init__(self, what: str, decode: Callable[[str | bytes], Any] = read_json) -> None:
        self.what = what
        self.decode = decode
        self._plugins: dict[str, Plugin] = {}
        self._placements: dict[str, Placement] = {}
        self._background: set[str] = set()

    def register(self, key: str, placement: Placement,
                 background: bool = False) -> Callable[[P], P]:
        """A decorator that registers its plugin under `key` with its placement
        (ValueError if the key is taken, TypeError without a placement); `background`:
        its calls are handled after the answer is sent (`in_background`)."""
        if not isinstance(placement, Placement):
            raise TypeError(f"{self.what} {key!r}: a plugin declares its Placement")

        def decorator(plugin: P) -> P:
            if key in self._plugins:
                raise ValueError(f"two plugins for {self.what} {key!r}")
            self._plugins[key] = plugin
            self._placements[key] = placement
            if background:
                self._background.add(key)
            return plugin
        return decorator

    def get(self, key: str) -> Plugin | None:
        """The plugin registered under `key`, or None."""
        return self._plugins.get(key)

    def placement(self, key: str) -> Placement | None:
        """The placement the plugin under `key` declared, or None for no plugin."""
        return self._placements.get(key)

    def found_otherwise(self, key: str, payload: str) -> FoundOtherwise | None:
        """What finds the events stored for the fact a delivery of `key` with the stored
        `payload` brings (`Placement.found_otherwise`); None when only
        its keys find it, or its payload cannot be read (its handling says why)."""
        placement = self._placements.get(key)
        if placement is None or placement.found_otherwise is None:
            return None
        try:
            return placement.found_otherwise(self.decode(payload))
        except Exception as unreadable:
            log.warning("%s %s: matched by its keys alone (%s: %.200s)", self.what, key,
                        type(unreadable).__name__, unreadable)
            return None

    def in_background(self, key: str) -> bool:
        """Whether the plugin under `key` declared its calls handled after the answer."""
        return key in self._background

    def placed(self, key: str, payload: Any) -> Placed:
        """Where a delivery of `key` with `payload` stands (`Placement`): nothing for a
        type with no plugin (stored and ignored) or a payload its placement cannot read
        (its handling records why)."""
        placement = self._placements.get(key)
        if placement is None:
            return Placed(None, None, None)
        try:
            return Placed(placement.same(payload), placement.stream(payload),
                          placement.version(payload))
        except Exception as unreadable:
            log.warning("%s %s: not placed by its sender's record (%s: %.200s)",
                        self.what, key, type(unreadable).__name__, unreadable)
            return Placed(None, None, None)

    def orders_of(self, key: str, payload: Payload) -> tuple[OrderRef, ...]:
        """The orders the plugin for `key` reads when it handles `payload`
        (engine.transaction.OrderRef): its `orders_of(payload)`, if it has one. Nothing
        for a payload it cannot read: its handling then reads what it can, and records
        why not."""
        orders_of: OrdersOf | None = getattr(self.get(key), "orders_of", None)
        if orders_of is None:
            return ()
        try:
            return tuple(orders_of(payload))
        except Exception as unreadable:
            log.warning("%s %s: its orders not named, its handling reads them (%s: %.200s)",
                        self.what, key, type(unreadable).__name__, unreadable)
            return ()

    def keys(self) -> list[str]:
        """The keys registered, sorted."""
        return sorted(self._plugins)

    def __len__(self) -> int:
        return len(self._plugins)


workflow_webhooks = Registry("workflow webhook")
card_events = Registry("card event type")
crypto_statuses = Registry("crypto invoice status", decode=exact_json)


def card_event(event_type: str, placement: Placement,
               background: bool = False) -> Callable[[P], P]:
    """Register `handle(ctx, event, tx)` for one card-processor event type: `placement`
    says which deliveries are one fact (plugins.card), `background` that it is handled
    after the answer is sent (one that may ask Stripe, or settles orders)."""
    return card_events.register(event_type, placement, background)


def crypto_status(status: str, placement: Placement) -> Callable[[P], P]:
    """Register `handle(ctx, callback, tx)` for one crypto invoice status."""
    return crypto_statuses.register(status, placement)


def with_orders(orders_of: OrdersOf) -> Callable[[P], P]:
    """Give a plugin function its `orders_of(payload)` (`Registry.orders_of`)."""
    def decorator(plugin: P) -> P:
        setattr(plugin, "orders_of", orders_of)
        return plugin
    return decorator


def workflow_webhook(cls: W) -> W:
    """Register a `WorkflowWebhook` subclass under its `path`, placed as its class says."""
    plugin = cls()
    workflow_webhooks.register(cls.path, plugin.placement)(plugin)
    return cls
