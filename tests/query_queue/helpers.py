"""What the QueryQueue tests share: a recorder of what handlers saw, and conditions on a
queue's items to wait for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from queryqueue import QueryQueue
from queryqueue.engine.responses import ListResponse
from tests.waiting import wait_until

PREFIX = "tq"


MakeQueue = Callable[..., QueryQueue]


class Recorder:
    """Handlers and cancel handlers that record what happened."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.running = 0
        self.max_running = 0
        self.cancelled: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.events: list[tuple[str, dict[str, Any]]] = []

    async def gated(self, query: Any, set_cancel_handler: Callable[[Any], None]) -> Any:
        self.calls.append(query)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        set_cancel_handler({"kill": query})
        try:
            await self.gate.wait()
            return {"echo": query}
        finally:
            self.running -= 1

    async def instant(self, query: Any, set_cancel_handler: Callable[[Any], None]) -> Any:
        self.calls.append(query)
        return {"echo": query}

    async def cancel(self, query_def: dict[str, Any]) -> None:
        self.cancelled.append(query_def)

    def log(self, message: str, fields: dict[str, Any]) -> None:
        self.events.append((message, fields))

    def named(self, message: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.events if name == message]


async def wait_pending(queue: QueryQueue, count: int) -> None:
    await wait_until(lambda: pending_count(queue, count))


async def active_keys(queue: QueryQueue) -> bool:
    return bool(await queue.driver.active(PREFIX))


async def pending_count(queue: QueryQueue, expected: int) -> bool:
    return len(await queue.driver.pending(PREFIX)) == expected


async def items_of(queue: QueryQueue) -> list[ListResponse]:
    return await queue.driver.list_items(PREFIX, process_id=queue.process_uid)


async def statuses_of(queue: QueryQueue) -> list[str]:
    return [row.status for row in await items_of(queue)]


async def empty(queue: QueryQueue) -> bool:
    return not await items_of(queue)
