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
                await asyncio.sleep(self.watch.timeout / 10)
                if beating is None or beating.done():
                    beating = asyncio.ensure_future(self.beat())
                elif self.watch.failed(self.clock()):  # a renewal that hangs (frozen network)
                    self._fence()
        finally:
            if beating is not None:
                beating.cancel()

    async def beat(self) -> None:
        """One renewal: a failure is logged once, until one succeeds again."""
        assert self.watch is not None
        try:
            await self.store.run_off_loop(self.store.beat_host)
        except Exception as exc:  # a StoreError, or a bug: the next beat is still due
            if not self._failing:
                _log.warning("renewing this host's lease on its items failed: %s", exc)
            self._failing = True
            if self.watch.failed(self.clock()):
                self._fence()
            return
        self._failing = False
        if self.watch.renewed(self.clock()):
            _log.warning("this host's lease is renewed: it takes queries again")
            for pool in self.pools:
                pool.poke()

    def _fence(self) -> None:
        assert self.watch is not None
        stopped = sum(pool.fence() for pool in self.pools)
        _log.warning(
            "this host could not renew its lease for %g s (half of --pg-host-timeout): it"
            " stopped the %d queries it ran, which run again once the queue database"
            " answers, here or on another host",
            self.watch.timeout / 2,
            stopped,
        )
