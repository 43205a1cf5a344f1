"""The commands a supervisor runs on its own store, besides its clients': it gives back
what its stopping pool could not finish (`requeue`), refreshes heartbeats after an outage,
and empties the store. A base of `QueueStore`, whose `_atomic` they go through."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from queryqueue.engine import validation as v
from queryqueue.engine.clock import Clock
from queryqueue.engine.commands import queue_command
from queryqueue.engine.records import StoreTransaction
from queryqueue.engine.responses import QueueKey
from queryqueue.engine.waiters import SlotWatchers

T = TypeVar("T")


class MaintenanceCommands(ABC):
    clock: Clock
    slot_watchers: SlotWatchers

    @abstractmethod
    def _atomic(self) -> AbstractContextManager[StoreTransaction]: ...

    @abstractmethod
    def _run_command(self, run: Callable[[], T]) -> T: ...

    @abstractmethod
    def _after_commit(self, effect: Callable[[], object]) -> None: ...

    @queue_command(served=False)
    def requeue(self, key: QueueKey) -> bool:
        """Give an active item back: pending again, as if never retrieved, so that the
        next executor runs it (a supervisor stopping with a query its pool did not finish).
        False if the item is not active (done meanwhile, or never retrieved)."""
        v.check_key(key)
        now = self.clock.now_ms()
        with self._atomic() as tx:
            item = tx.find(key)
            if item is None or item.status != "active":
                return False
            tx.deactivate(item, now)
            self._after_commit(self.slot_watchers.publish)  # retrievable again
        return True

    # Shared by hosts: how long a host's lease on the items it runs outlives its last
    # renewal (`beat_host`); after it, other hosts reap them. None: one host owns the store.
    host_timeout: float | None = None

    def beat_host(self) -> int:
        """Renew this host's lease on the items it runs, where several hosts share the
        store (PostgreSQL): the other hosts whose leases hold (0 where one host owns it)."""
        return 0

    @queue_command(served=False)
    def refresh_active_heartbeats(self) -> int:
        """Give every active item a fresh heartbeat (not a QUEUE command), for a store back
        after an outage: nobody could heartbeat meanwhile, so a stale heartbeat is no proof
        of a dead executor. Live ones get a heartbeat timeout to reconnect; dead ones are
        still reaped after it."""
        now = self.clock.now_ms()
        with self._atomic() as tx:
            return tx.refresh_active_heartbeats(now)

    @queue_command()
    def truncate(self) -> None:
        """Remove every item and result of every prefix. Queue ids are never reused."""
        with self._atomic() as tx:
            tx.truncate()
