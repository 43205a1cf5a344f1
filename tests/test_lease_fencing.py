"""A host that cannot renew its lease stops its queries before another host may take them:
the decision (`LeaseWatch`) stepped by hand, and the keeper that acts on it over a store
whose renewals fail and recover."""

from __future__ import annotations

from typing import Any

from queryqueue.engine.errors import StoreError
from queryqueue.supervisor.core.lease_watch import LeaseWatch
from queryqueue.supervisor.lease import LeaseKeeper


def test_a_lease_is_fenced_once_half_of_it_passed_without_a_renewal() -> None:
    watch = LeaseWatch(timeout=4.0, renewed_at=100.0)
    assert not watch.failed(101.9)  # under half the lease: others cannot reap yet
    assert watch.failed(102.0)
    assert not watch.failed(103.0)  # once an outage
    assert watch.renewed(105.0, others=1)  # it may take work again
    assert not watch.renewed(105.4, others=1)
    assert not watch.failed(107.3) and watch.failed(107.4)
    # Queries stalled sooner than the lease (a short heartbeat): fenced sooner.
    watch = LeaseWatch(timeout=4.0, renewed_at=100.0)
    assert not watch.failed(100.4, window=1.0) and watch.failed(100.5, window=1.0)
    # Alone at its last renewal: nobody can reap its queries, which go on.
    watch = LeaseWatch(timeout=4.0, renewed_at=100.0)
    watch.renewed(100.0, others=0)
    assert not watch.failed(160.0)


class _Store:
    host_timeout = 4.0

    def __init__(self) -> None:
        self.up = True
        self.beats = 0
        self.others = 1  # another host shares the queue

    async def run_off_loop(self, call: Any, *args: Any) -> Any:
        return call(*args)

    def beat_host(self) -> int:
        if not self.up:
            raise StoreError("the queue database failed: connection refused")
        self.beats += 1
        return self.others


class _Pool:
    queue = None  # no queue of its own yet: the lease alone is the window

    def __init__(self) -> None:
        self.fences = 0
        self.pokes = 0

    def fence(self) -> int:
        self.fences += 1
        return 2

    def poke(self) -> None:
        self.pokes += 1


async def test_the_keeper_fences_its_pools_after_half_a_lease_of_failures_and_frees_them() -> None:
    now = [0.0]
    store, pools = _Store(), [_Pool(), _Pool()]
    keeper = LeaseKeeper(store, pools, clock=lambda: now[0])
    await keeper.beat()
    assert store.beats == 1 and [p.fences for p in pools] == [0, 0]
    store.up = False
    for moment in (0.4, 0.8, 1.2, 1.6):  # failing, under half the lease
        now[0] = moment
        await keeper.beat()
    assert [p.fences for p in pools] == [0, 0]
    now[0] = 2.0
    await keeper.beat()
    assert [p.fences for p in pools] == [1, 1]
    now[0] = 2.4
    await keeper.beat()
    assert [p.fences for p in pools] == [1, 1]  # once an outage
    store.up = True
    now[0] = 9.0
    await keeper.beat()
    assert [p.pokes for p in pools] == [1, 1]  # taking work again
    await keeper.beat()
    assert [p.pokes for p in pools] == [1, 1]


async def test_a_store_without_host_leases_is_never_fenced() -> None:
    store = _Store()
    store.host_timeout = None  # type: ignore[assignment]
    keeper = LeaseKeeper(store, [_Pool()])
    assert keeper.watch is None
    await keeper.keep()  # returns at once: nothing to keep
