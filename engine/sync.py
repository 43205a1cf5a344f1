"""A sync face for callers without an event loop: the same QueryQueue, run on a private
loop in a background thread. Each call blocks until the coroutine on that loop returns."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from queryqueue.engine.queue import QueryQueue

T = TypeVar("T")


class SyncQueryQueue:
    def __init__(self, prefix: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"queryqueue-{prefix}", daemon=True
        )
        self._thread.start()
        self.queue = QueryQueue(prefix, **options)
        self._closed = False

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coroutine.close()
            raise RuntimeError("this SyncQueryQueue is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def execute_in_queue(
        self, query_handler: str, query_key: Any, query: Any, priority: int = 0, **options: Any
    ) -> Any:
        return self._call(
            self.queue.execute_in_queue(query_handler, query_key, query, priority, **options)
        )

    def reconcile_queue(self) -> None:
        self._call(self.queue.reconcile_queue())

    def cancel_query(self, query_key_hash: str, queue_id: int | None = None) -> bool:
        return self._call(self.queue.cancel_query(query_key_hash, queue_id))

    def get_queries(self) -> list[dict[str, Any]]:
        return self._call(self.queue.get_queries())

    def get_query_stage(self, stage_query_key: Any, priority_filter: int | None = None) -> Any:
        return self._call(self.queue.get_query_stage(stage_query_key, priority_filter))

    def close(self) -> None:
        if self._closed:
            return
        self._call(self.queue.shutdown())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.run_until_complete(self._loop.shutdown_default_executor())
        self._loop.close()

    def __enter__(self) -> SyncQueryQueue:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
