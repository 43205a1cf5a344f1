"""Cube's queue driver methods, bound to one queue, over any `QueueDriver`.

This is what Cube's `CubeStoreQueueDriver` connection does: it turns `getResult`,
`addToQueue`, `retrieveForProcessing`… into QUEUE commands on `<prefix>:<queryKeyHash>`
paths, encodes the query definition as JSON and decodes `payload` + `extra` back.
`QueryQueue` only ever calls these methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from queryqueue.engine.binary import Outcome
from queryqueue.engine.driver import QueueDriver
from queryqueue.engine.responses import (
    ListResponse,
    QueryDefResponse,
    QueueId,
    QueueKey,
    ResultResponse,
    RetrieveResponse,
    ToCancelResponse,
)

QueryDef = dict[str, Any]


@dataclass(frozen=True, slots=True)
class AddedToQueue:
    """addToQueue's `[added, queueId, queueSize, addedToQueueTime, retrieved]`."""

    added: bool
    queue_id: QueueId
    queue_size: int
    added_to_queue_time: int
    # Fast track: the query definition when ADD_AND_RETRIEVE handed us the item, with the
    # active keys of the prefix; None too when `dispatched`.
    retrieved: QueryDef | None = None
    active_keys: tuple[str, ...] = ()
    dispatched: bool = False  # the supervisor's pool already runs the retrieved item

    @property
    def fast_tracked(self) -> bool:
        # A dispatched answer carries no query: the supervisor's pool runs its own copy.
        return self.retrieved is not None or self.dispatched


@dataclass(frozen=True, slots=True)
class Retrieved:
    """retrieveForProcessing's result: the item is ours to execute iff `query` is set."""

    queue_id: QueueId | None
    active_keys: tuple[str, ...]
    queue_size: int
    query: QueryDef | None


def decode_def(response: QueryDefResponse | None) -> QueryDef | None:
    if response is None:
        return None
    return decode_query(response.payload, response.extra)


def retrieved_of(got: RetrieveResponse | None) -> Retrieved:
    """RETRIEVE EXTENDED's answer as the reconcile reads it."""
    if got is None or got.payload is None:
        return Retrieved(
            queue_id=None,
            active_keys=_keys(got.active) if got else (),
            queue_size=got.pending if got else 0,
            query=None,
        )
    return Retrieved(
        queue_id=got.id,
        active_keys=_keys(got.active),
        queue_size=got.pending,
        query=decode_query(got.payload, got.extra),
    )


def decode_query(payload: str, extra: str | None) -> QueryDef:
    """A stored item's query definition: its payload, with its extra merged in."""
    query: QueryDef = orjson.loads(payload)
    if extra is not None:
        decoded = orjson.loads(extra)
        if isinstance(decoded, dict):
            query.update(decoded)
    return query


def _pairs(rows: list[ListResponse] | list[ToCancelResponse]) -> list[tuple[str, QueueId]]:
    return [(row.id, row.queue_id) for row in rows]


def _keys(active: str | None) -> tuple[str, ...]:
    return tuple(active.split(",")) if active else ()


