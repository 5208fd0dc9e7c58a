"""Event plugins: one module per workflow path, per card event type, per crypto status.

A module registers itself with a decorator from `plugins.registry` when it is imported;
`registries()` imports them all once. A plugin says what happens in the domain's words:
the mechanics it needs live in domain/ and engine/, which it imports; nothing below
imports a plugin (the engine finds them through the context).
"""
import importlib
import pkgutil

from plugins.registry import Registry, card_events, crypto_statuses, workflow_webhooks

_SUBPACKAGES = ("workflow", "card", "crypto")
_loaded = False


def registries() -> dict[str, Registry]:
    global _loaded
    if not _loaded:
        for subpackage in _SUBPACKAGES:
            package = importlib.import_module(f"{__name__}.{subpackage}")
            for info in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{package.__name__}.{info.name}")
        _loaded = True
    return {"workflow": workflow_webhooks, "card": card_events, "crypto": crypto_statuses}
