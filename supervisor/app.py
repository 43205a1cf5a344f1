"""QueueApp: the queue's definition, written once and imported by every process.

    app = QueueApp("sql", concurrency=4)

    @app.handler("sql")
    def run_sql(query, set_cancel_handler): ...

The supervisor loads it (`--app pkg.module:app`) to run handlers in its worker pool;
request processes call `await app.execute_in_queue(...)` against the same supervisor.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from queryqueue.engine.driver import QueueDriver
from queryqueue.engine.handlers import (
    CancelHandler,
    QueryHandler,
    SendProcessMessage,
    StreamHandler,
)
from queryqueue.engine.queue import QueryQueue
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.store import QueueStore
from queryqueue.supervisor.client import SocketQueueDriver

F = TypeVar("F", bound=Callable[..., Any])


class QueueApp:
    def __init__(self, prefix: str, **queue_options: Any) -> None:
        self.prefix = prefix
        self.queue_options = queue_options
        self.query_handlers: dict[str, QueryHandler] = {}
        self.cancel_handlers: dict[str, CancelHandler] = {}
        self.stream_handler: StreamHandler | None = None
        # One client queue per process and event loop, made on first use. Weak keys: a
        # closed loop's queue goes with it (an id() key could be reused by the next loop).
        self._queues: dict[int, weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, QueryQueue]]
        self._queues = {}
        self.socket_path: Path | None = None  # None: $QUERYQUEUE_SOCKET, then the default

    def handler(self, name: str) -> Callable[[F], F]:
        def register(function: F) -> F:
            self.query_handlers[name] = function
            return function

        return register

    def cancel_handler(self, name: str) -> Callable[[F], F]:
        def register(function: F) -> F:
            self.cancel_handlers[name] = function
            return function

        return register

    def stream(self, function: F) -> F:
        self.stream_handler = function
        return function

    def make_queue(
        self,
        driver: QueueDriver | QueueStore | None,
        *,
        send_process_message_fn: SendProcessMessage | None = None,
        **overrides: Any,
    ) -> QueryQueue:
        options = {**self.queue_options, **overrides}
        return QueryQueue(
            self.prefix,
            query_handlers=self.query_handlers,
            cancel_handlers=self.cancel_handlers,
            stream_handler=self.stream_handler,
            driver=driver,
            send_process_message_fn=send_process_message_fn,
            **options,
        )

    def pool_queue(self, driver: SocketQueueDriver, **overrides: Any) -> QueryQueue:
        """A queue on the supervisor whose executions are handed to its worker pool.

        The supervisor reconciles for its pool (after every ADD and ACK, in process, next
        to the store), so this process reconciles only for its own stream items."""
        dispatch = PoolDispatch(driver)
        overrides.setdefault("reconcile", False)
        queue = self.make_queue(driver, send_process_message_fn=dispatch, **overrides)
        dispatch.queue = queue
        return queue

    def client_queue(self) -> QueryQueue:
        """This process's queue on the supervisor, with executions handed to its pool."""
        queues = self._queues.setdefault(os.getpid(), weakref.WeakKeyDictionary())
        loop = asyncio.get_running_loop()
        queue = queues.get(loop)
        if queue is None:
            queue = queues[loop] = self.pool_queue(SocketQueueDriver(self.socket_path))
        return queue

    async def execute_in_queue(
        self, query_handler: str, query_key: Any, query: Any, priority: int = 0, **options: Any
    ) -> Any:
        return await self.client_queue().execute_in_queue(
            query_handler, query_key, query, priority, **options
        )


def load_app(reference: str) -> QueueApp:
    """`pkg.module:attribute` → the QueueApp it names."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"an app reference looks like pkg.module:app, got {reference!r}")
    app = getattr(importlib.import_module(module_name), attribute, None)
    if not isinstance(app, QueueApp):
        raise ValueError(f"{reference} is not a QueueApp")
    return app


class PoolDispatch:
    """`send_process_message_fn` for processes whose queries run in the supervisor's pool.

    Resolves once the supervisor has accepted the hand-off. Stream queries never leave this
    process: their stream lives here, so they run here.
    """

    def __init__(self, driver: SocketQueueDriver) -> None:
        self.driver = driver
        self.queue: QueryQueue | None = None  # the queue that retrieves: set by pool_queue

    async def __call__(self, retrieved: RetrievedQuery) -> None:
        if retrieved.persistent and self.queue is not None:
            self.queue._spawn(self.queue.execute_query(retrieved))
            return
        await self.driver.dispatch(retrieved)
