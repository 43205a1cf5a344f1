"""The supervisor pool's step of the reconcile as one command: PENDING's head, then
RETRIEVE per free slot, in one transaction. A base of `QueueStore` (one algorithm over
the store's transaction hooks, as every command), not a QUEUE command of Cube's."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from queryqueue.engine import validation as v
from queryqueue.engine.clock import Clock
from queryqueue.engine.commands import queue_command
from queryqueue.engine.hashing import may_run_in
from queryqueue.engine.records import StoreTransaction, with_start_query_time
from queryqueue.engine.responses import NextRetrieved

T = TypeVar("T")


class RetrieveNext(ABC):
    clock: Clock

    @abstractmethod
    def _atomic(self) -> AbstractContextManager[StoreTransaction]: ...

    @abstractmethod
    def _run_command(self, run: Callable[[], T]) -> T: ...

    @queue_command(served=False)
    def retrieve_next(
        self,
        prefix: str,
        *,
        concurrency: int,
        process_id: str,
        start_query_time: int | None = None,
        min_priority: int | None = None,
        limit: int | None = None,
    ) -> list[NextRetrieved]:
        """The reconcile's PENDING then RETRIEVE per slot, as one command (not a QUEUE
        command: a supervisor runs it for its pool in the batch that freed a slot or added
        work). The head of PENDING as `process_id` sees it (at most `concurrency` rows,
        priority desc, then queue id; a store shared by hosts may put its own host's
        first: `pool_head`), each item moved to active in that order while the
        prefix has fewer than `concurrency` active, skipping the persistent keys of other
        processes (`may_run_in`); `start_query_time` as RETRIEVE's. A prefix with no slot or
        nothing pending costs one read. `min_priority`: none below it (the head stops there).
        `limit`: at most this many (what the caller can start now), whatever the budget."""
        v.check_prefix(prefix)
        v.check_concurrency(concurrency)
        v.check_process_id(process_id)
        v.check_non_negative_ms("start_query_time", start_query_time, nullable=True)
        if min_priority is not None:
            v.check_priority(min_priority)
        if limit is not None:
            v.check_count("limit", limit)
        now = self.clock.now_ms()
        found: list[NextRetrieved] = []
        with self._atomic() as tx:
            pending, active = tx.counts(prefix)
            if active >= concurrency or pending == 0:
                return found
            head = tx.pool_head(prefix, process_id, concurrency)
            for item in head:
                if active >= concurrency or (limit is not None and len(found) >= limit):
                    break
                if min_priority is not None and item.priority < min_priority:
                    break
                if item.payload is None or not may_run_in(item.key, process_id):
                    continue
                tx.activate(item, now, with_start_query_time(item.extra, start_query_time))
                active, pending = active + 1, pending - 1
                found.append(NextRetrieved(item.key, item.id, item.payload, item.extra, pending))
        return found
