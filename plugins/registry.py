"""The decorator-based registry that maps an event's name to its plugin.

A plugin is `handle(ctx, payload, tx)` (or an object called so, a `WorkflowWebhook`),
plain or async: it handles one stored event's payload in the transaction `tx`."""
import logging
from typing import Any, Awaitable, Callable, Iterable, Protocol, TypeVar

from engine.contracts import EngineContext
from engine.payload import exact_json, read_json
from engine.transaction import OrderRef, Transaction

log = logging.getLogger("receiver.plugins")

Payload = dict[str, Any]
Plugin = Callable[[EngineContext, Payload, Transaction], Awaitable[None] | None]
OrdersOf = Callable[[Payload], Iterable[OrderRef]]
P = TypeVar("P", bound=Plugin)


class PathPlugin(Protocol):
    """A plugin registered under its path (plugins.workflow.WorkflowWebhook)."""
    path: str

    def __call__(self, ctx: EngineContext, body: Payload, tx: Transaction) -> None: ...


W = TypeVar("W", bound=type[PathPlugin])


class Registry:
    """`decode` turns a stored payload into what the plugins of this registry receive."""

    def __init__(self, what: str, decode: Callable[[str | bytes], Any] = read_json) -> None:
        self.what = what
        self.decode = decode
        self._plugins: dict[str, Plugin] = {}

    def register(self, key: str) -> Callable[[P], P]:
        """A decorator that registers its plugin under `key` (ValueError if taken)."""
        def decorator(plugin: P) -> P:
            if key in self._plugins:
                raise ValueError(f"two plugins for {self.what} {key!r}")
            self._plugins[key] = plugin
            return plugin
        return decorator

    def get(self, key: str) -> Plugin | None:
        """The plugin registered under `key`, or None."""
        return self._plugins.get(key)

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


def card_event(event_type: str) -> Callable[[P], P]:
    """Register `handle(ctx, event, tx)` for one card-processor event type."""
    return card_events.register(event_type)


def crypto_status(status: str) -> Callable[[P], P]:
    """Register `handle(ctx, callback, tx)` for one crypto invoice status."""
    return crypto_statuses.register(status)


def with_orders(orders_of: OrdersOf) -> Callable[[P], P]:
    """Give a plugin function its `orders_of(payload)` (`Registry.orders_of`)."""
    def decorator(plugin: P) -> P:
        setattr(plugin, "orders_of", orders_of)
        return plugin
    return decorator


def workflow_webhook(cls: W) -> W:
    """Register a `WorkflowWebhook` subclass under its `path`."""
    workflow_webhooks.register(cls.path)(cls())
    return cls
