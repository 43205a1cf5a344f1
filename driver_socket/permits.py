"""How many long polls this client has at its supervisor at once.

The supervisor parks at most so many RESULT_BLOCKING long polls per connection (`hello`
says how many) and refuses the next one. A process waiting on more queries than that (an
asyncio service with tens of thousands of calls in flight) holds the rest here, each
taking a permit as one comes back: its callers wait a little longer, none fails.
"""

from __future__ import annotations

import asyncio
from collections import deque

DEFAULT_LIMIT = 1024  # the supervisor's default, until its hello says


class PollPermits:
    """Permits for long polls at the supervisor, first come first served."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self.out = 0  # polls sent and not yet answered
        self._waiting: deque[asyncio.Future[None]] = deque()

    def set_limit(self, limit: int) -> None:
        """The supervisor's limit, as its hello said."""
        self.limit = max(1, limit)
        self._wake()

    def try_take(self) -> bool:
        """A permit now, if one is free and nobody waits for one before this caller."""
        if self.out < self.limit and not self._waiting:
            self.out += 1
            return True
        return False

    async def take(self) -> None:
        """A permit, once one is free (in the order asked)."""
        if self.try_take():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give()  # granted as it was cancelled: pass it on
            else:
                self._waiting.remove(waiter)
            raise

    def give(self) -> None:
        """A poll was answered (or never sent): its permit goes to the next waiting."""
        self.out -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self.out < self.limit:
            waiter = self._waiting.popleft()
            if not waiter.done():
                self.out += 1
                waiter.set_result(None)
