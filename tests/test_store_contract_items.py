"""The queue store conformance suite, its items after they are queued: GET, CANCEL,
MERGE_EXTRA, heartbeats, orphaned and stalled items, TRUNCATE, bad input and batches, on
every store implementation."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from queryqueue import ExternalIdConflictError, InvalidCommandError, QueueStore, StoreError
from queryqueue.engine.clock import ManualClock
from queryqueue.engine.responses import QueryDefResponse, ToCancelResponse
from tests.store_contract_util import P, keys, path, payload

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


def test_describe_says_each_prefixs_oldest_item_whatever_its_priority_or_status(
    store: QueueStore, clock: ManualClock
) -> None:
    store.add(path("low"), payload(), priority=-5)
    clock.advance(1_000)
    store.add(path("high"), payload(), priority=10)
    clock.advance(1_000)
    store.add(path("mid"), payload(), priority=5)
    store.add(path("other", "r"), payload())
    store.retrieve(path("high"), concurrency=5)
    clock.advance(1_000)

    def ages() -> dict[str, int]:
        return {p["prefix"]: p["oldest_age_ms"] for p in store.describe()["prefixes"]}

    assert ages() == {P: 3_000, "r": 1_000}
    store.cancel(path("low"))
    assert ages() == {P: 2_000, "r": 1_000}  # the active one, now
    store.ack(path("high"), payload())
    assert ages() == {P: 1_000, "r": 1_000}
