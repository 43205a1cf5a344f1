"""Wait on a condition with a deadline: the only way tests wait."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


async def wait_until(condition: Callable[[], object], within: float = 10.0, what: str = "") -> None:
    """`condition` may return a value or an awaitable of one."""
    deadline = time.monotonic() + within
    while not await _value(condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {within}s: {what or condition}")
        await asyncio.sleep(0.002)


async def _value(outcome: object) -> object:
    if inspect.isawaitable(outcome):
        return await outcome
    return outcome


def wait_until_sync(condition: Callable[[], object], within: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {within}s: {what or condition}")
        time.sleep(0.005)
