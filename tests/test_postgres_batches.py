"""How the PostgreSQL store runs a batch: savepoints only when a command fails, the reads of
its ADDs and ACKs sent together with its first statements, the pool retrieval read with
them."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from queryqueue import StoreError
from queryqueue.engine.clock import ManualClock
from tests.batches import answers_or_errors
from tests.postgres_hosts_util import recorded_statements


def _recording_waits(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`recorded_statements`'s statements, with "<wait>" where the thread waited for an answer not
    in yet (psycopg's pipeline then sends what is queued and waits for it)."""
    from psycopg import _pipeline_base

    events = recorded_statements(store, monkeypatch)
    fetch = _pipeline_base.BasePipeline._fetch_gen

    def waited(self: Any, *args: Any, flush: bool = False) -> Any:
        if flush:
            events.append("<wait>")
        return fetch(self, *args, flush=flush)

    monkeypatch.setattr(_pipeline_base.BasePipeline, "_fetch_gen", waited)
    return events


def test_a_batch_that_does_not_fail_takes_no_savepoint_and_writes_counts_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch runs first without savepoints: one whose commands all succeed sends no
    SAVEPOINT; the prefix's counts are written once, as it commits, and that write
    returns the transaction's id (no statement of its own for it). A command that fails
    after writing has the batch run again, each command in a savepoint of its own, and
    the counts stay true."""
    from queryqueue.driver_postgres.transaction import PostgresTransaction
    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        store.add("p:a", "{}")
        statements = recorded_statements(store, monkeypatch)
        answers = store.batched(
            lambda: [store.add("p:b", "{}"), store.add("p:c", "{}"), store.retrieve("p:a")],
            lambda _: None,
        )
        assert [a.added for a in answers[:2]] == [True, True] and answers[2].payload is not None
        assert not [s for s in statements if "SAVEPOINT" in s]
        assert len([s for s in statements if "prefix_counts" in s]) == 1
        assert not [s for s in statements if "txid_current_if_assigned" in s]
        # Its id known (the inserts returned it), COMMIT went with the pipeline's end.
        assert statements[-1] == "COMMIT"
        statements.clear()
        acked = store.batched(lambda: store.ack("p:a", '"done"'), lambda _: None)
        assert acked.success and statements[-1] == "COMMIT"  # the id came with the find
        assert not [s for s in statements if "txid_current_if_assigned" in s]
        store.retrieve("p:b")
        assert store.add("p:d", "{}").pending == 2  # c, d; b is active

        statements.clear()

        def failing(self: PostgresTransaction, item: Any, now: int) -> None:
            self._write("UPDATE items SET heartbeat = 1 / 0 WHERE id = %s", (item.id,))

        monkeypatch.setattr(PostgresTransaction, "set_heartbeat", failing)
        answers = store.batched(
            lambda: answers_or_errors(
                lambda: store.add("p:e", "{}"),
                lambda: store.heartbeat("p:b"),
                lambda: store.add("p:f", "{}"),
            ),
            lambda _: None,
        )
        assert isinstance(answers[1], StoreError) and answers[0].added and answers[2].added
        assert [s.split()[0] for s in statements if "SAVEPOINT" in s] == [
            "SAVEPOINT",
            "ROLLBACK",
            "RELEASE",
        ]
        monkeypatch.undo()
        assert store.add("p:g", "{}").pending == 5  # c, d, e, f, g
        assert [row.id for row in store.active("p")] == ["b"]
    finally:
        store.close()


def test_an_adds_reads_go_to_the_database_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pipelined batch an ADD sends what it may read (the item at its path, the
    owner of its external id, the path's unread result) and the id it takes if it
    inserts with its lock, before it waits for any answer: one wait in all (four before:
    each read, then its INSERT's id). An ADD that joins reads the same way; the answers
    are those of reads made one by one."""
    import psycopg

    from queryqueue.driver_postgres.lean import Answer
    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        first = store.add("p:a", "{}")
        events = recorded_statements(store, monkeypatch)
        fetchone = psycopg.Cursor.fetchone

        def answered(self: psycopg.Cursor[Any]) -> Any:
            events.append("<answer>")
            return fetchone(self)

        monkeypatch.setattr(psycopg.Cursor, "fetchone", answered)
        answer_fetchone = Answer.fetchone

        def lean_answered(self: Answer) -> Any:
            events.append("<answer>")
            return answer_fetchone(self)

        monkeypatch.setattr(Answer, "fetchone", lean_answered)
        answers = store.batched(
            lambda: [
                store.add("p:b", "{}", external_id="e", if_no_result=True),
                store.add("p:a", "{}", if_no_result=True),
            ],
            lambda _: None,
        )
        monkeypatch.undo()
        assert answers[0].added and answers[0].pending == 2
        assert not answers[1].added and answers[1].id == first.id
        before_commit = events[: events.index("COMMIT")]
        sent_first = before_commit[: before_commit.index("<answer>")]
        for read in ("WHERE prefix = %s AND key = %s", "WHERE external_id", "FROM results"):
            assert [s for s in sent_first if read in s], (read, sent_first)
        # Waits: each run of answers read after statements were sent.
        waits = sum(
            1
            for i, event in enumerate(before_commit)
            if event == "<answer>" and before_commit[i - 1] != "<answer>"
        )
        assert waits == 2  # b's reads (its INSERT waits for nothing), a's reads
        assert [row.id for row in store.pending("p")] == ["a", "b"]
        assert store.add("p:c", "{}").pending == 3
    finally:
        store.close()


