"""How much request body the process holds at once, per client address and in all.

A body is held in memory until it is complete (a signature covers all of it). Without a
cap, 500 connections each sending 1 MiB took the process from 56 MB to 537 MB, and the
memory stayed. Bodies that would take a client, or everyone together, past the cap are
refused while they come in; what a request held is given back when it ends.

A call whose headers carry valid credentials (the workflow secret, the crypto API key)
is counted in the total only: another client at the same address, sending unsigned
bytes, must not get the senders refused.
"""
import collections
from typing import Literal

from settings import Settings


class BodyBudget:
    def __init__(self, total_bytes: int, per_client_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.per_client_bytes = per_client_bytes
        self.held = 0
        self.by_client: collections.Counter[str] = collections.Counter()

    @classmethod
    def from_settings(cls, settings: Settings) -> "BodyBudget":
        return cls(settings.body_buffer_total_bytes, settings.body_buffer_per_client_bytes)

    def take(self, client: str, size: int,
             per_client: bool = True) -> Literal["client", "total"] | None:
        """Hold `size` more bytes for `client`; returns None when allowed, else why not:
        "client" (this address holds its share) or "total" (the process holds its).
        Without `per_client`, the bytes count in the total only."""
        if per_client and self.by_client[client] + size > self.per_client_bytes:
            return "client"
        if self.held + size > self.total_bytes:
            return "total"
        if per_client:
            self.by_client[client] += size
        self.held += size
        return None

    def give_back(self, client: str, size: int, per_client: bool = True) -> None:
        if not size:
            return
        self.held -= size
        if not per_client:
            return
        self.by_client[client] -= size
        if self.by_client[client] <= 0:
            del self.by_client[client]
