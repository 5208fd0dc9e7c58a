"""The decorator-based registry that maps an event's name to its plugin."""
import logging

from engine.payload import exact_json, read_json

log = logging.getLogger("receiver.plugins")


class Registry:
    """`decode` turns a stored payload into what the plugins of this registry receive."""

    def __init__(self, what, decode=read_json):
        self.what = what
        self.decode = decode
        self._plugins = {}

    def register(self, key):
        def decorator(plugin):
            if key in self._plugins:
                raise ValueError(f"two plugins for {self.what} {key!r}")
            self._plugins[key] = plugin
            return plugin
        return decorator

    def get(self, key):
        return self._plugins.get(key)

    def orders_of(self, key, payload):
        """The orders the plugin for `key` reads when it handles `payload`
        (engine.transaction.OrderRef): its `orders_of(payload)`, if it has one. Nothing
        for a payload it cannot read: its handling then reads what it can, and records
        why not."""
        orders_of = getattr(self.get(key), "orders_of", None)
        if orders_of is None:
            return ()
        try:
            return tuple(orders_of(payload))
        except Exception as unreadable:
            log.warning("%s %s: its orders not named, its handling reads them (%s: %.200s)",
                        self.what, key, type(unreadable).__name__, unreadable)
            return ()

    def keys(self):
        return sorted(self._plugins)

    def __len__(self):
        return len(self._plugins)


workflow_webhooks = Registry("workflow webhook")
card_events = Registry("card event type")
crypto_statuses = Registry("crypto invoice status", decode=exact_json)


def card_event(event_type):
    """Register `handle(ctx, event, effects)` for one card-processor event type."""
    return card_events.register(event_type)


def crypto_status(status):
    """Register `handle(ctx, callback, effects)` for one crypto invoice status."""
    return crypto_statuses.register(status)


def with_orders(orders_of):
    """Give a plugin function its `orders_of(payload)` (`Registry.orders_of`)."""
    def decorator(plugin):
        plugin.orders_of = orders_of
        return plugin
    return decorator


def workflow_webhook(cls):
    """Register a `WorkflowWebhook` subclass under its `path`."""
    workflow_webhooks.register(cls.path)(cls())
    return cls
