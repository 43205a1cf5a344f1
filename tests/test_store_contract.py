"""The queue store conformance suite: every test runs against every store implementation."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from queryqueue import (
    ExclusiveAccessError,
    ExternalIdConflictError,
    InvalidCommandError,
    QueueStore,
    StoreError,
)
from queryqueue.engine.clock import ManualClock
from queryqueue.engine.responses import (
    AckResponse,
    AddAndRetrieveResponse,
    AddToQueueResponse,
    ListResponse,
    QueryDefResponse,
    ResultStatus,
    RetrieveResponse,
    ToCancelResponse,
)
from tests.conftest import StoreFactory
from tests.waiting import wait_until

P = "q"


def path(key: str, prefix: str = P) -> str:
    return f"{prefix}:{key}"


def payload(**fields: object) -> str:
    return orjson.dumps(fields).decode()


def keys(rows: list[ListResponse]) -> list[str]:
    return [row.id for row in rows]


# -- ADD ----------------------------------------------------------------------------------


def test_add_assigns_increasing_ids_and_counts_pending(store: QueueStore) -> None:
    assert store.add(path("a"), payload(n=1)) == AddToQueueResponse(id=1, added=True, pending=1)
    assert store.add(path("b"), payload(n=2)) == AddToQueueResponse(id=2, added=True, pending=2)
    # pending is scoped to the prefix
    assert store.add(path("a", "other"), payload()) == AddToQueueResponse(
        id=3, added=True, pending=1
    )


def test_re_add_of_same_path_returns_existing_id_and_changes_nothing(store: QueueStore) -> None:
    first = store.add(path("a"), payload(v="first"), priority=1)
    again = store.add(path("a"), payload(v="second"), priority=9, external_id="ext-2")
    assert again == AddToQueueResponse(id=first.id, added=False, pending=1)
    assert store.get(path("a")) == QueryDefResponse(payload=payload(v="first"), extra=None)
    assert store.pending(P)[0].queue_id == first.id
    # the second caller's external id was not attached to the item
    store.ack(first.id, payload(r=1))
    assert store.result(path("zz"), external_id="ext-2") is None


def test_re_add_of_active_item_is_deduplicated(store: QueueStore) -> None:
    added = store.add(path("a"), payload())
    store.retrieve(path("a"), concurrency=1)
    assert store.add(path("a"), payload()) == AddToQueueResponse(
        id=added.id, added=False, pending=0
    )


def test_an_add_if_no_result_joins_an_unread_result_and_only_that(store: QueueStore) -> None:
    """Our extension: a caller's RESULT read came just before the ACK; its ADD then joins
    the answered item instead of running the query again. Cube's ADD (no flag) adds."""
    first = store.add(path("a"), payload()).id
    store.retrieve(path("a"), concurrency=1)
    store.ack(first, payload(r=1))
    for joined in (
        store.add(path("a"), payload(), if_no_result=True),
        store.add_and_retrieve(path("a"), payload(), 5, if_no_result=True),
    ):
        assert (joined.id, joined.added) == (first, False)
    assert store.list_items(P) == []  # nothing was queued
    found = store.result(first)  # by id, as the caller then reads it
    assert found is not None and found.payload == payload(r=1)
    # Read by path (consumed): a new ADD runs the query again, as any ADD does.
    assert store.result(path("a")) is not None
    again = store.add(path("a"), payload(), if_no_result=True)
    assert again.added and again.id != first
    # A result made for another external id is not this caller's.
    store.cancel(again.id)
    other = store.add(path("b"), payload(), external_id="ext-1").id
    store.ack(other, payload(r=3))
    mine = store.add(path("b"), payload(), external_id="ext-2", if_no_result=True)
    assert mine.added
    # Without the flag, Cube's ADD adds even beside an unread result.
    third = store.add(path("c"), payload()).id
    store.ack(third, payload(r=4))
    assert store.add(path("c"), payload()).added