def test_a_batchs_acks_by_id_are_read_with_its_first_statements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The supervisor tells a batch what it will run (`expect`): the items its ACKs by
    queue id ask for are read right after the batch's prefix lock, so the ACKs wait for
    their reads together with the first command that waits: two waits for the database
    before the COMMIT here (the first ACK's, the ADD's reads), not three."""

    from tests.postgres_util import postgres_store

    # Time stands still: the ACK's purge of expired results (once a second) stays done.
    store = postgres_store(clock=ManualClock())
    try:
        store.ack(store.add("p:warm", "{}").id, None)  # the first ACK's purge, done
        a, b = store.add("p:a", "{}").id, store.add("p:b", "{}").id
        store.retrieve("p:a")
        store.retrieve("p:b")
        events = _recording_waits(store, monkeypatch)

        def work() -> list[Any]:
            store.expect([("ack", (a, '"ra"')), ("add", ("p:c", "{}")), ("ack", (b, None))])
            return [store.ack(a, '"ra"'), store.add("p:c", "{}"), store.ack(b, None)]

        answers = store.batched(work, lambda _: None, prefix="p")
        monkeypatch.undo()
        assert [answers[0].success, answers[1].added, answers[2].success] == [True] * 3
        before_commit = events[: events.index("COMMIT")]
        sent_first = before_commit[: before_commit.index("<wait>")]
        assert len([s for s in sent_first if "WHERE id = %s AND prefix = %s" in s]) == 2
        assert before_commit.count("<wait>") == 2, before_commit
        assert store.result(a) is not None
        assert [row.id for row in store.pending("p")] == ["c"] and not store.active("p")
    finally:
        store.close()


def test_a_batchs_adds_are_read_with_its_first_statements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Told the batch's commands with their keywords, as a supervisor tells them, the
    store sends the reads of its ADDs of other paths (their item, external id, unread
    result and the id each takes if it inserts) with the batch's first statements: three
    ADDs and a worker's ACK wait once for the database before the COMMIT, not three
    times, and answer as the in-memory store does, ids included. An ADD of a path seen
    before it in the batch reads in its turn (a wait of its own), and so do those after
    it: their ids stay in the batch's order. Told the commands without their keywords,
    each ADD reads in its turn."""

    from queryqueue.engine.memory_store import MemoryQueueStore
    from tests.postgres_util import postgres_store

    model = MemoryQueueStore(clock=ManualClock())
    store = postgres_store(clock=model.clock)
    try:
        for target in (model, store):
            target.ack(target.add("p:warm", "{}").id, None)  # the first ACK's purge, done
            target.ack(target.add("p:b", "{}").id, '"b"')  # an unread result to join
            target.retrieve(target.add("p:a", "{}").id)
        ack = 3
        script: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:c", "{}"), {"external_id": "e1", "if_no_result": True}),
            ("add", ("p:b", "{}"), {"if_no_result": True}),  # joins p:b's result
            ("add", ("p:d", "{}"), {"priority": 5}),
            ("ack", (ack, '"a"'), {}),
        ]
        again: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:e", "{}"), {}),
            ("add", ("p:e", "{}"), {}),  # its path seen: reads in its turn
            ("add", ("p:f", "{}"), {}),  # after it: in its turn too
        ]

        def run(
            commands: list[tuple[str, tuple[Any, ...], dict[str, Any]]], keywords: bool = True
        ) -> int:
            """The batch's answers checked; how many times it waited before its COMMIT."""
            expected = [getattr(model, name)(*args, **kw) for name, args, kw in commands]
            events = _recording_waits(store, monkeypatch)

            def work() -> list[Any]:
                store.expect(commands if keywords else [(name, a) for name, a, _ in commands])
                return [getattr(store, name)(*args, **kw) for name, args, kw in commands]

            answers = store.batched(work, lambda _: None, prefix="p")
            monkeypatch.undo()
            assert answers == expected
            return events[: events.index("COMMIT")].count("<wait>")

        assert run(script) == 1
        assert run(again) == 3
        # Told names and arguments only, each ADD reads in its turn.
        assert run([(name, (f"{args[0]}2", *args[1:]), kw) for name, args, kw in again], False) == 3
        assert run([("add", (f"p:g{n}", "{}"), {}) for n in range(3)], False) == 3
        assert store.result(ack) == model.result(ack)
        assert [row.id for row in store.pending("p")] == [row.id for row in model.pending("p")]
    finally:
        store.close()


