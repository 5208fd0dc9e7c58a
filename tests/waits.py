"""Waiting on the thing awaited, not on the clock: the suite's one wait."""
import asyncio
import time
from typing import Callable


async def eventually(condition: Callable[[], object], timeout: float = 20,
                     interval: float = 0.1) -> None:
    """Return once `condition()` is true, checking every `interval` seconds; fail the
    test when it is still false after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)