def test_an_add_with_a_max_age_joins_a_result_read_already_while_it_is_young_enough(
    store: QueueStore, clock: ManualClock
) -> None:
    """A result read before answers an ADD whose caller accepts its age (`max_age_ms`),
    unread or not, by path or by id; one older than that, or one in shared memory once
    read, does not: the ADD inserts, and the query runs again."""
    first = store.add(path("a"), payload()).id
    store.ack(first, payload(r=1))
    assert store.result(path("a")) is not None  # read by path: consumed
    clock.advance(10_000)
    for joined in (
        store.add(path("a"), payload(), if_no_result=True, max_age_ms=10_001),
        store.add_and_retrieve(path("a"), payload(), 5, if_no_result=True, max_age_ms=60_000),
    ):
        assert (joined.id, joined.added) == (first, False)
    found = store.result(first)  # read many times by id, while it lives
    assert found is not None and found.payload == payload(r=1)
    assert store.list_items(P) == []
    # Without the flag the age asks nothing; past the age, the ADD inserts.
    assert store.add(path("b"), payload(), max_age_ms=60_000).added
    store.cancel(path("b"))
    too_old = store.add(path("a"), payload(), if_no_result=True, max_age_ms=10_000)
    assert too_old.added and too_old.id != first
    # A result in shared memory is a reference to bytes its read gave back: never reused.
    store.cancel(too_old.id)
    shared = store.add(path("s"), payload()).id
    store.ack(shared, '{"$shm": "qq-x", "gen": 1, "size": 10}')
    assert store.result(path("s")) is not None
    assert store.add(path("s"), payload(), if_no_result=True, max_age_ms=60_000).added
    with pytest.raises(InvalidCommandError, match="max_age_ms"):
        store.add(path("c"), payload(), if_no_result=True, max_age_ms=-1)
    assert [row.id for row in store.list_items(P)] == ["s"]


def test_ids_are_not_reused_after_ack_cancel_or_truncate(store: QueueStore) -> None:
    a = store.add(path("a"), payload()).id
    store.ack(a, None)
    b = store.add(path("a"), payload()).id
    store.cancel(b)
    store.truncate()
    c = store.add(path("a"), payload()).id
    assert a < b < c


def test_external_id_held_by_another_item_is_refused(store: QueueStore) -> None:
    store.add(path("a"), payload(), external_id="req-1")
    with pytest.raises(ExternalIdConflictError, match="req-1"):
        store.add(path("b"), payload(), external_id="req-1")
    assert keys(store.pending(P)) == ["a"]


# -- priority and order -----------------------------------------------------------------


def test_pending_is_priority_desc_then_fifo(store: QueueStore, clock: ManualClock) -> None:
    store.add(path("low"), payload(), priority=-5)
    store.add(path("mid1"), payload(), priority=0)
    store.add(path("high"), payload(), priority=10000)
    store.add(path("mid2"), payload(), priority=0)
    clock.advance(1)
    store.add(path("lowest"), payload(), priority=-10000)
    assert keys(store.pending(P)) == ["high", "mid1", "mid2", "low", "lowest"]
    assert keys(store.pending(P, limit=2)) == ["high", "mid1"]
    assert keys(store.list_items(P)) == ["high", "mid1", "mid2", "low", "lowest"]


def test_active_is_in_queue_id_order_and_list_shows_status(store: QueueStore) -> None:
    for name, priority in [("a", 0), ("b", 5), ("c", 1)]:
        store.add(path(name), payload(), priority=priority)
    store.retrieve(path("c"), concurrency=5)
    store.retrieve(path("a"), concurrency=5)
    assert keys(store.active(P)) == ["a", "c"]
    listed = store.list_items(P, with_payload=True)
    assert [(r.id, r.status) for r in listed] == [
        ("b", "pending"),
        ("c", "active"),
        ("a", "active"),
    ]
    assert all(r.payload == payload() for r in listed)
    assert all(r.payload is None for r in store.list_items(P))


# -- RETRIEVE ------------------------------------------------------------------------------


def test_retrieve_moves_pending_to_active(store: QueueStore) -> None:
    qid = store.add(path("a"), payload(q=1)).id
    store.add(path("b"), payload(q=2))
    got = store.retrieve(path("a"), concurrency=2)
    assert got == RetrieveResponse(payload=payload(q=1), extra=None, pending=1, active="a", id=qid)
    assert [(r.id, r.status) for r in store.list_items(P)] == [("a", "active"), ("b", "pending")]


def test_retrieve_respects_concurrency(store: QueueStore) -> None:
    for name in "abc":
        store.add(path(name), payload())
    assert store.retrieve(path("a"), concurrency=2) is not None
    assert store.retrieve(path("b"), concurrency=2) is not None
    failed = store.retrieve(path("c"), concurrency=2)
    assert failed == RetrieveResponse(payload=None, extra=None, pending=1, active="a,b", id=None)
    assert store.retrieve(path("c"), concurrency=2, extended=False) is None
    assert keys(store.pending(P)) == ["c"]


