"""The driver interface: the QUEUE command set, awaited.

`QueueDriver` is what `QueryQueue` talks to and the one thing that changes between
deployments: `LocalQueueDriver` runs the commands on a store in this process (memory for
development and tests, SQLite for a single process); the supervisor's socket client sends
them to the process that owns the store. Signatures and semantics are those of
`engine.store.QueueStore`, where each command is documented; every call is atomic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from queryqueue.engine.binary import BinaryResult, Outcome
from queryqueue.engine.memory_store import MemoryQueueStore
from queryqueue.engine.responses import (
    AckResponse,
    AddAndRetrieveResponse,
    AddToQueueResponse,
    ListResponse,
    QueryDefResponse,
    QueueKey,
    ResultResponse,
    RetrieveResponse,
    ToCancelResponse,
)
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.store import QueueStore


class QueueDriver(Protocol):
    """Cube Store's QUEUE commands. See `QueueStore` for each command's contract."""

    async def add(
        self,
        path: str,
        payload: str,
        *,
        priority: int = 0,
        orphaned: float | None = None,
        external_id: str | None = None,
        exclusive: bool = False,
        process_id: str | None = None,
        if_no_result: bool = False,
        max_age_ms: int | None = None,
        then_wait_ms: int | None = None,
    ) -> AddToQueueResponse:
        """`max_age_ms` (with `if_no_result`): a result of the path younger than that
        answers too, read before or not. `then_wait_ms`: the caller will RESULT_BLOCKING
        the answered id for this long next; a driver may send that with the ADD (one
        write) and answer the later call from it. Ignoring it is always correct."""

    async def add_and_retrieve(
        self,
        path: str,
        payload: str,
        concurrency: int,
        *,
        priority: int = 0,
        orphaned: float | None = None,
        external_id: str | None = None,
        exclusive: bool = False,
        process_id: str | None = None,
        if_no_result: bool = False,
        max_age_ms: int | None = None,
        then_wait_ms: int | None = None,
        list_active: bool = True,
    ) -> AddAndRetrieveResponse:
        """`list_active` False: the answer need not list the prefix's active keys."""

    async def retrieve(
        self,
        key: QueueKey,
        *,
        concurrency: int = 1,
        extended: bool = True,
        process_id: str | None = None,
    ) -> RetrieveResponse | None: ...

    async def ack(self, key: QueueKey, result: Outcome | None) -> AckResponse:
        """A binary result (`BinaryResult`) is the driver's to store: as it is where it
        can (shared memory), else as its `inline_text()`."""
        ...

    async def result(
        self, key: QueueKey, *, external_id: str | None = None, consumer: str | None = None
    ) -> ResultResponse | None: ...

    async def result_blocking(self, key: QueueKey, timeout_ms: int) -> ResultResponse | None: ...

    async def get(self, key: QueueKey) -> QueryDefResponse | None: ...

    async def cancel(
        self, key: QueueKey, *, result: str | None = None
    ) -> QueryDefResponse | None: ...

    async def heartbeat(self, key: QueueKey) -> bool: ...

    async def merge_extra(self, key: QueueKey, extra: str) -> bool: ...

    async def list_items(
        self, prefix: str, *, with_payload: bool = False, process_id: str | None = None
    ) -> list[ListResponse]: ...

    async def pending(
        self,
        prefix: str,
        *,
        with_payload: bool = False,
        process_id: str | None = None,
        limit: int | None = None,
    ) -> list[ListResponse]: ...

    async def active(
        self, prefix: str, *, with_payload: bool = False, process_id: str | None = None
    ) -> list[ListResponse]: ...

    async def to_cancel(
        self, heartbeat_timeout_ms: int | None, orphaned_timeout_ms: int | None, prefix: str
    ) -> list[ToCancelResponse]: ...

    async def truncate(self) -> None: ...

    async def stats(self) -> dict[str, Any]:
        """What the store holds and who waits on it (see `QueueStore.describe`)."""
        ...

    async def hand_off(self, prefix: str, retrieved: RetrievedQuery) -> bool:
        """Run a retrieved query elsewhere (a supervisor's worker pool) if this driver can:
        True once it is accepted there; False and the caller's process runs it."""
        ...

    async def watch_slots(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` whenever a slot of `prefix` may have freed (an ACK or CANCEL by
        anyone); returns the function that stops it. For a process that alone may
        retrieve some items (its streams): nobody else reconciles for it."""
        ...

    async def close(self) -> None: ...


class LocalQueueDriver:
    """The QUEUE commands on a store in this process.

    With no store, a fresh in-memory one. Queues that should share state (two `QueryQueue`s
    with one prefix, as Cube's memory driver shares per prefix) share the store object:
    there is no module-level registry.
    """

    def __init__(self, store: QueueStore | None = None) -> None:
        self.store = store if store is not None else MemoryQueueStore()

    async def add(
        self,
        path: str,
        payload: str,
        *,
        priority: int = 0,
        orphaned: float | None = None,
        external_id: str | None = None,
        exclusive: bool = False,
        process_id: str | None = None,
        if_no_result: bool = False,
        max_age_ms: int | None = None,
        then_wait_ms: int | None = None,  # in process: nothing to save
    ) -> AddToQueueResponse:
        return await self.store.run_off_loop(
            self.store.add,
            path,
            payload,
            priority=priority,
            orphaned=orphaned,
            external_id=external_id,
            exclusive=exclusive,
            process_id=process_id,
            if_no_result=if_no_result,
            max_age_ms=max_age_ms,
        )

    async def add_and_retrieve(
        self,
        path: str,
        payload: str,
        concurrency: int,
        *,
        priority: int = 0,
        orphaned: float | None = None,
        external_id: str | None = None,
        exclusive: bool = False,
        process_id: str | None = None,
        if_no_result: bool = False,
        max_age_ms: int | None = None,
        then_wait_ms: int | None = None,
        list_active: bool = True,
    ) -> AddAndRetrieveResponse:
        return await self.store.run_off_loop(
            self.store.add_and_retrieve,
            path,
            payload,
            concurrency,
            priority=priority,
            orphaned=orphaned,
            external_id=external_id,
            exclusive=exclusive,
            process_id=process_id,
            if_no_result=if_no_result,
            max_age_ms=max_age_ms,
            list_active=list_active,
        )

    async def retrieve(
        self,
        key: QueueKey,
        *,
        concurrency: int = 1,
        extended: bool = True,
        process_id: str | None = None,
    ) -> RetrieveResponse | None:
        return await self.store.run_off_loop(
            self.store.retrieve,
            key,
            concurrency=concurrency,
            extended=extended,
            process_id=process_id,
        )

    async def ack(self, key: QueueKey, result: Outcome | None) -> AckResponse:
        if isinstance(result, BinaryResult):
            result = result.inline_text()
        return await self.store.run_off_loop(self.store.ack, key, result)

    async def result(
        self, key: QueueKey, *, external_id: str | None = None, consumer: str | None = None
    ) -> ResultResponse | None:
        return await self.store.run_off_loop(
            self.store.result, key, external_id=external_id, consumer=consumer
        )

    async def result_blocking(self, key: QueueKey, timeout_ms: int) -> ResultResponse | None:
        return await self.store.result_blocking(key, timeout_ms)

    async def get(self, key: QueueKey) -> QueryDefResponse | None:
        return await self.store.run_off_loop(self.store.get, key)

    async def cancel(self, key: QueueKey, *, result: str | None = None) -> QueryDefResponse | None:
        return await self.store.run_off_loop(self.store.cancel, key, result=result)

    async def heartbeat(self, key: QueueKey) -> bool:
        return await self.store.run_off_loop(self.store.heartbeat, key)

    async def merge_extra(self, key: QueueKey, extra: str) -> bool:
        return await self.store.run_off_loop(self.store.merge_extra, key, extra)

    async def list_items(
        self, prefix: str, *, with_payload: bool = False, process_id: str | None = None
    ) -> list[ListResponse]:
        return await self.store.run_off_loop(
            self.store.list_items, prefix, with_payload=with_payload, process_id=process_id
        )

    async def pending(
        self,
        prefix: str,
        *,
        with_payload: bool = False,
        process_id: str | None = None,
        limit: int | None = None,
    ) -> list[ListResponse]:
        return await self.store.run_off_loop(
            self.store.pending,
            prefix,
            with_payload=with_payload,
            process_id=process_id,
            limit=limit,
        )

    async def active(
        self, prefix: str, *, with_payload: bool = False, process_id: str | None = None
    ) -> list[ListResponse]:
        return await self.store.run_off_loop(
            self.store.active, prefix, with_payload=with_payload, process_id=process_id
        )

    async def to_cancel(
        self, heartbeat_timeout_ms: int | None, orphaned_timeout_ms: int | None, prefix: str
    ) -> list[ToCancelResponse]:
        return await self.store.run_off_loop(
            self.store.to_cancel, heartbeat_timeout_ms, orphaned_timeout_ms, prefix
        )

    async def truncate(self) -> None:
        await self.store.run_off_loop(self.store.truncate)

    async def stats(self) -> dict[str, Any]:
        return await self.store.run_off_loop(
            self.store.describe,
        )

    async def hand_off(self, prefix: str, retrieved: RetrievedQuery) -> bool:
        return False  # no pool behind a store in this process

    async def watch_slots(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        return self.store.watch_slots(callback)

    async def close(self) -> None:
        """The store belongs to whoever made it: it is not closed here."""
