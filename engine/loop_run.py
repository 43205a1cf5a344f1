"""A sync handler run on the loop's own thread, and what watches it meanwhile.

In a process whose loop has nothing else to do while its one query runs (a pool's
worker), `Executor.watch` set, a sync handler runs on the loop's thread: no hop to a
handler thread and back, two thread wake-ups a query. The loop is blocked meanwhile, so
the watch (a thread of its own) does what the loop would have: it hears a cancellation
and enforces the execution timeout, calling the cancel handler from its thread
(`LoopRun.stop`), and carries the cancel handler the query sets out at once.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from queryqueue.engine import events as ev
from queryqueue.engine.binary import Outcome
from queryqueue.engine.responses import QueueId

if TYPE_CHECKING:
    from queryqueue.engine.queue import QueryQueue


class LoopRunWatch(Protocol):
    """What watches a sync handler run on the loop's thread (`Executor.watch`), doing
    meanwhile what the blocked loop cannot: hearing a cancellation and calling the cancel
    handler, enforcing the execution timeout, carrying the handler's cancel handler out."""

    def begin(self, run: LoopRun) -> None:
        """`run` starts on the loop's thread now."""

    def end(self) -> None:
        """It is over: once this returns, nothing more is done to it from outside."""

    def carry_cancel_handler(self, run: LoopRun, value: Any) -> bool:
        """Record the handler's cancel handler with its item now (called from the handler,
        on whatever thread it calls from); False: this watch cannot (then it is recorded
        once the loop runs)."""


@dataclass(eq=False)
class LoopRun:
    """A sync handler running on the loop's thread, as its `LoopRunWatch` sees it."""

    queue_id: QueueId
    deadline: float  # time.monotonic() its execution timeout falls at
    stop: Callable[[bool], Outcome]  # from the watch's thread; True: timed out


def stoppable_from_a_thread(queue: QueryQueue, name: str) -> bool:
    """Whether a cancellation of this handler's query can be carried out from the watch's
    thread: its cancel handler, if any, is a plain function, and cancels are the queue's
    own (no `send_cancel_message_fn` to await)."""
    cancel = queue.cancel_handlers.get(name)
    return (cancel is None or not inspect.iscoroutinefunction(cancel)) and (
        queue.send_cancel_message_fn == queue._cancel_in_background
    )


def cancel_from_a_thread(
    queue: QueryQueue,
    definition: Mapping[str, Any],
    context: dict[str, Any],
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Call the query's cancel handler on this (the watch's) thread; a failure is logged."""
    cancel = queue.cancel_handlers.get(str(definition.get("queryHandler")))
    try:
        if cancel is not None:
            outcome = cancel(dict(definition))
            if inspect.isawaitable(outcome):  # from a plain function: the loop awaits it
                loop.call_soon_threadsafe(queue._spawn, _awaited(outcome))
    except Exception as exc:
        queue.events.emit(ev.ERROR_WHILE_CANCEL, {**context, "error": repr(exc)})


async def _awaited(awaitable: Any) -> None:
    await awaitable
