"""What a worker process runs as it starts and as it stops: the place for what a process
opens once and its queries share (a connection pool, a client, a model).

    @app.on_worker_start
    async def open_pool() -> None:
        app.state.pool = AsyncConnectionPool(DSN, open=False)
        await app.state.pool.open()

Start hooks run in the order registered, before the worker takes a query; one that raises
ends the worker (the pool logs it and starts another). Stop hooks run in reverse order
once its last query has ended; one that raises is logged and the others still run.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable

Hook = Callable[[], None] | Callable[[], Awaitable[None]]

_log = logging.getLogger("queryqueue.worker")


class WorkerHooks:
    """The start and stop hooks of an app's worker processes."""

    def __init__(self) -> None:
        self.on_start: list[Hook] = []
        self.on_stop: list[Hook] = []

    async def started(self) -> None:
        """Run every start hook, in order: the first to raise ends the start."""
        for hook in self.on_start:
            await _call(hook)

    async def stopped(self) -> None:
        """Run every stop hook, last registered first; a failing one is logged."""
        for hook in reversed(self.on_stop):
            try:
                await _call(hook)
            except Exception:
                _log.exception("worker stop hook %s failed", getattr(hook, "__name__", hook))


def checked(hook: Hook) -> Hook:
    """`hook` if it takes no argument; else a TypeError naming it."""
    try:
        inspect.signature(hook).bind()
    except TypeError:
        raise TypeError(
            f"a worker hook takes no argument: {getattr(hook, '__name__', hook)!r}"
            f" takes {inspect.signature(hook)}"
        ) from None
    return hook


async def _call(hook: Hook) -> None:
    value = hook()
    if inspect.isawaitable(value):
        await value
