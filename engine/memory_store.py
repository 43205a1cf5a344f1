"""The queue store in memory: one process, development and unit tests.

Semantics come from `QueueStore`; this module only keeps the state. A transaction holds
one lock and an undo log, so a command that fails half-way leaves nothing behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from queryqueue.engine.clock import Clock
from queryqueue.engine.records import (
    Item,
    PrefixOverview,
    ResultReuse,
    StoredResult,
)
from queryqueue.engine.responses import ItemStatus, QueueId, QueueKey
from queryqueue.engine.store import DEFAULT_RESULT_TTL_MS, QueueStore


class _State:
    def __init__(self) -> None:
        self.next_id = 1
        self.items: dict[QueueId, Item] = {}
        self.by_path: dict[str, QueueId] = {}
        self.by_external_id: dict[str, QueueId] = {}
        # (prefix, status) -> ids in queue id order: counts and scans never touch other prefixes.
        self.by_status: dict[tuple[str, ItemStatus], dict[QueueId, None]] = {}
        # Results in insertion order: with a fixed TTL that is also expiry order.
        self.results: dict[QueueId, StoredResult] = {}
        self.results_by_path: dict[str, list[QueueId]] = {}
        self.results_by_external_id: dict[str, list[QueueId]] = {}


class MemoryTransaction:
    def __init__(self, state: _State) -> None:
        self._s = state
        self.undo: list[Callable[[], None]] = []

    # -- items ------------------------------------------------------------------------

    def expect_add(self, item: Item, reuse: ResultReuse | None) -> None:
        pass

    def find(self, key: QueueKey, *, with_payload: bool = False) -> Item | None:
        queue_id = key if isinstance(key, int) else self._s.by_path.get(key)
        if queue_id is None:
            return None
        item = self._s.items.get(queue_id)
        if item is None:
            return None
        return item if with_payload else replace(item, payload=None)

    def external_id_taken(self, external_id: str) -> bool:
        return external_id in self._s.by_external_id

    def insert(self, item: Item) -> QueueId:
        s = self._s
        queue_id = s.next_id
        s.next_id += 1
        stored = replace(item, id=queue_id)
        self._add(stored)

        def undo() -> None:
            s.next_id = queue_id
            self._drop(stored)

        self.undo.append(undo)
        return queue_id

    def activate(self, item: Item, now: int, extra: str | None) -> None:
        self._update(item.id, status="active", heartbeat=now, extra=extra)

    def deactivate(self, item: Item, now: int) -> None:
        self._update(item.id, status="pending", heartbeat=now)

    def set_heartbeat(self, item: Item, now: int) -> None:
        self._update(item.id, heartbeat=now)

    def set_orphaned(self, item: Item, deadline: int) -> None:
        self._update(item.id, orphaned=deadline)

    def set_extra(self, item: Item, extra: str | None) -> None:
        self._update(item.id, extra=extra)

    def delete(self, item: Item) -> None:
        stored = self._s.items[item.id]
        self._drop(stored)

        self.undo.append(lambda: self._add(stored))

    def _add(self, item: Item) -> None:
        s = self._s
        s.items[item.id] = item
        s.by_path[item.path] = item.id
        if item.external_id is not None:
            s.by_external_id[item.external_id] = item.id
        index = (item.prefix, item.status)
        ids = s.by_status.setdefault(index, {})
        out_of_order = bool(ids) and item.id < next(reversed(ids))
        ids[item.id] = None
        if out_of_order:
            # An activation of an older item, or an undo: keep queue id order.
            s.by_status[index] = dict.fromkeys(sorted(ids))

    def _drop(self, item: Item) -> None:
        s = self._s
        del s.items[item.id]
        del s.by_path[item.path]
        if item.external_id is not None:
            del s.by_external_id[item.external_id]
        index = (item.prefix, item.status)
        ids = s.by_status[index]
        del ids[item.id]
        if not ids:
            del s.by_status[index]

    def _update(self, queue_id: QueueId, **changes: object) -> None:
        before = self._s.items[queue_id]
        after = replace(before, **changes)  # type: ignore[arg-type]
        self._drop(before)
        self._add(after)

        def undo() -> None:
            self._drop(after)
            self._add(before)

        self.undo.append(undo)

    def _status_items(self, prefix: str, status: ItemStatus) -> Iterator[Item]:
        for queue_id in self._s.by_status.get((prefix, status), {}):
            yield self._s.items[queue_id]

    def _prefix_items(self, prefix: str, status: ItemStatus | None) -> Iterator[Item]:
        if status != "active":
            yield from self._status_items(prefix, "pending")
        if status != "pending":
            yield from self._status_items(prefix, "active")

    def counts(self, prefix: str) -> tuple[int, int]:
        by_status = self._s.by_status
        return len(by_status.get((prefix, "pending"), ())), len(
            by_status.get((prefix, "active"), ())
        )

    def active_keys(self, prefix: str) -> list[str]:
        return [item.key for item in self._status_items(prefix, "active")]

    def items(
        self,
        prefix: str,
        status: ItemStatus | None,
        *,
        process_id: str | None,
        with_payload: bool,
        limit: int | None,
    ) -> list[Item]:
        found = [
            item
            for item in self._prefix_items(prefix, status)
            if (not item.exclusive or item.process_id == process_id)
        ]
        if status != "active":
            found.sort(key=lambda item: (-item.priority, item.id))
        if limit is not None:
            found = found[:limit]
        return found if with_payload else [replace(item, payload=None) for item in found]

    def pool_head(self, prefix: str, process_id: str, limit: int) -> list[Item]:
        return self.items(prefix, "pending", process_id=process_id, with_payload=True, limit=limit)

    def orphaned_items(self, prefix: str, now: int, orphaned_timeout_ms: int) -> list[Item]:
        found = [
            item
            for item in self._status_items(prefix, "pending")
            if (
                item.orphaned < now
                if item.orphaned is not None
                else now - item.created > orphaned_timeout_ms
            )
        ]
        found.sort(key=lambda item: (-item.priority, item.id))
        return found

    def stalled_items(self, prefix: str, now: int, heartbeat_timeout_ms: int) -> list[Item]:
        return [
            item
            for item in self._status_items(prefix, "active")
            if now - (item.heartbeat if item.heartbeat is not None else item.created)
            > heartbeat_timeout_ms
        ]

    # -- results ------------------------------------------------------------------------

    def insert_result(self, result: StoredResult) -> None:
        s = self._s
        s.results[result.id] = result
        s.results_by_path.setdefault(result.path, []).append(result.id)
        if result.external_id is not None:
            s.results_by_external_id.setdefault(result.external_id, []).append(result.id)
        self.undo.append(lambda: self._forget_result(result))

    def _forget_result(self, result: StoredResult) -> None:
        s = self._s
        s.results.pop(result.id, None)
        _remove_from_index(s.results_by_path, result.path, result.id)
        if result.external_id is not None:
            _remove_from_index(s.results_by_external_id, result.external_id, result.id)

    def _live(self, queue_id: QueueId, now: int) -> StoredResult | None:
        found = self._s.results.get(queue_id)
        return found if found is not None and found.expire > now else None

    def result_by_id(self, id: QueueId, now: int) -> StoredResult | None:
        return self._live(id, now)

    def latest_result_by_path(self, path: str, now: int) -> StoredResult | None:
        return self._latest(self._s.results_by_path.get(path, []), now)

    def latest_result_by_external_id(self, external_id: str, now: int) -> StoredResult | None:
        return self._latest(self._s.results_by_external_id.get(external_id, []), now)

    def _latest(self, ids: list[QueueId], now: int) -> StoredResult | None:
        for queue_id in sorted(ids, reverse=True):
            found = self._live(queue_id, now)
            if found is not None:
                return found
        return None

    def mark_result_consumed(self, id: QueueId, consumer: str | None = None) -> None:
        before = self._s.results.get(id)
        if before is None or before.deleted:
            return
        self._s.results[id] = replace(before, deleted=True, consumed_by=consumer)
        self.undo.append(lambda: self._s.results.__setitem__(id, before))

    def delete_result(self, id: QueueId) -> None:
        before = self._s.results.get(id)
        if before is None:
            return
        self._forget_result(before)
        self.undo.append(lambda: self.insert_result(before))

    def purge_expired_results(self, now: int, limit: int) -> int:
        # Insertion order is expiry order (one TTL), so the expired ones lead: stop at the
        # first live one instead of scanning every result.
        expired: list[StoredResult] = []
        for result in self._s.results.values():
            if result.expire > now or len(expired) >= limit:
                break
            expired.append(result)
        for result in expired:
            self.delete_result(result.id)
        return len(expired)

    def overview(self, now: int) -> tuple[list[PrefixOverview], int]:
        prefixes = sorted({prefix for prefix, _ in self._s.by_status})
        found = []
        for prefix in prefixes:
            pending, active = self.counts(prefix)
            created = [item.created for item in self._prefix_items(prefix, None)]
            found.append(PrefixOverview(prefix, pending, active, min(created) if created else None))
        return found, len(self._s.results)  # held: stored and not yet purged

    def refresh_active_heartbeats(self, now: int) -> int:
        active = [
            item
            for index, ids in list(self._s.by_status.items())
            if index[1] == "active"
            for item in (self._s.items[i] for i in ids)
        ]
        for item in active:
            self._update(item.id, heartbeat=now)
        return len(active)

    def acked(self, item: Item, result: str | None) -> None:
        pass  # one process: waiters are woken in process, after the commit

    def watch(self, key: QueueKey, now: int) -> None:
        pass  # one process: every ACK wakes its waiters

    def truncate(self) -> None:
        s = self._s
        snapshot = (
            dict(s.items),
            dict(s.by_path),
            dict(s.by_external_id),
            {index: dict(ids) for index, ids in s.by_status.items()},
            dict(s.results),
            {path: list(ids) for path, ids in s.results_by_path.items()},
            {ext: list(ids) for ext, ids in s.results_by_external_id.items()},
        )
        for table in (
            s.items,
            s.by_path,
            s.by_external_id,
            s.by_status,
            s.results,
            s.results_by_path,
            s.results_by_external_id,
        ):
            table.clear()

        def undo() -> None:
            (
                s.items,
                s.by_path,
                s.by_external_id,
                s.by_status,
                s.results,
                s.results_by_path,
                s.results_by_external_id,
            ) = snapshot

        self.undo.append(undo)


def _remove_from_index(index: dict[str, list[QueueId]], name: str, queue_id: QueueId) -> None:
    ids = index.get(name)
    if ids is None:
        return
    if queue_id in ids:
        ids.remove(queue_id)
    if not ids:
        del index[name]


class MemoryQueueStore(QueueStore):
    """All queue state in this process's memory; gone when the process ends."""

    def __init__(
        self, *, clock: Clock | None = None, result_ttl_ms: int = DEFAULT_RESULT_TTL_MS
    ) -> None:
        super().__init__(clock=clock, result_ttl_ms=result_ttl_ms)
        self._state = _State()
        self._lock = threading.RLock()

    @contextmanager
    def _atomic(self) -> Iterator[MemoryTransaction]:
        with self._lock:
            tx = MemoryTransaction(self._state)
            try:
                yield tx
            except BaseException:
                for undo in reversed(tx.undo):
                    undo()
                raise

    def close(self) -> None:
        pass