def test_retrieve_of_missing_or_active_item_fails(store: QueueStore) -> None:
    store.add(path("a"), payload())
    assert store.retrieve(path("a"), concurrency=5) is not None
    again = store.retrieve(path("a"), concurrency=5)
    assert again is not None and again.payload is None and again.active == "a"
    missing = store.retrieve(path("nope"), concurrency=5)
    assert missing == RetrieveResponse(payload=None, extra=None, pending=0, active="a", id=None)
    assert store.retrieve(99, concurrency=5) == RetrieveResponse(None, None, 0, None, None)


def test_requeue_gives_an_active_item_back_pending_and_retrievable(store: QueueStore) -> None:
    first = store.add(path("a"), payload(q=1), priority=5).id
    store.add(path("b"), payload(q=2))
    assert store.retrieve(path("a"), concurrency=1) is not None
    assert store.retrieve(path("b"), concurrency=1) is not None
    assert store.retrieve(path("b"), concurrency=1).payload is None  # type: ignore[union-attr]
    assert store.requeue(first) is True
    assert [(r.id, r.status) for r in store.list_items(P)] == [("a", "pending"), ("b", "pending")]
    assert keys(store.pending(P)) == ["a", "b"]  # its priority kept, ahead of b
    assert store.retrieve(path("a"), concurrency=1) is not None  # the slot it held is free
    assert store.add(path("a"), payload(q=1)).id == first  # the same item, joined
    assert store.requeue(path("b")) is False  # pending: nothing to give back
    assert store.requeue(path("nope")) is False
    assert store.requeue(first) is True and store.requeue(first) is False


