"""The read-only QUEUE commands every store shares: LIST, PENDING, ACTIVE, TO_CANCEL
(STALLED, ORPHANED), the overview behind `queryqueue status`, and the purge of expired
results. A base of `QueueStore`, whose `_atomic` they go through, one transaction each."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from queryqueue.engine import validation as v
from queryqueue.engine.clock import Clock
from queryqueue.engine.commands import queue_command
from queryqueue.engine.errors import InvalidCommandError
from queryqueue.engine.records import Item, StoreTransaction
from queryqueue.engine.responses import ItemStatus, ListResponse, ToCancelResponse
from queryqueue.engine.waiters import ResultWaiters

T = TypeVar("T")
# ACK deletes at most this many expired results, so cleanup never makes one command slow.
PURGE_BATCH = 64
# An ACK purges expired results at most this often (store time), unless its last purge
# found a full batch: a statement less for nearly every ACK. Reads never see an expired
# result anyway; purging only frees the space.
PURGE_EVERY_MS = 1_000


class ListingCommands(ABC):
    clock: Clock
    waiters: ResultWaiters

    @abstractmethod
    def _atomic(self) -> AbstractContextManager[StoreTransaction]: ...

    @abstractmethod
    def _run_command(self, run: Callable[[], T]) -> T: ...

    # -- QUEUE LIST / PENDING / ACTIVE ---------------------------------------------------

    @queue_command(response=ListResponse, many=True, take_process_id=True, resend="always")
    def list_items(
        self, prefix: str, *, with_payload: bool = False, process_id: str | None = None
    ) -> list[ListResponse]:
        """QUEUE LIST [WITH_PAYLOAD] prefix: priority desc, then queue id asc."""
        return self._list(prefix, None, with_payload, process_id, None)

    @queue_command(response=ListResponse, many=True, take_process_id=True, resend="always")
    def pending(
        self,
        prefix: str,
        *,
        with_payload: bool = False,
        process_id: str | None = None,
        limit: int | None = None,
    ) -> list[ListResponse]:
        """QUEUE PENDING prefix: priority desc, then queue id asc. `limit` (our extension)
        returns only the head, which is all reconcile reads."""
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or limit < 0
        ):
            raise InvalidCommandError("limit must be a non-negative integer")
        return self._list(prefix, "pending", with_payload, process_id, limit)

    @queue_command(response=ListResponse, many=True, take_process_id=True, resend="always")
    def active(
        self, prefix: str, *, with_payload: bool = False, process_id: str | None = None
    ) -> list[ListResponse]:
        """QUEUE ACTIVE prefix: in queue id order."""
        return self._list(prefix, "active", with_payload, process_id, None)

    def _list(
        self,
        prefix: str,
        status: ItemStatus | None,
        with_payload: bool,
        process_id: str | None,
        limit: int | None,
    ) -> list[ListResponse]:
        v.check_prefix(prefix)
        v.check_process_id(process_id)
        with self._atomic() as tx:
            items = tx.items(
                prefix, status, process_id=process_id, with_payload=with_payload, limit=limit
            )
        return [
            ListResponse(
                id=item.key,
                queue_id=item.id,
                status=item.status,
                extra=item.extra,
                payload=item.payload if with_payload else None,
            )
            for item in items
        ]

    # -- QUEUE TO_CANCEL / STALLED / ORPHANED -------------------------------------------

    @queue_command(response=ToCancelResponse, many=True, resend="always")
    def to_cancel(
        self, heartbeat_timeout_ms: int | None, orphaned_timeout_ms: int | None, prefix: str
    ) -> list[ToCancelResponse]:
        """QUEUE TO_CANCEL: stalled active items, then orphaned pending ones. No visibility
        filter: any process may reap any item."""
        v.check_non_negative_ms("heartbeat timeout", heartbeat_timeout_ms, nullable=True)
        v.check_non_negative_ms("orphaned timeout", orphaned_timeout_ms, nullable=True)
        v.check_prefix(prefix)
        now = self.clock.now_ms()
        with self._atomic() as tx:
            found: list[Item] = []
            if heartbeat_timeout_ms is not None:
                found += tx.stalled_items(prefix, now, heartbeat_timeout_ms)
            if orphaned_timeout_ms is not None:
                found += tx.orphaned_items(prefix, now, orphaned_timeout_ms)
        return [ToCancelResponse(id=item.key, queue_id=item.id) for item in found]

    @queue_command(response=ToCancelResponse, many=True, resend="always", served=False)
    def stalled(self, heartbeat_timeout_ms: int, prefix: str) -> list[ToCancelResponse]:
        v.check_non_negative_ms("heartbeat timeout", heartbeat_timeout_ms)
        return self.to_cancel(heartbeat_timeout_ms, None, prefix)

    @queue_command(response=ToCancelResponse, many=True, resend="always", served=False)
    def orphaned(self, orphaned_timeout_ms: int, prefix: str) -> list[ToCancelResponse]:
        v.check_non_negative_ms("orphaned timeout", orphaned_timeout_ms)
        return self.to_cancel(None, orphaned_timeout_ms, prefix)

    _purge_due_ms = 0

    def _purge_when_due(self, tx: StoreTransaction, now: int) -> None:
        """An ACK's share of purging expired results (see PURGE_EVERY_MS)."""
        if now >= self._purge_due_ms:
            full = tx.purge_expired_results(now, PURGE_BATCH) >= PURGE_BATCH
            self._purge_due_ms = now if full else now + PURGE_EVERY_MS

    @queue_command(served=False)
    def purge_expired(self) -> int:
        """Delete up to PURGE_BATCH expired results (ACK does as much; a supervisor's timer
        calls this too, so an idle queue purges). Returns how many went."""
        with self._atomic() as tx:
            return tx.purge_expired_results(self.clock.now_ms(), PURGE_BATCH)

    @queue_command(served=False)
    def describe(self) -> dict[str, Any]:
        """What `queryqueue status` shows: per prefix counts and oldest age, results held."""
        now = self.clock.now_ms()
        with self._atomic() as tx:
            prefixes, results = tx.overview(now)
        return {
            "prefixes": [
                {
                    "prefix": p.prefix,
                    "pending": p.pending,
                    "active": p.active,
                    "oldest_age_ms": None if p.oldest_created is None else now - p.oldest_created,
                }
                for p in prefixes
            ],
            "results_held": results,
            "waiters": self.waiters.count(),
        }
