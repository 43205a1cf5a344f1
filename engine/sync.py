"""A sync face for callers without an event loop (Flask, Django, a thread): the same
QueryQueue, run on a private loop in a background thread. Each call blocks until the
coroutine on that loop returns; any number of threads may call at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from queryqueue.engine.queue import QueryQueue

T = TypeVar("T")


class SyncQueryQueue:
    """`SyncQueryQueue(prefix, **options)` takes `QueryQueue`'s arguments; `make=` instead
    builds the queue on the private loop (a driver bound to that loop, a pool's queue)."""

    def __init__(
        self,
        prefix: str | None = None,
        *,
        make: Callable[[], QueryQueue] | None = None,
        **options: Any,
    ) -> None:
        if (prefix is None) == (make is None):
            raise ValueError("SyncQueryQueue takes a prefix (and QueryQueue's options) or make=")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"queryqueue-{prefix or 'sync'}", daemon=True
        )
        self._thread.start()
        self._closed = False
        self._owns_driver = make is not None  # made on the private loop: closed with it

        async def build() -> QueryQueue:
            return make() if make is not None else QueryQueue(str(prefix), **options)

        self.queue: QueryQueue = self._call(build())

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coroutine.close()
            raise RuntimeError("this SyncQueryQueue is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def run(
        self,
        query_handler: str,
        query_key: Any,
        query: Any,
        *,
        priority: int = 0,
        timeout: float | None = None,
        request_id: str | None = None,
        execution_timeout: float | None = None,
        max_age: float | None = None,
    ) -> Any:
        """`QueryQueue.run`, blocking: the result, or its error."""
        return self._call(
            self.queue.run(
                query_handler,
                query_key,
                query,
                priority=priority,
                timeout=timeout,
                request_id=request_id,
                execution_timeout=execution_timeout,
                max_age=max_age,
            )
        )

    def execute_in_queue(
        self, query_handler: str, query_key: Any, query: Any, priority: int = 0, **options: Any
    ) -> Any:
        """`QueryQueue.execute_in_queue`, blocking."""
        return self._call(
            self.queue.execute_in_queue(query_handler, query_key, query, priority, **options)
        )

    def reconcile_queue(self) -> None:
        """`QueryQueue.reconcile_queue`, blocking."""
        self._call(self.queue.reconcile_queue())

    def cancel_query(self, query_key_hash: str, queue_id: int | None = None) -> bool:
        """`QueryQueue.cancel_query`, blocking."""
        return self._call(self.queue.cancel_query(query_key_hash, queue_id))

    def cancel_query_by_request_id(self, request_id: str) -> list[dict[str, Any]]:
        """`QueryQueue.cancel_query_by_request_id`, blocking."""
        return self._call(self.queue.cancel_query_by_request_id(request_id))

    def get_queries(self) -> list[dict[str, Any]]:
        """`QueryQueue.get_queries`, blocking."""
        return self._call(self.queue.get_queries())

    def get_query_stage(self, stage_query_key: Any, priority_filter: int | None = None) -> Any:
        """`QueryQueue.get_query_stage`, blocking."""
        return self._call(self.queue.get_query_stage(stage_query_key, priority_filter))

    def close(self) -> None:
        """Close the queue and stop its loop's thread."""
        if self._closed:
            return
        self._call(self.queue.close())
        if self._owns_driver:
            self._call(self.queue.driver.close())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.run_until_complete(self._loop.shutdown_default_executor())
        self._loop.close()

    def __enter__(self) -> SyncQueryQueue:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
