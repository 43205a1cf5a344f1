"""A host's lease on the items it runs, on a store several hosts share: renewed on a task
of its own (a long purge or reconcile never holds it up), and the host's running queries
stopped when it cannot renew it for long (`core/lease_watch.py` decides when)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from queryqueue.supervisor.core.lease_watch import LeaseWatch

_log = logging.getLogger("queryqueue.supervisor")


class LeaseKeeper:
    """Renews `store`'s host lease every tenth of it; `pools` are fenced (their running
    queries stopped) once it lapses, and take work again when a renewal succeeds."""

    def __init__(
        self, store: Any, pools: Sequence[Any], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.store, self.pools, self.clock = store, pools, clock
        timeout = store.host_timeout
        self.watch = None if timeout is None else LeaseWatch(timeout, clock())
        self._failing = False

    async def keep(self) -> None:
        """Renew until cancelled (a store without host leases: nothing to do)."""
        if self.watch is None:
            return
        beating: asyncio.Future[None] | None = None
        try:
            while True:
                await asyncio.sleep(self.window() / 10)
                if beating is None or beating.done():
                    beating = asyncio.ensure_future(self.beat())
                elif self.watch.failed(self.clock(), self.window()):  # a renewal that hangs
                    self._fence()
        finally:
            if beating is not None:
                beating.cancel()

    async def beat(self) -> None:
        """One renewal: a failure is logged once, until one succeeds again."""
        assert self.watch is not None
        try:
            others = await self.store.run_off_loop(self.store.beat_host)
        except Exception as exc:  # a StoreError, or a bug: the next beat is still due
            if not self._failing:
                _log.warning("renewing this host's lease on its items failed: %s", exc)
            self._failing = True
            if self.watch.failed(self.clock(), self.window()):
                self._fence()
            return
        self._failing = False
        if self.watch.renewed(self.clock(), others):
            _log.warning("this host's lease is renewed: it takes queries again")
            for pool in self.pools:
                pool.poke()

    def describe(self) -> dict[str, Any]:
        """What `stats` says of the lease: the other hosts seen at its last renewal, how
        long ago that was, whether this host's queries are fenced now."""
        if self.watch is None:
            return {}
        ago = round(self.clock() - self.watch.renewed_at, 3)
        watch = self.watch
        return {
            "lease": {"other_hosts": watch.others, "renewed_s_ago": ago, "fenced": watch.fenced}
        }

    def window(self) -> float:
        """How long after this host's last renewal another host may reap its queries: its
        lease, or the stall timeout of a pool's queries where that is shorter."""
        assert self.watch is not None
        stalls = [
            pool.queue.connection.heartbeat_timeout_ms / 1000
            for pool in self.pools
            if pool.queue is not None
        ]
        return float(min([self.watch.timeout, *stalls]))

    def _fence(self) -> None:
        assert self.watch is not None
        stopped = sum(pool.fence() for pool in self.pools)
        _log.warning(
            "this host could not renew its lease for %g s (half the time after which another"
            " host may reap its queries): it stopped the %d queries it ran, which run again"
            " once the queue database answers, here or on another host",
            self.window() / 2,
            stopped,
        )
