"""Client: ask a supervisor's queues for results by name, without their handlers' code.

    from queryqueue import Client

    client = Client("/run/queryqueue/supervisor.sock")
    rows = await client.run("warehouse", "sql", {"sql": "SELECT 1"})

A web process need not import what a worker needs to run a query (a warehouse driver,
pyarrow, duckdb): the supervisor's pool runs it, with the budget and timeouts the
supervisor's app sets, whatever the caller says. A queue or a handler the supervisor does
not serve is refused at once (`UnknownQueueError`, `UnknownHandlerError`).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from pathlib import Path
from typing import Any

from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.engine.codec import Codecs
from queryqueue.engine.queue import QueryQueue
from queryqueue.engine.sync import SyncQueryQueue


class Client:
    """A supervisor's queues by name, for a process that asks and never runs queries."""

    def __init__(
        self, socket_path: str | Path | None = None, *, codecs: Codecs | None = None
    ) -> None:
        """`socket_path`: the supervisor's socket (None: $QUERYQUEUE_SOCKET, then the
        default path). `codecs`: the result types registered beyond the built-in ones
        (an app's `codecs`), to decode results that hold them."""
        self.socket_path = socket_path
        self.codecs = codecs or Codecs()
        # Per process and event loop, one queue a name; weak keys: a closed loop's go.
        self._queues: dict[
            int, weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, QueryQueue]]
        ] = {}
        self._sync: dict[tuple[int, str], SyncQueryQueue] = {}

    def queue(self, name: str) -> QueryQueue:
        """This event loop's queue `name` on the supervisor (made on first use)."""
        by_loop = self._queues.setdefault(os.getpid(), weakref.WeakKeyDictionary())
        queues = by_loop.setdefault(asyncio.get_running_loop(), {})
        queue = queues.get(name)
        if queue is None:
            queue = queues[name] = self._make(name)
        return queue

    def _make(self, name: str) -> QueryQueue:
        # The supervisor reconciles for its pool: this process hands every query over.
        driver = SocketQueueDriver(self.socket_path, decode_in_place=True)
        return QueryQueue(
            name, query_handlers={}, driver=driver, reconcile=False, codecs=self.codecs
        )

    async def run(
        self,
        queue: str,
        query_handler: str,
        query: Any,
        *,
        key: Any = None,
        priority: int = 0,
        timeout: float | None = None,  # noqa: ASYNC109 - the caller's deadline, as app.run's
        request_id: str | None = None,
        execution_timeout: float | None = None,
        max_age: float | None = None,
    ) -> Any:
        """Run `query_handler` of `queue` on `query` in the supervisor's pool (or join an
        identical one in flight) and return its result. `key`: what makes two calls the
        same query (None: the query itself); `execution_timeout` and `max_age` as
        `QueueApp.run`'s."""
        return await self.queue(queue).run(
            query_handler, query if key is None else key, query,
            priority=priority, timeout=timeout, request_id=request_id,
            execution_timeout=execution_timeout, max_age=max_age,
        )  # fmt: skip

    def run_sync(
        self,
        queue: str,
        query_handler: str,
        query: Any,
        *,
        key: Any = None,
        priority: int = 0,
        timeout: float | None = None,
        request_id: str | None = None,
        execution_timeout: float | None = None,
        max_age: float | None = None,
    ) -> Any:
        """`run` for code without an event loop (a Flask or Django view, a thread)."""
        face = self._sync.get((os.getpid(), queue))
        if face is None:
            face = self._sync[(os.getpid(), queue)] = SyncQueryQueue(make=lambda: self._make(queue))
        return face.run(
            query_handler, query if key is None else key, query,
            priority=priority, timeout=timeout, request_id=request_id,
            execution_timeout=execution_timeout, max_age=max_age,
        )  # fmt: skip

    async def aclose(self) -> None:
        """Close this event loop's queues and their connections."""
        by_loop = self._queues.get(os.getpid())
        queues = by_loop.pop(asyncio.get_running_loop(), {}) if by_loop is not None else {}
        for queue in queues.values():
            await queue.close(grace=0)
            await queue.driver.close()

    def close(self) -> None:
        """Stop this process's sync faces, if any were made."""
        for key in [key for key in self._sync if key[0] == os.getpid()]:
            self._sync.pop(key).close()