def test_an_add_whose_result_expired_since_the_batch_read_ahead_reads_it_again() -> None:
    """A batch's ADDs read before its commands run: an unread result of an ADD's path
    that expires in between is read again (the ADD inserts, as in its turn it would),
    and the next ADDs then read in their turn, so their items still come after its (the
    ids they took ahead go unused)."""
    from tests.postgres_util import postgres_store

    clock = ManualClock()
    store = postgres_store(clock=clock, result_ttl_ms=5_000)
    try:
        store.ack(store.add("p:a", "{}").id, '"old"')  # unread until it expires
        clock.advance(4_999)
        commands: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:z", "{}"), {}),  # the batch's first: its ADDs' reads go with it
            ("add", ("p:a", "{}"), {"if_no_result": True}),
            ("add", ("p:b", "{}"), {}),
        ]

        def work() -> list[Any]:
            store.expect(commands)
            answers = []
            for _, args, kw in commands:
                answers.append(store.add(*args, **kw))
                clock.advance(1)  # the result expires after the reads, before its ADD
            return answers

        z, a, b = store.batched(work, lambda _: None, prefix="p")
        assert z.added and a.added and b.added and z.id < a.id < b.id
        assert [row.id for row in store.pending("p")] == ["z", "a", "b"]
    finally:
        store.close()