def test_retrieve_by_queue_id(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    got = store.retrieve(qid, concurrency=1)
    assert got is not None and got.id == qid and got.active == "a"


def test_retrieve_returns_extra(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    store.merge_extra(qid, payload(note="x"))
    got = store.retrieve(path("a"))
    assert got is not None and got.extra == payload(note="x")


# -- retrieve_next (the pool's PENDING and RETRIEVE in one command) ------------------------------


def test_retrieve_next_takes_the_head_of_pending_while_there_is_a_slot(
    store: QueueStore, clock: ManualClock
) -> None:
    low = store.add(path("low"), payload(q="low"), priority=0).id
    clock.advance(1)
    high = store.add(path("high"), payload(q="high"), priority=5).id
    clock.advance(1)
    store.add(path("last"), payload(q="last"), priority=0)
    store.merge_extra(path("low"), payload(seen=1))
    store.add(path("other"), payload(), priority=9)  # not this prefix's
    store.add(path("elsewhere", "other"), payload(), priority=9)
    store.retrieve(path("other"), concurrency=5)  # one slot of three taken
    got = store.retrieve_next(P, concurrency=3, process_id="pool", start_query_time=77)
    # Priority first, then queue id; the pending count after each; extra as it was.
    assert [(n.key, n.id, n.pending, n.extra) for n in got] == [
        ("high", high, 2, None),
        ("low", low, 1, payload(seen=1)),
    ]
    assert [orjson.loads(n.payload)["q"] for n in got] == ["high", "low"]
    assert keys(store.active(P)) == ["low", "high", "other"]  # in queue id order
    assert keys(store.pending(P)) == ["last"]
    low_def = store.get(low)
    assert low_def is not None
    assert orjson.loads(low_def.extra or "null") == {"seen": 1, "startQueryTime": 77}
    # Full, or nothing pending: nothing retrieved, nothing written.
    assert store.retrieve_next(P, concurrency=3, process_id="pool") == []
    assert store.retrieve_next("empty", concurrency=3, process_id="pool") == []
    assert keys(store.pending(P)) == ["last"]
    with pytest.raises(InvalidCommandError, match="concurrency"):
        store.retrieve_next(P, concurrency=0, process_id="pool")


def test_retrieve_next_takes_nothing_below_its_priority_floor(store: QueueStore) -> None:
    """`min_priority`: the head of PENDING is taken down to that priority and no further
    (a supervisor filling a slot before the rest of its batch has run, whose ADDs may
    bring something more urgent), and an equal one still goes first (its queue id is lower
    than any ADD's to come); an impossible floor is refused."""
    store.add(path("high"), payload(), priority=5)
    store.add(path("mid"), payload(), priority=3)
    store.add(path("low"), payload(), priority=0)
    got = store.retrieve_next(P, concurrency=3, process_id="pool", min_priority=3)
    assert [n.key for n in got] == ["high", "mid"]
    assert store.retrieve_next(P, concurrency=3, process_id="pool", min_priority=1) == []
    assert keys(store.pending(P)) == ["low"]
    with pytest.raises(InvalidCommandError, match="priority"):
        store.retrieve_next(P, concurrency=3, process_id="pool", min_priority=10**9)
    assert [n.key for n in store.retrieve_next(P, concurrency=3, process_id="pool")] == ["low"]


def test_retrieve_next_skips_what_another_process_owns(store: QueueStore) -> None:
    """Another process's EXCLUSIVE item is not seen, another's persistent key (`hash@uid`)
    is not taken; this process's own of both are."""
    store.add(path("theirs@p2"), payload(), priority=9)
    store.add(path("their-stream"), payload(), priority=9, exclusive=True, process_id="p2")
    store.add(path("mine@p1"), payload(), priority=1)
    store.add(path("my-stream"), payload(), priority=1, exclusive=True, process_id="p1")
    store.add(path("plain"), payload(), priority=0)
    got = store.retrieve_next(P, concurrency=5, process_id="p1")
    assert [n.key for n in got] == ["mine@p1", "my-stream", "plain"]
    assert sorted(keys(store.pending(P, process_id="p2"))) == ["their-stream", "theirs@p2"]


# -- ADD_AND_RETRIEVE ------------------------------------------------------------------------


def test_retrieve_records_start_query_time_in_the_same_write(store: QueueStore) -> None:
    """Our extension: the retrieving write also merges `startQueryTime` into extra (what
    Cube's processQuery merges right after RETRIEVE), so no MERGE_EXTRA need follow."""
    store.add(path("a"), payload())
    store.merge_extra(path("a"), payload(seen=1))
    got = store.retrieve(path("a"), concurrency=2, start_query_time=1234)
    assert got is not None and got.extra == payload(seen=1)  # as it was, as RETRIEVE says
    recorded = store.get(path("a"))
    assert recorded is not None
    assert orjson.loads(recorded.extra or "null") == {"seen": 1, "startQueryTime": 1234}
    fast = store.add_and_retrieve(path("b"), payload(), 5, start_query_time=99)
    assert fast.payload is not None
    assert store.get(path("b")) == QueryDefResponse(payload(), '{"startQueryTime":99}')
    # Not retrieved, nothing recorded.
    store.add(path("c"), payload())
    store.add_and_retrieve(path("c"), payload(), 5, start_query_time=7)
    assert store.get(path("c")) == QueryDefResponse(payload(), None)
    with pytest.raises(InvalidCommandError, match="start_query_time"):
        store.retrieve(path("c"), concurrency=5, start_query_time=-1)
    assert keys(store.pending(P)) == ["c"]


def test_add_and_retrieve_takes_a_free_slot(store: QueueStore) -> None:
    got = store.add_and_retrieve(path("a"), payload(q=1), 2, priority=10)
    assert got == AddAndRetrieveResponse(
        id=got.id, added=True, pending=0, active="a", payload=payload(q=1), extra=None
    )
    assert [(r.id, r.status) for r in store.list_items(P)] == [("a", "active")]


def test_add_and_retrieve_without_listing_active_keys_retrieves_all_the_same(
    store: QueueStore,
) -> None:
    store.add_and_retrieve(path("a"), payload(q=1), 3)
    got = store.add_and_retrieve(path("b"), payload(q=2), 3, list_active=False)
    assert got == AddAndRetrieveResponse(
        id=got.id, added=True, pending=0, active=None, payload=payload(q=2), extra=None
    )
    assert store.add_and_retrieve(path("c"), payload(), 3).active == "a,b,c"
    with pytest.raises(InvalidCommandError, match="list_active must be true or false"):
        store.add_and_retrieve(path("d"), payload(), 3, list_active="no")  # type: ignore[arg-type]
    assert [r.id for r in store.list_items(P)] == ["a", "b", "c"]


def test_add_and_retrieve_leaves_a_slot_for_every_pending_item(store: QueueStore) -> None:
    store.add(path("waiting"), payload())  # pending 1, active 0
    got = store.add_and_retrieve(path("a"), payload(), 2)  # 0 + 1 < 2
    assert got.payload is not None and got.pending == 1
    got = store.add_and_retrieve(path("b"), payload(), 2)  # 1 + 1 == 2: stays pending
    assert got.payload is None and got.added and got.pending == 2 and got.active == "a"
    assert keys(store.pending(P)) == ["waiting", "b"]


def test_add_and_retrieve_burst_onto_idle_queue_takes_exactly_concurrency(
    store: QueueStore,
) -> None:
    retrieved = [
        store.add_and_retrieve(path(f"k{i}"), payload(), 3).payload is not None for i in range(7)
    ]
    assert retrieved == [True, True, True, False, False, False, False]
    assert len(store.active(P)) == 3 and len(store.pending(P)) == 4


def test_add_and_retrieve_of_existing_item_does_not_retrieve(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    got = store.add_and_retrieve(path("a"), payload(), 5)
    assert got == AddAndRetrieveResponse(
        id=qid, added=False, pending=1, active=None, payload=None, extra=None
    )
    assert keys(store.pending(P)) == ["a"]


# -- EXCLUSIVE -------------------------------------------------------------------------------


def test_exclusive_items_are_visible_and_retrievable_only_by_their_process(
    store: QueueStore,
) -> None:
    store.add(path("mine"), payload(), exclusive=True, process_id="p1")
    store.add(path("shared"), payload())
    assert keys(store.list_items(P, process_id="p1")) == ["mine", "shared"]
    assert keys(store.list_items(P, process_id="p2")) == ["shared"]
    assert keys(store.pending(P)) == ["shared"]
    failed = store.retrieve(path("mine"), concurrency=5, process_id="p2")
    assert failed is not None and failed.payload is None
    with pytest.raises(ExclusiveAccessError):
        store.retrieve(path("mine"), concurrency=5)
    assert store.retrieve(path("mine"), concurrency=5, process_id="p1") is not None
    assert keys(store.active(P, process_id="p1")) == ["mine"]
    assert keys(store.active(P, process_id="p2")) == []


def test_exclusive_needs_a_process_id(store: QueueStore) -> None:
    with pytest.raises(InvalidCommandError, match="EXCLUSIVE"):
        store.add(path("a"), payload(), exclusive=True)
    assert store.list_items(P) == []


def test_counts_ignore_exclusivity(store: QueueStore) -> None:
    store.add(path("x"), payload(), exclusive=True, process_id="p1")
    store.retrieve(path("x"), concurrency=1, process_id="p1")
    store.add(path("y"), payload())
    # another process's exclusive active item still takes the only slot
    failed = store.retrieve(path("y"), concurrency=1, process_id="p2")
    assert failed is not None and failed.payload is None and failed.active == "x"


# -- ACK and results ---------------------------------------------------------------------------


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


# -- RESULT_BLOCKING -----------------------------------------------------------------------------


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


# -- GET / CANCEL / HEARTBEAT / MERGE_EXTRA ------------------------------------------------


def test_get_by_path_and_id(store: QueueStore) -> None:
    qid = store.add(path("a"), payload(q=1)).id
    assert store.get(path("a")) == store.get(qid) == QueryDefResponse(payload(q=1), None)
    assert store.get(path("b")) is None and store.get(qid + 1) is None


def test_cancel_removes_pending_or_active_without_result(store: QueueStore) -> None:
    a = store.add(path("a"), payload(q="a")).id
    store.add(path("b"), payload(q="b"))
    store.retrieve(path("b"), concurrency=2)
    store.merge_extra(path("b"), payload(started=1))
    assert store.cancel(a) == QueryDefResponse(payload(q="a"), None)
    assert store.cancel(path("b")) == QueryDefResponse(payload(q="b"), payload(started=1))
    assert store.cancel(path("b")) is None
    assert store.list_items(P) == []
    assert store.result(a) is None
    # the freed slot can be taken
    store.add(path("c"), payload())
    assert store.retrieve(path("c"), concurrency=1) is not None


def test_merge_extra_merges_objects_shallowly(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    assert store.merge_extra(qid, payload(a=1, nested={"x": 1}))
    assert store.merge_extra(path("a"), payload(b=2, nested={"y": 2}))
    got = store.get(qid)
    assert got is not None and got.extra is not None
    assert orjson.loads(got.extra) == {"a": 1, "b": 2, "nested": {"y": 2}}
    assert store.merge_extra(qid, "[1,2]")
    assert store.get(qid) == QueryDefResponse(payload(), "[1,2]")
    assert store.merge_extra(qid, "null")
    assert store.get(qid) == QueryDefResponse(payload(), None)
    assert not store.merge_extra(999, payload(a=1))


def test_heartbeat_keeps_active_item_from_stalling(store: QueueStore, clock: ManualClock) -> None:
    qid = store.add(path("a"), payload()).id
    store.retrieve(qid)
    clock.advance(900)
    assert store.heartbeat(path("a"))
    clock.advance(900)
    assert store.stalled(1_000, P) == []
    clock.advance(101)
    assert store.stalled(1_000, P) == [ToCancelResponse("a", qid)]
    assert not store.heartbeat(999)


# -- ORPHANED / STALLED / TO_CANCEL ------------------------------------------------------------


def test_orphaned_pending_items_by_age_or_own_deadline(
    store: QueueStore, clock: ManualClock
) -> None:
    plain = store.add(path("plain"), payload()).id
    own = store.add(path("own"), payload(), orphaned=5).id  # deadline 5 s from now
    active = store.add(path("act"), payload()).id
    store.retrieve(active, concurrency=5)
    clock.advance(2_001)
    assert store.orphaned(2_000, P) == [ToCancelResponse("plain", plain)]
    clock.advance(2_999)  # exactly at own's deadline: not yet past it
    assert store.orphaned(2_000, P) == [ToCancelResponse("plain", plain)]
    clock.advance(1)  # past own's deadline; active items are never orphaned
    assert store.orphaned(2_000, P) == [
        ToCancelResponse("plain", plain),
        ToCancelResponse("own", own),
    ]


def test_re_add_extends_the_orphan_deadline_to_the_later_one(
    store: QueueStore, clock: ManualClock
) -> None:
    qid = store.add(path("a"), payload(), orphaned=2).id
    clock.advance(1_500)
    store.add(path("a"), payload(), orphaned=2)  # deadline moves to now + 2 s
    clock.advance(1_000)
    assert store.orphaned(60_000, P) == []
    store.add(path("a"), payload(), orphaned=0.5)  # earlier: ignored
    clock.advance(1_001)
    assert store.orphaned(60_000, P) == [ToCancelResponse("a", qid)]


def test_stalled_active_items_by_heartbeat(store: QueueStore, clock: ManualClock) -> None:
    a = store.add(path("a"), payload()).id
    store.add(path("b"), payload())
    store.retrieve(a, concurrency=5)
    clock.advance(1_001)
    # pending items never stall, whatever their age
    assert store.stalled(1_000, P) == [ToCancelResponse("a", a)]


def test_to_cancel_combines_and_ignores_visibility(store: QueueStore, clock: ManualClock) -> None:
    s = store.add(path("stalled"), payload(), exclusive=True, process_id="p1").id
    store.retrieve(s, concurrency=5, process_id="p1")
    o = store.add(path("orphan"), payload(), exclusive=True, process_id="p1").id
    clock.advance(5_000)
    fresh = store.add(path("fresh"), payload()).id
    got = store.to_cancel(1_000, 1_000, P)
    assert got == [ToCancelResponse("stalled", s), ToCancelResponse("orphan", o)]
    assert fresh not in [r.queue_id for r in got]
    assert store.to_cancel(None, None, P) == []
    assert store.to_cancel(1_000, None, "another-prefix") == []


def test_active_items_never_expire_silently(store: QueueStore, clock: ManualClock) -> None:
    qid = store.add(path("a"), payload()).id
    store.retrieve(qid)
    clock.advance(10 * 24 * 3600 * 1000)
    assert [r.queue_id for r in store.active(P)] == [qid]
    assert store.cancel(qid) is not None


# -- TRUNCATE -----------------------------------------------------------------------------------


def test_truncate_removes_items_and_results_of_every_prefix(store: QueueStore) -> None:
    a = store.add(path("a"), payload()).id
    store.add(path("b", "other"), payload())
    store.ack(a, payload(r=1))
    store.add(path("c"), payload())
    store.retrieve(path("c"))
    store.truncate()
    assert store.list_items(P) == [] and store.list_items("other") == []
    assert store.result(a) is None
    # counters were reset too
    assert store.add(path("d"), payload()).pending == 1
    assert store.retrieve(path("d"), concurrency=1) is not None


# -- bad input ----------------------------------------------------------------------------------

BAD_CALLS = [
    ("priority above range", lambda s: s.add(path("x"), payload(), priority=10_001), "priority"),
    ("priority below range", lambda s: s.add(path("x"), payload(), priority=-10_001), "priority"),
    ("priority not int", lambda s: s.add(path("x"), payload(), priority="1"), "priority"),
    ("payload not JSON", lambda s: s.add(path("x"), "{nope"), "payload"),
    ("payload not text", lambda s: s.add(path("x"), b"{}"), "payload"),
    ("empty path", lambda s: s.add("", payload()), "path"),
    ("path without prefix", lambda s: s.add("nocolon", payload()), "path"),
    ("path with empty key", lambda s: s.add("q:", payload()), "path"),
    ("over-long path", lambda s: s.add("q:" + "x" * 600, payload()), "path"),
    (
        "over-long external id",
        lambda s: s.add(path("x"), payload(), external_id="e" * 49),
        "external id",
    ),
    ("empty external id", lambda s: s.add(path("x"), payload(), external_id=""), "external id"),
    ("negative orphaned", lambda s: s.add(path("x"), payload(), orphaned=-1), "orphaned"),
    ("zero concurrency", lambda s: s.add_and_retrieve(path("x"), payload(), 0), "concurrency"),
    ("retrieve zero concurrency", lambda s: s.retrieve(path("a"), concurrency=0), "concurrency"),
    ("unknown id form", lambda s: s.get(0), "queue id"),
    ("key of wrong type", lambda s: s.get(1.5), "path"),
    ("ack result not JSON", lambda s: s.ack(path("a"), "not json"), "result"),
    ("extra not JSON", lambda s: s.merge_extra(path("a"), "{"), "extra"),
    ("negative heartbeat timeout", lambda s: s.to_cancel(-1, 10, P), "heartbeat timeout"),
    ("negative orphaned timeout", lambda s: s.orphaned(-5, P), "orphaned timeout"),
    ("negative stalled timeout", lambda s: s.stalled(-5, P), "heartbeat timeout"),
    ("negative pending limit", lambda s: s.pending(P, limit=-1), "limit"),
    ("over-long process id", lambda s: s.list_items(P, process_id="p" * 97), "process id"),
    # Numbers out of range are named, never an OverflowError from the store underneath.
    ("huge orphaned", lambda s: s.add(path("x"), payload(), orphaned=1e308), "orphaned"),
    ("queue id past 64 bits", lambda s: s.get(2**63), "queue id"),
    ("ack id past 64 bits", lambda s: s.ack(2**63, None), "queue id"),
    ("huge heartbeat timeout", lambda s: s.to_cancel(2**62, 10, P), "heartbeat timeout"),
    ("huge concurrency", lambda s: s.retrieve(path("a"), concurrency=2**40), "concurrency"),
    # NUL cannot be stored by PostgreSQL: every store refuses it the same way.
    ("NUL in a prefix", lambda s: s.add("q\x00x:k", payload()), "prefix"),
    ("NUL in a key", lambda s: s.add("q:k\x00", payload()), "path"),
    (
        "NUL in an external id",
        lambda s: s.add(path("x"), payload(), external_id="e\x00"),
        "external id",
    ),
]


@pytest.mark.parametrize(("case", "call", "named"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_by_name_and_changes_nothing(
    store: QueueStore, case: str, call: object, named: str
) -> None:
    qid = store.add(path("a"), payload(q=1), orphaned=30).id
    store.add(path("b"), payload(q=2))
    store.retrieve(path("b"), concurrency=5)
    before = (store.list_items(P, with_payload=True), store.get(qid))
    assert callable(call)
    with pytest.raises(InvalidCommandError, match=named):
        call(store)
    assert (store.list_items(P, with_payload=True), store.get(qid)) == before


async def test_bad_result_blocking_input(store: QueueStore) -> None:
    with pytest.raises(InvalidCommandError, match="timeout"):
        await store.result_blocking(1, -1)
    assert store.waiters.count() == 0


def test_refreshing_heartbeats_after_an_outage_spares_active_items(
    store: QueueStore, clock: ManualClock
) -> None:
    running = store.add(path("running"), payload()).id
    store.retrieve(running, concurrency=5)
    store.add(path("waiting"), payload())
    clock.advance(10_000)  # the store was down: nobody could heartbeat
    assert store.refresh_active_heartbeats() == 1
    assert store.stalled(1_000, P) == []
    clock.advance(1_001)  # and a dead executor is still reaped one timeout later
    assert store.stalled(1_000, P) == [ToCancelResponse("running", running)]
    assert [row.status for row in store.list_items(P)] == ["active", "pending"]


async def test_result_blocking_by_id_takes_the_result_whether_the_ack_came_first_or_not(
    store: QueueStore,
) -> None:
    # ACK first, then the waiter by id: it takes the path result, as a woken waiter does.
    qid = store.add(path("a"), payload()).id
    store.ack(qid, payload(r=1))
    got = await store.result_blocking(qid, 1000)
    assert got is not None and got.payload == payload(r=1)
    assert store.result(path("a")) is None
    assert store.result(qid) is not None  # by id it still reads


# -- batches (group commit) ---------------------------------------------------------------------


def test_a_batch_commits_its_commands_and_undoes_a_failing_one_alone(store: QueueStore) -> None:
    """A server runs what arrived together as one batch: one transaction, each command
    still atomic on its own. A command that fails (first in the batch, or later) leaves
    nothing behind, and the others stand, counts included."""
    store.add(path("held", "other"), payload(), external_id="taken")

    def work() -> list[object]:
        outcomes: list[object] = []
        for key in ("first-fails", "a", "later-fails", "b"):
            try:
                external_id = "taken" if key.endswith("fails") else None
                outcomes.append(store.add(path(key), payload(), external_id=external_id).id)
            except ExternalIdConflictError as exc:
                outcomes.append(exc)
        outcomes.append(store.retrieve(path("a"), concurrency=5) is not None)
        return outcomes

    undone: list[object] = []
    outcomes = store.batched(work, undone.append)
    assert [type(o) for o in outcomes] == [
        ExternalIdConflictError,
        int,
        ExternalIdConflictError,
        int,
        bool,
    ]
    assert outcomes[-1] is True and undone == []
    assert keys(store.pending(P)) == ["b"]
    assert keys(store.active(P)) == ["a"]
    assert store.add(path("c"), payload()).pending == 2  # the counts hold the batch's changes
    # The failed ones are gone for good: their paths add afresh.
    assert store.add(path("first-fails"), payload()).added


async def test_before_commit_runs_once_after_the_batchs_commands_before_its_waiters_wake(
    store: QueueStore, caplog: pytest.LogCaptureFixture
) -> None:
    """`before_commit` inside a batch: once, after the batch's commands ran and before it
    committed (its waiters are not woken yet); outside a batch, or in a batch that fails,
    never. One that raises is logged, and the batch commits. A store that does not call
    it (in memory: it has no COMMIT) drops it."""
    commits = type(store).before_commit is not QueueStore.before_commit
    qid = store.add(path("a"), payload()).id
    found, waiter = store.result_blocking_start(qid, 10_000)
    assert found is None and waiter is not None
    seen: list[str] = []
    try:
        store.before_commit(lambda: seen.append("outside"))

        def failing() -> None:
            store.before_commit(lambda: seen.append("failed"))
            raise StoreError("the batch fails")

        with pytest.raises(StoreError):
            store.batched(failing, lambda _: None)

        def fails() -> None:
            raise RuntimeError("a hand-off failed")

        def work() -> bool:
            store.before_commit(fails)  # logged: the COMMIT and the next callback go ahead
            store.before_commit(lambda: seen.append(f"woken={waiter.future.done()}"))
            seen.append("commands")
            return store.ack(qid, payload(r=1)).success

        with caplog.at_level(logging.ERROR):
            assert store.batched(work, lambda _: None)
        assert ("a hand-off failed" in caplog.text) is commits
        assert seen == (["commands", "woken=False"] if commits else ["commands"])
        event = await asyncio.wait_for(waiter.future, 10)
        assert event.id == qid
        store.batched(lambda: store.add(path("b"), payload()), lambda _: None)
        assert seen == (["commands", "woken=False"] if commits else ["commands"])  # once
    finally:
        store.waiters.unsubscribe(waiter)


async def test_a_batch_wakes_its_waiters_once_it_committed(store: QueueStore) -> None:
    qid = store.add(path("a"), payload()).id
    found, waiter = store.result_blocking_start(qid, 10_000)
    assert found is None and waiter is not None
    try:
        seen_inside: list[bool] = []

        def work() -> bool:
            acked = store.ack(qid, payload(r=1)).success
            seen_inside.append(waiter.future.done())
            return acked

        assert store.batched(work, lambda _: None)
        if type(store).batch is not QueueStore.batch:  # a store that batches (not memory)
            assert seen_inside == [False]
        event = await asyncio.wait_for(waiter.future, 10)
        assert event.id == qid
        found = store.result(qid)
        assert found is not None and found.payload == payload(r=1)
    finally:
        store.waiters.unsubscribe(waiter)
