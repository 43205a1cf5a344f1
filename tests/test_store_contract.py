"""The queue store conformance suite: every test runs against every store implementation.
This part: ADD, RETRIEVE and ADD_AND_RETRIEVE; the results and the items after they are
queued have their own parts."""

from __future__ import annotations

import orjson
import pytest

from queryqueue import (
    ExclusiveAccessError,
    ExternalIdConflictError,
    InvalidCommandError,
    QueueStore,
)
from queryqueue.engine.clock import ManualClock
from queryqueue.engine.responses import (
    AddAndRetrieveResponse,
    AddToQueueResponse,
    QueryDefResponse,
    RetrieveResponse,
)
from tests.store_contract_util import P, keys, path, payload


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