def test_an_add_not_the_one_the_batch_was_told_of_reads_in_its_turn() -> None:
    """`expect` is a hint: an ADD that runs with other keywords than the batch was told
    (another external id; without if_no_result) reads in its turn, and so do the ADDs
    after it: the answers are those of the commands run one by one, and the items come
    in the batch's order (the ids read ahead for what was told go unused)."""
    from queryqueue.engine.memory_store import MemoryQueueStore
    from tests.postgres_util import postgres_store

    model = MemoryQueueStore(clock=ManualClock())
    store = postgres_store(clock=model.clock)
    try:
        for target in (model, store):
            target.ack(target.add("p:r", "{}").id, '"r"')  # an unread result, told joined
            target.add("p:x", "{}", external_id="e1")
        told: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:a", "{}"), {"external_id": "e2"}),
            ("add", ("p:r", "{}"), {"if_no_result": True}),
            ("add", ("p:b", "{}"), {}),
        ]
        run: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:a", "{}"), {"external_id": "e1"}),  # taken: refused
            ("add", ("p:r", "{}"), {}),  # not joining the result: inserts, in its turn
            ("add", ("p:b", "{}"), {}),
        ]
        expected = answers_or_errors(
            *(functools.partial(getattr(model, name), *args, **kw) for name, args, kw in run)
        )

        def work() -> list[Any]:
            store.expect(told)
            return answers_or_errors(
                *(functools.partial(getattr(store, name), *args, **kw) for name, args, kw in run)
            )

        got = store.batched(work, lambda _: None, prefix="p")
        assert [type(a) for a in got] == [type(a) for a in expected]
        assert [(a.added, a.pending) for a in got[1:]] == [
            (a.added, a.pending) for a in expected[1:]
        ]
        assert got[1].id < got[2].id
        assert [row.id for row in store.pending("p")] == [row.id for row in model.pending("p")]
    finally:
        store.close()


def test_the_pools_retrieval_is_read_with_the_batchs_first_statements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A supervisor's batch that frees a slot ends with its pool's retrieval; told so
    (`expect_retrieval`), the store reads the head of PENDING with the batch's lock and
    its ACKs' items, and keeps it up to date with the batch's own writes: an ADD, then a
    worker's ACK, then the retrieval wait once for the database before the COMMIT (the
    ADD's reads, which bring the rest), and the retrieval takes the ADD's item, of the
    highest priority, before the one queued earlier."""
    from tests.postgres_util import postgres_store

    # Time stands still: the ACK's purge of expired results (once a second) stays done.
    store = postgres_store(clock=ManualClock())
    try:
        store.ack(store.add("p:warm", "{}").id, None)  # the first ACK's purge, done
        a = store.add("p:a", "{}").id
        store.add("p:b", "{}")
        assert [r.id for r in store.retrieve_next("p", concurrency=1, process_id="pool")] == [a]
        events = _recording_waits(store, monkeypatch)

        def work() -> list[Any]:
            store.expect([("add", ("p:c", "{}")), ("ack", (a, '"ra"'))])
            store.expect_retrieval("p", "pool", 1)
            return [
                store.add("p:c", "{}", priority=5),
                store.ack(a, '"ra"'),
                store.retrieve_next("p", concurrency=1, process_id="pool"),
            ]

        added, acked, retrieved = store.batched(work, lambda _: None, prefix="p")
        monkeypatch.undo()
        assert added.added and acked.success
        assert [(r.key, r.id, r.pending) for r in retrieved] == [("c", added.id, 1)]
        before_commit = events[: events.index("COMMIT")]
        assert before_commit.count("<wait>") == 1, before_commit
        assert not [s for s in before_commit[before_commit.index("<wait>") :] if "LIMIT" in s]
        assert [row.id for row in store.pending("p")] == ["b"]
    finally:
        store.close()


def test_a_store_tells_whether_its_last_batch_left_a_prefix_with_nothing_pending() -> None:
    """`nothing_pending_seen`: what the counts of the last batch this store committed on
    a prefix said (a hint: another host may have added since); not known before one."""
    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        assert not store.nothing_pending_seen("p")
        first = store.batched(lambda: store.add("p:a", "{}"), lambda _: None, prefix="p")
        assert not store.nothing_pending_seen("p")  # one pending
        store.batched(
            lambda: store.retrieve_next("p", concurrency=1, process_id="pool"),
            lambda _: None,
            prefix="p",
        )
        assert store.nothing_pending_seen("p")  # active now
        assert not store.nothing_pending_seen("q")
        store.batched(lambda: store.ack(first.id, '"r"'), lambda _: None, prefix="p")
        assert store.nothing_pending_seen("p")
    finally:
        store.close()
