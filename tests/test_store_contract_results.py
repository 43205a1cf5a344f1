"""The queue store conformance suite, its results: ACK, RESULT and RESULT_BLOCKING, on every
store implementation."""

from __future__ import annotations

import asyncio

import pytest

from queryqueue import InvalidCommandError, QueueStore
from queryqueue.engine.clock import ManualClock
from queryqueue.engine.responses import AckResponse, ResultStatus
from tests.conftest import StoreFactory
from tests.store_contract_util import P, keys, path, payload
from tests.waiting import wait_until


def test_ack_removes_item_and_stores_result(store: QueueStore) -> None:
    qid = store.add(path("a"), payload(), external_id="req-1").id
    store.retrieve(qid)
    assert store.ack(qid, payload(result=42)) == AckResponse(success=True)
    assert store.list_items(P) == []
    got = store.result(qid)
    assert got is not None
    assert (got.payload, got.type, got.id, got.external_id) == (
        payload(result=42),
        ResultStatus.SUCCESS,
        qid,
        "req-1",
    )


def test_ack_of_unknown_or_already_acked_item_fails(store: QueueStore) -> None:
    assert store.ack(path("nope"), payload()) == AckResponse(success=False)
    assert store.ack(12345, None) == AckResponse(success=False)
    qid = store.add(path("a"), payload()).id
    assert store.ack(qid, payload(r=1)).success
    assert not store.ack(qid, payload(r=2)).success
    got = store.result(qid)
    assert got is not None and got.payload == payload(r=1)


def test_ack_of_stale_id_does_not_touch_the_new_item_at_the_same_path(store: QueueStore) -> None:
    old = store.add(path("a"), payload()).id
    store.cancel(old)
    new = store.add(path("a"), payload()).id
    assert not store.ack(old, payload()).success
    assert keys(store.pending(P)) == ["a"] and store.pending(P)[0].queue_id == new


