"""Time as an injected dependency.

Every timestamp in the queue is an integer number of milliseconds taken from a `Clock`,
so tests move time forward instead of sleeping.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Wall-clock time in integer milliseconds since the epoch."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait until this clock has moved `seconds` on (loops that beat, like the
        heartbeat, wait on the clock, so a test steps them by moving it)."""
        ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class ManualClock:
    """A clock that only moves when told to (tests): its sleepers wake as it is advanced."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._sleepers: list[tuple[int, asyncio.Future[None]]] = []

    def now_ms(self) -> int:
        return self._now

    async def sleep(self, seconds: float) -> None:
        wake = asyncio.get_running_loop().create_future()
        self._sleepers.append((self._now + round(seconds * 1000), wake))
        await wake

    @property
    def sleepers(self) -> int:
        """Loops waiting on this clock now (a test waits for them before moving it)."""
        return sum(1 for _, wake in self._sleepers if not wake.done())

    def advance(self, ms: int) -> None:
        if ms < 0:
            raise ValueError("a clock does not go back")
        self.set(self._now + ms)

    def set(self, now_ms: int) -> None:
        self._now = now_ms
        due = [wake for at, wake in self._sleepers if at <= now_ms]
        self._sleepers = [(at, wake) for at, wake in self._sleepers if at > now_ms]
        for wake in due:
            if not wake.done():
                wake.set_result(None)
