"""What a handler asks of the context it is given (app.context.Context, above the
handlers): the engine's context, and the allowances and parts the handlers keep."""
from typing import Protocol

from engine.contracts import EngineContext
from handlers.budget import BodyBudget
from ops.metrics import Metrics


class Allowance(Protocol):
    """A per-client allowance (handlers.ratelimit.RateLimiter)."""

    def acquire(self, client: str) -> int:
        """0 when `client` may go on now, else the seconds it is to wait."""
        ...


class HandlerContext(EngineContext, Protocol):
    metrics: Metrics
    # The request bodies held in memory (handlers.budget).
    bodies: BodyBudget

    # Read only, so that a context may hold a narrower kind (app.context.Context: a
    # RateLimiter).
    @property
    def auth_failures(self) -> Allowance:
        """Failed authentications per client address (handlers.base.ApiHandler)."""
        ...