class QueueConnection:
    def __init__(
        self,
        driver: QueueDriver,
        prefix: str,
        *,
        process_uid: str,
        concurrency: int,
        continue_wait_timeout: float,
        orphaned_timeout: float,
        heartbeat_timeout: float,
    ) -> None:
        self.driver = driver
        self.prefix = prefix
        self.process_uid = process_uid
        self.concurrency = concurrency
        self.continue_wait_timeout_ms = round(continue_wait_timeout * 1000)
        self.orphaned_timeout_ms = round(orphaned_timeout * 1000)
        self.heartbeat_timeout_ms = round(heartbeat_timeout * 1000)

    def path(self, query_key_hash: str) -> str:
        return f"{self.prefix}:{query_key_hash}"

    def _key(self, query_key_hash: str, queue_id: QueueId | None) -> QueueKey:
        # Cube's `queueId || path`: the id names one generation of the item.
        return queue_id if queue_id else self.path(query_key_hash)

    async def get_result(
        self, query_key_hash: str, external_id: str | None = None, *, view: bool = False
    ) -> Any:
        found = await self.driver.result(self.path(query_key_hash), external_id=external_id)
        return await self._decoded_result(found, view)

    async def get_result_by_id(self, queue_id: QueueId, *, view: bool = False) -> Any:
        return await self._decoded_result(await self.driver.result(queue_id), view)

    async def get_result_blocking(
        self,
        query_key_hash: str,
        queue_id: QueueId | None,
        wait: float | None = None,
        *,
        view: bool = False,
    ) -> Any:
        """The result, waiting up to `wait` seconds (`continue_wait_timeout` by default)."""
        timeout_ms = self.wait_ms(wait)
        found = await self.driver.result_blocking(self._key(query_key_hash, queue_id), timeout_ms)
        return await self._decoded_result(found, view)

    def wait_ms(self, wait: float | None) -> int:
        """A long poll's timeout: `wait` seconds, or `continue_wait_timeout`."""
        return self.continue_wait_timeout_ms if wait is None else round(wait * 1000)

    async def _decoded_result(self, found: ResultResponse | None, view: bool) -> Any:
        """The outcome, decoded; a binary result in shared memory read out (or viewed, its
        lease then in "$lease")."""
        if found is None or found.payload is None:
            return None
        if found.shared is not None:
            outcome: dict[str, Any] = await found.shared.read(view=view)
            return outcome
        return orjson.loads(found.payload)

    async def add_to_queue(
        self,
        query_key_hash: str,
        query_def: QueryDef,
        *,
        priority: int,
        orphaned_timeout: float,
        external_id: str | None,
        exclusive: bool,
        fast_track: bool,
        if_no_result: bool = False,
        max_age_ms: int | None = None,
        then_wait_ms: int | None = None,
        list_active: bool = True,
    ) -> AddedToQueue:
        """`list_active` False: a fast-tracked ADD does not list the active keys (only
        the "Waiting for query" event reads them)."""
        payload = orjson.dumps(query_def).decode()
        options: dict[str, Any] = {
            "priority": priority,
            "orphaned": orphaned_timeout,
            "external_id": external_id,
            "exclusive": exclusive,
            "process_id": self.process_uid if exclusive else None,
            "if_no_result": if_no_result,
            "max_age_ms": max_age_ms,
            "then_wait_ms": then_wait_ms,
        }
        if fast_track:
            both = await self.driver.add_and_retrieve(
                self.path(query_key_hash),
                payload,
                self.concurrency,
                list_active=list_active,
                **options,
            )
            return AddedToQueue(
                added=both.added,
                queue_id=both.id,
                queue_size=both.pending,
                added_to_queue_time=query_def["addedToQueueTime"],
                retrieved=None if both.payload is None else decode_query(both.payload, both.extra),
                active_keys=_keys(both.active),
                dispatched=both.dispatched,
            )
        added = await self.driver.add(self.path(query_key_hash), payload, **options)
        return AddedToQueue(
            added=added.added,
            queue_id=added.id,
            queue_size=added.pending,
            added_to_queue_time=query_def["addedToQueueTime"],
        )

    async def get_queries_to_cancel(self) -> list[tuple[str, QueueId]]:
        rows = await self.driver.to_cancel(
            self.heartbeat_timeout_ms, self.orphaned_timeout_ms, self.prefix
        )
        return _pairs(rows)

    async def get_stalled_queries(self) -> list[tuple[str, QueueId]]:
        rows = await self.driver.to_cancel(self.heartbeat_timeout_ms, None, self.prefix)
        return _pairs(rows)

    async def get_orphaned_queries(self) -> list[tuple[str, QueueId]]:
        rows = await self.driver.to_cancel(None, self.orphaned_timeout_ms, self.prefix)
        return _pairs(rows)

    async def get_query_and_remove(
        self, query_key_hash: str, queue_id: QueueId | None
    ) -> QueryDef | None:
        return decode_def(await self.driver.cancel(self._key(query_key_hash, queue_id)))

    async def cancel_query(
        self, query_key_hash: str, queue_id: QueueId | None, result: str
    ) -> QueryDef | None:
        """Remove the item with `result` as its outcome, which answers its waiters."""
        key = self._key(query_key_hash, queue_id)
        return decode_def(await self.driver.cancel(key, result=result))

    async def get_active_queries(self) -> list[tuple[str, QueueId]]:
        rows = await self.driver.active(self.prefix, process_id=self.process_uid)
        return _pairs(rows)

    async def get_to_process_queries(self, limit: int | None = None) -> list[tuple[str, QueueId]]:
        # Persistent keys are EXCLUSIVE to their process, so the store already hides other
        # processes' ones: `limit` counts only what this process may run.
        rows = await self.driver.pending(self.prefix, process_id=self.process_uid, limit=limit)
        return _pairs(rows)

    async def retrieve_for_processing(self, query_key_hash: str) -> Retrieved:
        got = await self.driver.retrieve(
            self.path(query_key_hash),
            concurrency=self.concurrency,
            extended=True,
            process_id=self.process_uid,
        )
        return retrieved_of(got)

    async def free_processing_lock(self, query_key_hash: str, queue_id: QueueId | None) -> None:
        """A retrieval either happened atomically or not at all: nothing to undo."""

    async def get_query_def(
        self, query_key_hash: str, queue_id: QueueId | None = None
    ) -> QueryDef | None:
        return decode_def(await self.driver.get(self._key(query_key_hash, queue_id)))

    async def get_query_stage_state(
        self, only_keys: bool = True
    ) -> tuple[list[str], list[str], dict[str, QueryDef]]:
        rows = await self.driver.list_items(
            self.prefix, with_payload=not only_keys, process_id=self.process_uid
        )
        active = [row.id for row in rows if row.status == "active"]
        to_process = [row.id for row in rows if row.status == "pending"]
        defs: dict[str, QueryDef] = {}
        if not only_keys:
            for row in rows:
                if row.payload is not None:
                    defs[row.id] = decode_query(row.payload, row.extra)
        return active, to_process, defs

    async def update_heartbeat(self, query_key_hash: str, queue_id: QueueId | None) -> bool:
        return await self.driver.heartbeat(self._key(query_key_hash, queue_id))

    async def optimistic_query_update(
        self, query_key_hash: str, patch: dict[str, Any], queue_id: QueueId | None
    ) -> bool:
        return await self.driver.merge_extra(
            self._key(query_key_hash, queue_id), orjson.dumps(patch).decode()
        )

    async def set_encoded_result_and_remove_query(
        self, query_key_hash: str, result: Outcome, queue_id: QueueId | None
    ) -> bool:
        """Cube's setResultAndRemoveQuery, with the result already JSON text
        (encoded once, where it was made)."""
        ack = await self.driver.ack(self._key(query_key_hash, queue_id), result)
        return ack.success
