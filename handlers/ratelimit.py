"""A per-client-IP limit for the public endpoints, so codes, e-mails and order numbers
cannot be enumerated.

A token bucket per client address: `limit` requests, refilled evenly over `window`
seconds. The buckets live in this process's memory, which is right for the service as
deployed (one process); several processes would each allow `limit`.
"""
import math
import time
from typing import Callable, NoReturn

import tornado.web

from handlers.addresses import client_key, peer_address
from handlers.context import HandlerContext
from settings import Settings

# Past this many addresses, buckets that have refilled completely are dropped: a full
# bucket is the same as no bucket, so forgetting it changes nothing.
PRUNE_ABOVE = 10_000


class RateLimiter:
    def __init__(self, limit: int, window_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window = window_seconds
        self.clock = clock
        # {client: (tokens left, when they were counted)}
        self.buckets: dict[str, tuple[float, float]] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> "RateLimiter":
        return cls(settings.public_rate_limit, settings.public_rate_window_seconds)

    @property
    def refill_per_second(self) -> float:
        return self.limit / self.window

    def acquire(self, client: str) -> int:
        """Take one request for `client`; return 0 when allowed, else the whole seconds to
        wait before the next request is allowed (for Retry-After)."""
        if self.limit <= 0:
            return 0
        now = self.clock()
        tokens = self.tokens_at(client, now)
        if tokens >= 1:
            self.buckets[client] = (tokens - 1, now)
            self.prune(now)
            return 0
        self.buckets[client] = (tokens, now)
        return max(1, math.ceil((1 - tokens) / self.refill_per_second))

    def give_back(self, client: str) -> None:
        """Return a request taken by `acquire` (it did not count after all)."""
        if self.limit <= 0:
            return
        now = self.clock()
        self.buckets[client] = (min(self.limit, self.tokens_at(client, now) + 1), now)

    def tokens_at(self, client: str, now: float) -> float:
        tokens, since = self.buckets.get(client, (self.limit, now))
        return min(self.limit, tokens + (now - since) * self.refill_per_second)

    def prune(self, now: float) -> None:
        if len(self.buckets) <= PRUNE_ABOVE:
            return
        self.buckets = {client: state for client, state in self.buckets.items()
                        if self.tokens_at(client, now) < self.limit}


class RateLimited(tornado.web.RequestHandler):
    """A RequestHandler mixin: refuses a client over its allowance with 429 and
    Retry-After, before any work. The handler says how (`refuse_too_many`): a JSON error
    or an HTML page.

    The client is `request.remote_ip` (the proxy's word for it only from TRUSTED_PROXIES),
    an IPv6 address by its /64 (handlers.addresses)."""

    def initialize(self, ctx: HandlerContext, limiter: RateLimiter) -> None:
        super().initialize(ctx)
        self.limiter = limiter

    def refuse_too_many(self) -> NoReturn:
        """Answer 429 and stop handling the request."""
        raise NotImplementedError

    def prepare(self) -> None:
        wait = self.limiter.acquire(client_key(peer_address(self.request)))
        if wait:
            self.set_header("Retry-After", str(wait))
            self.refuse_too_many()
        super().prepare()


class LoginThrottle:
    """The console's password checks: each costs about 0.1 s of scrypt, so a flood of
    guesses is a flood of CPU (88 tries at 6.6/s took a webhook's p99 from 19 to
    1,205 ms).

    - In all, at most `total` wrong passwords per `window` are checked, from whatever
      addresses: past that, every try is refused (429) unchecked until the budget refills.
      A try takes its place in the budget before it is checked (so concurrent tries
      cannot overdraw it) and gives it back if the password was right.
    - Per address (an IPv6 one by its /64), past `per_address` wrong passwords per
      `window`, a wrong one is answered 429 instead of "wrong password", as a wrong
      webhook secret is. A right one still logs in: whoever shares the operator's
      address (every local process, behind a proxy not in TRUSTED_PROXIES) cannot lock
      the operator out by failing.
    - A browser that has logged in before (`known`: the console's signed cookie for it)
      has a budget of its own, `per_address` tries per `window`, a right one given back,
      and spends none of the total: a crowd of strangers spending the total cannot lock
      out an operator's browser, and a copied cookie buys a guesser a handful of tries."""

    ALL = "all"

    def __init__(self, per_address: int, total: int, window_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.addresses = RateLimiter(per_address, window_seconds, clock)
        self.total = RateLimiter(total, window_seconds, clock)
        self.browsers = RateLimiter(per_address, window_seconds, clock)

    def take_a_check(self, known: str | None = None) -> int:
        """0 when a password may be checked now (its place in the budget taken: the
        known browser's own, else the total), else the seconds to wait."""
        if known is not None:
            return self.browsers.acquire(known)
        return self.total.acquire(self.ALL)

    def right(self, known: str | None = None) -> None:
        """The password checked was right: its place in the budget is given back."""
        if known is not None:
            self.browsers.give_back(known)
        else:
            self.total.give_back(self.ALL)

    def wrong(self, client: str, known: str | None = None) -> int:
        """The password checked was wrong: 0, or the seconds `client` is to wait (it is
        past its own allowance). A known browser's try was counted when it was taken."""
        if known is not None:
            return 0
        return self.addresses.acquire(client)