def test_ack_of_pending_item_is_accepted(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    assert store.ack(path("a"), payload(r=1)).success
    assert store.result(qid) is not None


def test_ack_with_null_stores_no_result(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    assert store.ack(qid, None).success
    assert store.result(qid) is None
    assert store.result(path("a")) is None


def test_result_by_path_is_consumed_once_by_id_read_many(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    store.ack(qid, payload(r=1))
    assert store.result(path("a")) is not None
    assert store.result(path("a")) is None
    assert store.result(qid) is not None
    assert store.result(qid) is not None


def test_a_path_read_named_by_a_consumer_token_can_be_repeated(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    store.ack(qid, payload(r=1))
    first = store.result(path("a"), consumer="read-1")
    assert first is not None and first.payload == payload(r=1)
    # the same read re-sent (its answer was lost) gets the same result...
    assert store.result(path("a"), consumer="read-1") == first
    # ...and nobody else does
    assert store.result(path("a"), consumer="read-2") is None
    assert store.result(path("a")) is None
    with pytest.raises(InvalidCommandError, match="consumer"):
        store.result(path("a"), consumer="")


def test_result_by_id_or_external_id_leaves_the_path_result_in_place(store: QueueStore) -> None:
    # Cube Store: reads by queue id and by external id are read-many; only a read by path
    # consumes the result.
    qid = store.add(path("a"), payload(), external_id="req-1").id
    store.ack(qid, payload(r=1))
    assert store.result(qid) is not None
    assert store.result(path("b"), external_id="req-1") is not None
    got = store.result(path("a"))
    assert got is not None and got.payload == payload(r=1)
    assert store.result(path("a")) is None
    assert store.result(qid) is not None


def test_result_by_external_id_reads_many(store: QueueStore) -> None:
    qid = store.add(path("a"), payload(), external_id="req-1").id
    store.ack(qid, payload(r=1))
    for _ in range(3):
        got = store.result(path("a"), external_id="req-1")
        assert got is not None and got.id == qid
    # the path read falls through to path rules once the external id misses
    assert store.result(path("a"), external_id="req-2") is None


def test_result_for_another_external_id_is_not_served(store: QueueStore) -> None:
    qid = store.add(path("a"), payload(), external_id="req-1").id
    store.ack(qid, payload(r=1))
    assert store.result(path("a"), external_id="req-2") is None
    got = store.result(path("a"))  # no external id given: path rules
    assert got is not None and got.external_id == "req-1"


def test_latest_result_for_a_path_wins(store: QueueStore) -> None:
    first = store.add(path("a"), payload()).id
    store.ack(first, payload(run=1))
    second = store.add(path("a"), payload()).id
    store.ack(second, payload(run=2))
    got = store.result(path("a"))
    assert got is not None and got.id == second and got.payload == payload(run=2)


def test_results_expire_after_their_ttl(make_store: StoreFactory, clock: ManualClock) -> None:
    store = make_store(result_ttl_ms=1_000)
    qid = store.add(path("a"), payload()).id
    store.ack(qid, payload(r=1))
    clock.advance(999)
    assert store.result(qid) is not None
    clock.advance(1)
    assert store.result(qid) is None
    assert store.result(path("a")) is None


def test_expired_results_are_purged_by_later_acks(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    store = make_store(result_ttl_ms=1_000)
    old = store.add(path("old"), payload()).id
    store.ack(old, payload(r=1))
    clock.advance(2_000)
    new = store.add(path("new"), payload()).id
    store.ack(new, payload(r=2))
    clock.set(clock.now_ms() - 2_000)  # look back in time: the old row must be gone, not hidden
    assert store.result(old) is None
    assert store.result(new) is not None


def test_expired_results_behind_a_lower_id_not_yet_expired_are_purged(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    """An item that waited longer than those after it (a lower priority) is acked last:
    its result, the lowest id, expires last. The results after it are purged when they
    expire all the same, and it is kept until it does."""
    store = make_store(result_ttl_ms=1_000)
    start = clock.now_ms()
    waited = store.add(path("waited"), payload()).id
    later = [store.add(path(f"later{i}"), payload(), priority=5).id for i in range(3)]
    for qid in later:
        store.ack(qid, payload(q=qid))
    clock.advance(500)
    store.ack(waited, payload(q=waited))
    clock.set(start + 1_000)  # `later` expired, `waited` not
    assert store.purge_expired() == 3
    clock.set(start)  # look back in time: the expired rows must be gone, not hidden
    assert [qid for qid in later if store.result(qid) is not None] == []
    assert store.result(waited) is not None


def test_acks_purge_at_most_once_a_second_unless_a_backlog_is_left(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    """An ACK purges expired results when its last purge is a second old (store time), or
    when that purge found a full batch: the rest go with the next ACK, not a second later.
    (Reads never see an expired result; looking back in time shows what is still kept.)"""
    store = make_store(result_ttl_ms=1)
    start = clock.now_ms()

    def acked(key: str) -> int:
        qid = store.add(path(key), payload()).id
        store.ack(qid, payload(k=key))
        return qid

    first = acked("first")  # purges (nothing): the next purge is due a second later
    clock.advance(10)
    second = acked("second")  # not due: `first`, expired, is still kept
    clock.set(start)
    assert store.result(first) is not None
    clock.set(start + 1_000)
    backlog = [acked(f"b{i}") for i in range(70)]  # the first of these purged both
    clock.set(start)
    assert store.result(first) is None and store.result(second) is None
    clock.set(start + 2_000)
    acked("x")  # purges 64 of the backlog: a full batch, so the next ACK purges again
    acked("y")
    clock.set(start + 1_000)
    assert [qid for qid in backlog if store.result(qid) is not None] == []


async def test_result_blocking_returns_existing_result_at_once(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    store.ack(qid, payload(r=1))
    got = await store.result_blocking(qid, 10_000)
    assert got is not None and got.payload == payload(r=1)


async def test_result_blocking_is_woken_by_ack_for_every_waiter(store: QueueStore) -> None:
    qid = store.add(path("a"), payload(), external_id="req").id
    waiters = [asyncio.create_task(store.result_blocking(qid, 10_000)) for _ in range(3)]
    waiters.append(asyncio.create_task(store.result_blocking(path("a"), 10_000)))
    await wait_until(lambda: store.waiters.count() == 4)
    store.retrieve(qid)
    assert store.ack(qid, payload(r=7)).success
    results = await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert [(r.id, r.payload, r.external_id) for r in results if r] == [
        (qid, payload(r=7), "req")
    ] * 4
    assert store.waiters.count() == 0


async def test_result_blocking_times_out_with_none(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    assert await store.result_blocking(qid, 20) is None
    assert store.waiters.count() == 0
    assert keys(store.pending(P)) == ["a"]


async def test_result_blocking_ack_with_null_answers_a_row_without_payload(
    store: QueueStore,
) -> None:
    qid = store.add(path("a"), payload()).id
    waiter = asyncio.create_task(store.result_blocking(qid, 10_000))
    await wait_until(lambda: store.waiters.count() == 1)
    store.ack(qid, None)
    got = await asyncio.wait_for(waiter, 5)
    assert got is not None and got.payload is None and got.id == qid


async def test_result_blocking_by_path_takes_the_row_by_id_leaves_it(store: QueueStore) -> None:
    by_id = store.add(path("a"), payload()).id
    waiter = asyncio.create_task(store.result_blocking(by_id, 10_000))
    await wait_until(lambda: store.waiters.count() == 1)
    store.ack(by_id, payload(r=1))
    await asyncio.wait_for(waiter, 5)
    assert store.result(by_id) is not None

    by_path = store.add(path("b"), payload()).id
    waiter = asyncio.create_task(store.result_blocking(path("b"), 10_000))
    await wait_until(lambda: store.waiters.count() == 1)
    store.ack(by_path, payload(r=2))
    await asyncio.wait_for(waiter, 5)
    assert store.result(by_path) is None


async def test_an_ack_takes_the_result_for_a_waiter_by_id_in_its_own_transaction(
    store: QueueStore,
) -> None:
    """Decide, then act: the ACK that wakes a waiter by id consumes the path result in
    its own transaction. Before the waiter even runs, a read by path finds it taken and a
    read by id still reads it; the woken waiter gets it."""
    qid = store.add(path("a"), payload()).id
    found, waiter = store.result_blocking_start(qid, 10_000)
    assert found is None and waiter is not None
    try:
        assert store.ack(qid, payload(r=3)).success
        event = await asyncio.wait_for(waiter.future, 5)
    finally:
        store.waiters.unsubscribe(waiter)
    assert store.result(path("a")) is None
    assert store.result(qid) is not None
    if event.result is not None and event.taken:  # (another host's NOTIFY has it fetched)
        woken = store.result_blocking_woken(qid, event)
        assert (woken.id, woken.payload) == (qid, payload(r=3))

    # With nobody waiting, the result stays for its first reader by path.
    other = store.add(path("b"), payload()).id
    store.ack(other, payload(r=4))
    got = store.result(path("b"))
    assert got is not None and got.payload == payload(r=4)


async def test_result_blocking_cancelled_leaves_no_waiter(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    waiter = asyncio.create_task(store.result_blocking(qid, 60_000))
    await wait_until(lambda: store.waiters.count() == 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert store.waiters.count() == 0
    assert store.ack(qid, payload()).success


async def test_describe_counts_the_results_held_until_they_are_purged(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    """Every result stored counts, read or not, until it is purged; PostgreSQL's count is
    its statistics' (every host's writes, a moment late), so it is waited for."""
    store = make_store(result_ttl_ms=1_000)
    for i in range(3):
        store.ack(store.add(path(f"r{i}"), payload()).id, payload(r=i))
    store.ack(store.add(path("none"), payload()).id, None)  # no result row
    assert store.result(path("r0")) is not None  # read: still held until it expires
    await wait_until(lambda: store.describe()["results_held"] == 3, within=30)
    clock.advance(1_001)
    while store.purge_expired():
        pass
    await wait_until(lambda: store.describe()["results_held"] == 0, within=30)
