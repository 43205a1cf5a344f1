"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
import threading
from typing import TypeVar

T = TypeVar("T")


async def wait_within(future: asyncio.Future[T], seconds: float | None) -> T:
    """The future's result if it is done within `seconds`, else TimeoutError.

    The future is left running on timeout (no cancellation), and — unlike
    `asyncio.wait_for` on Python 3.11 — a cancellation of the caller that coincides with
    the future completing is never swallowed: a starved event loop that wakes to both at
    once made a cancelled heartbeat loop run forever.
    """
    if future.done():  # a sync handler's outcome waited for on the spot (threads.py)
        return future.result()
    done, _ = await asyncio.wait({future}, timeout=seconds)
    if not done:
        raise TimeoutError
    return future.result()


def runs_here(loop: asyncio.AbstractEventLoop | None, thread: int | None) -> bool:
    """Whether `loop`, made or adopted on `thread`, is this thread's running loop: it runs
    and this is its thread (a thread runs one loop at a time). Asked without asyncio,
    whose `get_running_loop()` costs a getpid() system call on 3.11, several a query on
    the hot paths that ask."""
    return loop is not None and thread == threading.get_ident() and loop.is_running()
