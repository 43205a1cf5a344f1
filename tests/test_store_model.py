"""Model-based test: random command sequences give identical responses on every store.

The in-memory store is the model; the SQLite store, and the PostgreSQL store, must answer
every command exactly as it does, errors included, and keep the queue's invariants after
every step.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from queryqueue import InvalidCommandError, MemoryQueueStore, QueueStore, SqliteQueueStore
from queryqueue.engine.clock import ManualClock
from tests.postgres_util import postgres_store
from tests.postgres_util import unavailable as postgres_unavailable

PREFIXES = ["a", "b"]
KEYS = ["k1", "k2", "k3", "k4", "k5", "x@p1"]
PROCESSES = [None, "p1", "p2"]
EXTERNAL_IDS = [None, "e1", "e2"]
POOL_PROCESS = "pool"  # the process a supervisor's pool retrieves for

paths = st.builds(lambda p, k: f"{p}:{k}", st.sampled_from(PREFIXES), st.sampled_from(KEYS))
queue_ids = st.integers(min_value=1, max_value=40)
queue_keys = st.one_of(paths, queue_ids)
# Mostly valid input, with enough bad input that error answers are compared too.
payloads = st.sampled_from(
    ['{"q":1}', '{"q":2}', "{}", '{"n":[1,2]}', '"text"', '{"q":3}', "{bad json"]
)
priorities = st.sampled_from([0, 0, 0, 1, 1, 10, -10000, 10000, 10001])
orphaned = st.sampled_from([None, None, 0, 1, 2.5, 10])
processes = st.sampled_from(PROCESSES)
timeouts = st.sampled_from([None, 0, 250, 1000, 3000])


def call(store: QueueStore, method: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return ("ok", getattr(store, method)(*args, **kwargs))
    except InvalidCommandError as exc:
        return ("error", type(exc).__name__, str(exc))


class StoresAgree(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.tmp = tempfile.TemporaryDirectory()
        self.stores: list[QueueStore] = [
            MemoryQueueStore(clock=self.clock, result_ttl_ms=5_000),
            self.make_store(),
        ]

    def make_store(self) -> QueueStore:
        return SqliteQueueStore(Path(self.tmp.name) / "q.db", clock=self.clock, result_ttl_ms=5_000)

    def teardown(self) -> None:
        for store in self.stores:
            store.close()
        self.tmp.cleanup()

    def same(self, method: str, *args: Any, **kwargs: Any) -> Any:
        answers = [call(store, method, *args, **kwargs) for store in self.stores]
        assert answers[0] == answers[1], f"{method}{args}{kwargs}: {answers}"
        return answers[0]

    @rule(ms=st.sampled_from([1, 250, 1000, 2500]))
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    @rule(
        path=paths,
        payload=payloads,
        priority=priorities,
        orphaned=orphaned,
        external_id=st.sampled_from(EXTERNAL_IDS),
        exclusive=st.sampled_from([False, False, False, True]),
        process_id=processes,
    )
    def add(self, **kwargs: Any) -> None:
        self.same("add", kwargs.pop("path"), kwargs.pop("payload"), **kwargs)

    @rule(
        path=paths,
        payload=payloads,
        concurrency=st.integers(0, 3),
        priority=priorities,
        orphaned=orphaned,
        external_id=st.sampled_from(EXTERNAL_IDS),
        exclusive=st.sampled_from([False, False, False, True]),
        process_id=processes,
    )
    def add_and_retrieve(self, **kwargs: Any) -> None:
        self.same(
            "add_and_retrieve",
            kwargs.pop("path"),
            kwargs.pop("payload"),
            kwargs.pop("concurrency"),
            **kwargs,
        )

    @rule(
        key=queue_keys, concurrency=st.integers(0, 3), extended=st.booleans(), process_id=processes
    )
    def retrieve(self, key: Any, concurrency: int, extended: bool, process_id: str | None) -> None:
        # An EXCLUSIVE item retrieved without a process id raises ExclusiveAccessError
        # (an InvalidCommandError): compared like any other answer.
        self.same(
            "retrieve", key, concurrency=concurrency, extended=extended, process_id=process_id
        )

    @rule(key=queue_keys, result=st.one_of(st.none(), payloads))
    def ack(self, key: Any, result: str | None) -> None:
        self.same("ack", key, result)

    @rule(
        key=queue_keys,
        external_id=st.sampled_from(EXTERNAL_IDS),
        consumer=st.sampled_from([None, None, "c1", "c2"]),
    )
    def result(self, key: Any, external_id: str | None, consumer: str | None) -> None:
        self.same("result", key, external_id=external_id, consumer=consumer)

    @rule(key=queue_keys)
    def get(self, key: Any) -> None:
        self.same("get", key)

    @rule(key=queue_keys)
    def cancel(self, key: Any) -> None:
        self.same("cancel", key)

    @rule(key=queue_keys)
    def heartbeat(self, key: Any) -> None:
        self.same("heartbeat", key)

    @rule(key=queue_keys, extra=st.sampled_from(['{"a":1}', '{"b":2,"a":3}', "null", "[1]", "{x"]))
    def merge_extra(self, key: Any, extra: str) -> None:
        self.same("merge_extra", key, extra)

    @rule(prefix=st.sampled_from(PREFIXES), with_payload=st.booleans(), process_id=processes)
    def list_items(self, prefix: str, with_payload: bool, process_id: str | None) -> None:
        self.same("list_items", prefix, with_payload=with_payload, process_id=process_id)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        process_id=processes,
        limit=st.one_of(st.none(), st.integers(0, 3)),
    )
    def pending(self, prefix: str, process_id: str | None, limit: int | None) -> None:
        self.same("pending", prefix, process_id=process_id, limit=limit)

    @rule(prefix=st.sampled_from(PREFIXES), process_id=processes)
    def active(self, prefix: str, process_id: str | None) -> None:
        self.same("active", prefix, process_id=process_id)

    @rule(prefix=st.sampled_from(PREFIXES), heartbeat=timeouts, orphaned=timeouts)
    def to_cancel(self, prefix: str, heartbeat: int | None, orphaned: int | None) -> None:
        self.same("to_cancel", heartbeat, orphaned, prefix)

    @rule()
    def truncate(self) -> None:
        self.same("truncate")

    @invariant()
    def counts_match_lists(self) -> None:
        for prefix in PREFIXES:
            for store in self.stores:
                # p1's view, and what only p2 sees (its exclusive items): every item once.
                seen = store.list_items(prefix, process_id="p1")
                ids = {row.queue_id for row in seen}
                everything = seen + [
                    row
                    for row in store.list_items(prefix, process_id="p2")
                    if row.queue_id not in ids
                ]
                pending = sum(row.status == "pending" for row in everything)
                probe = store.retrieve(f"{prefix}:__probe__", concurrency=10_000)
                assert probe is not None and probe.pending == pending
                active_keys = sorted(row.id for row in everything if row.status == "active")
                assert (
                    sorted((probe.active or "").split(",") if probe.active else []) == active_keys
                )


# Sequences a run of the suite tries: each run draws new ones, so the runs add up; raise it
# for a deeper search of one change (QQ_MODEL_EXAMPLES=5000).
MODEL_EXAMPLES = int(os.environ.get("QQ_MODEL_EXAMPLES", "600"))

TestStoresAgree = StoresAgree.TestCase
TestStoresAgree.settings = settings(
    max_examples=MODEL_EXAMPLES, stateful_step_count=30, deadline=None
)
# ~40 s alone on the 2-core machine, and a loaded one (CI's, the whole suite beside it)
# took it past the suite's 120 s hang guard: a generous guard of its own.
TestStoresAgree.pytestmark = [pytest.mark.timeout(420)]  # type: ignore[attr-defined]


class PostgresAgrees(StoresAgree):
    """The same machine with PostgreSQL as the store under test (a fresh schema each run)."""

    def make_store(self) -> QueueStore:
        store: QueueStore = postgres_store(clock=self.clock, result_ttl_ms=5_000)
        return store


TestPostgresAgrees = PostgresAgrees.TestCase
# Each run creates and drops a schema: a sixth of SQLite's runs.
TestPostgresAgrees.settings = settings(
    max_examples=max(1, MODEL_EXAMPLES // 6), stateful_step_count=30, deadline=None
)


# A batch adds a few items: ids past them would find nothing, and test little.
queue_ids_of_a_batch = st.integers(min_value=1, max_value=8)
batch_keys = st.one_of(paths, queue_ids_of_a_batch)
add_options = st.fixed_dictionaries(
    {},
    optional={
        "external_id": st.sampled_from(EXTERNAL_IDS),
        "if_no_result": st.booleans(),
        "priority": st.sampled_from([0, 1, 10]),
        # Another process's exclusive item: the pool's retrieval (`retrieve_next`) skips it.
        "exclusive": st.just(True),
        "process_id": st.sampled_from([POOL_PROCESS, "p2"]),
    },
)
command_lists = st.lists(
    st.one_of(
        st.tuples(st.just("add"), paths, payloads, add_options),
        st.tuples(st.just("retrieve"), batch_keys, st.integers(1, 3)),
        st.tuples(st.just("add_and_retrieve"), paths, st.integers(1, 3), add_options),
        st.tuples(st.just("ack"), batch_keys, st.sampled_from([None, '{"r":1}'])),
        st.tuples(st.just("cancel"), batch_keys),
        st.tuples(st.just("active"), st.sampled_from(PREFIXES)),
        st.tuples(st.just("result"), paths),
        st.tuples(st.just("heartbeat"), batch_keys),
        # What a supervisor's batches are made of: its workers' ACKs, by queue id.
        st.tuples(st.just("ack"), queue_ids_of_a_batch, st.just('{"r":2}')),
        st.tuples(st.just("retrieve"), queue_ids_of_a_batch, st.integers(1, 3)),
        # What a supervisor's batch ends with when it freed a slot or added work.
        st.tuples(st.just("retrieve_next"), st.sampled_from(PREFIXES), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=25,
)


# What the batch finds: a few items, some of them active.
setup_lists = st.lists(
    st.one_of(
        st.tuples(st.just("add"), paths, st.just("{}"), add_options),
        st.tuples(st.just("retrieve"), batch_keys, st.integers(1, 3)),
    ),
    min_size=2,
    max_size=10,
)


def _calls(commands: list[tuple[Any, ...]]) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """Each command as the store method's call: its name, arguments and keywords."""
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    for command in commands:
        name = command[0]
        if name == "add":
            calls.append((name, (command[1], command[2]), command[3]))
        elif name == "add_and_retrieve":
            calls.append((name, (command[1], "{}", command[2]), command[3]))
        elif name == "retrieve":
            calls.append((name, (command[1],), {"concurrency": command[2]}))
        elif name == "retrieve_next":
            calls.append(
                (name, (command[1],), {"concurrency": command[2], "process_id": POOL_PROCESS})
            )
        else:
            calls.append((name, tuple(command[1:]), {}))
    return calls


def _run_all(store: QueueStore, commands: list[tuple[Any, ...]]) -> list[Any]:
    return [call(store, name, *args, **kwargs) for name, args, kwargs in _calls(commands)]


@settings(max_examples=int(os.environ.get("QQ_BATCH_EXAMPLES", "30")), deadline=None)
@given(
    before=setup_lists,
    commands=command_lists,
    prefix=st.sampled_from([None, "a"]),
    keywords=st.booleans(),
)
def test_a_batch_answers_as_its_commands_one_by_one(
    before: list[tuple[Any, ...]],
    commands: list[tuple[Any, ...]],
    prefix: str | None,
    keywords: bool,
) -> None:
    """A store that batches (and keeps what it read of a locked prefix within a batch,
    or read ahead what the batch's commands will ask for) answers a sequence of commands
    run as one batch, on the state other commands left, exactly as the model answers
    them one by one, and commits the same state."""
    model = MemoryQueueStore(clock=ManualClock(), result_ttl_ms=5_000)
    with tempfile.TemporaryDirectory() as tmp:
        batching: list[QueueStore] = [
            SqliteQueueStore(Path(tmp) / "q.db", clock=model.clock, result_ttl_ms=5_000)
        ]
        if postgres_unavailable() is None:
            batching.append(postgres_store(clock=model.clock, result_ttl_ms=5_000))
        try:
            # Items 1 to 4 in prefix "a", then what `before` does: a batch's ACKs by id
            # (1 to 8) find what they ask for.
            before = [("add", f"a:k{n}", "{}", {}) for n in range(1, 5)] + before
            for store in (model, *batching):
                _run_all(store, before)
            expected = _run_all(model, commands)
            for store in batching:
                got = _batched(store, commands, prefix, keywords)
                assert got == expected, type(store).__name__
                for p in PREFIXES:
                    assert store.list_items(p) == model.list_items(p)
            for p in PREFIXES:  # the counts each store keeps, as the next commands see them
                probe = [("add", (f"{p}:probe", "{}")), ("retrieve", (f"{p}:probe",))]
                answers = [call(model, name, *args) for name, args in probe]
                for store in batching:
                    assert [call(store, name, *args) for name, args in probe] == answers
        finally:
            for store in batching:
                store.close()


def _expected(commands: list[tuple[Any, ...]], keywords: bool) -> list[tuple[Any, ...]]:
    """What a batch is told it will run: as a supervisor tells it (names, arguments and
    keywords: its ADDs' reads may go ahead too), or names and arguments only."""
    calls = _calls(commands)
    return calls if keywords else [(name, args) for name, args, _ in calls]


def _batched(
    store: QueueStore, commands: list[tuple[Any, ...]], prefix: str | None, keywords: bool
) -> list[Any]:
    def work() -> list[Any]:
        store.expect(_expected(commands, keywords))
        if prefix is not None:  # its pool's retrieval, whether the batch makes it or not
            store.expect_retrieval(prefix, POOL_PROCESS, 2)
        return _run_all(store, commands)

    return store.batched(work, lambda _: None, prefix)


# The commands a pool's batch is made of, all valid (an invalid one would have the batch
# run again guarded, where nothing is read ahead): what `_Head` must keep up with.
pool_adds = st.tuples(
    st.just("add"),
    st.builds(lambda k: f"a:{k}", st.sampled_from(["k1", "k2", "k3", "k4", "k5", "k6"])),
    st.just("{}"),
    st.fixed_dictionaries(
        {},
        optional={
            "priority": st.sampled_from([0, 1, 10]),
            "exclusive": st.just(True),
            "process_id": st.sampled_from([POOL_PROCESS, "p2"]),
        },
    ).filter(lambda options: "exclusive" not in options or "process_id" in options),
)
pool_commands = st.lists(
    st.one_of(
        pool_adds,
        st.tuples(st.just("ack"), queue_ids_of_a_batch, st.just('{"r":2}')),
        st.tuples(st.just("cancel"), queue_ids_of_a_batch),
        st.tuples(st.just("heartbeat"), queue_ids_of_a_batch),
        st.tuples(st.just("retrieve_next"), st.just("a"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=20,
)


@pytest.mark.skipif(postgres_unavailable() is not None, reason="no PostgreSQL")
@settings(max_examples=int(os.environ.get("QQ_BATCH_EXAMPLES", "30")), deadline=None)
@given(
    before=st.lists(pool_adds, min_size=0, max_size=12),
    commands=pool_commands,
    spare=st.sampled_from([0, 1, 8]),
    keywords=st.booleans(),
)
def test_a_pool_batch_retrieves_what_its_commands_one_by_one_would(
    before: list[tuple[Any, ...]], commands: list[tuple[Any, ...]], spare: int, keywords: bool
) -> None:
    """A supervisor's batch reads the head of PENDING for its pool's retrieval with its
    first statements (`expect_retrieval`), before its commands insert, activate, cancel
    or complete items: what the retrieval then takes, and every answer, are the model's
    for the commands run one by one; a full window that shrank below what is asked, or
    exclusive items of another process, change nothing of it."""
    model = MemoryQueueStore(clock=ManualClock(), result_ttl_ms=5_000)
    store = postgres_store(clock=model.clock, result_ttl_ms=5_000)
    try:
        for target in (model, store):
            _run_all(target, before)
        expected = _run_all(model, commands)

        def work() -> list[Any]:
            store.expect(_expected(commands, keywords))
            store.expect_retrieval("a", POOL_PROCESS, 1)
            return _run_all(store, commands)

        # A window (1 + spare rows) that fills up and shrinks past what is asked.
        with mock.patch("queryqueue.driver_postgres.pipelined.HEAD_SPARE", spare):
            assert store.batched(work, lambda _: None, "a") == expected
        assert store.list_items("a") == model.list_items("a")
        assert call(store, "retrieve_next", "a", concurrency=20, process_id=POOL_PROCESS) == (
            call(model, "retrieve_next", "a", concurrency=20, process_id=POOL_PROCESS)
        )
    finally:
        store.close()


# A supervisor's batch of requests: ADDs (the same path or external id again, bad input,
# unread results to join) and commands by path, then its workers' ACKs by queue id and
# its pool's retrieval. Its ADDs' reads go with its first statements (ahead.py) up to the
# first command that could change what they read.
a_paths = st.builds(lambda k: f"a:{k}", st.sampled_from(KEYS))
request_commands = st.lists(
    st.one_of(
        st.tuples(st.just("add"), a_paths, payloads, add_options),
        st.tuples(st.just("add"), a_paths, st.just("{}"), add_options),
        st.tuples(st.just("add_and_retrieve"), a_paths, st.integers(1, 3), add_options),
        st.tuples(st.just("result"), a_paths),
        st.tuples(st.just("ack"), a_paths, st.sampled_from([None, '{"r":1}'])),
        st.tuples(st.just("cancel"), a_paths),
        st.tuples(st.just("retrieve"), a_paths, st.integers(1, 3)),
    ),
    min_size=1,
    max_size=12,
)
batch_tails = st.lists(
    st.one_of(
        st.tuples(st.just("ack"), queue_ids_of_a_batch, st.just('{"r":2}')),
        st.tuples(st.just("retrieve_next"), st.just("a"), st.integers(1, 3)),
    ),
    max_size=3,
)
# Results to join or not: ACKed by path, some of them read since.
results_before = st.lists(
    st.one_of(
        st.tuples(st.just("add"), a_paths, st.just("{}"), add_options),
        st.tuples(st.just("ack"), a_paths, st.sampled_from([None, '{"r":0}'])),
        st.tuples(st.just("result"), a_paths),
    ),
    min_size=2,
    max_size=12,
)


@pytest.mark.skipif(postgres_unavailable() is not None, reason="no PostgreSQL")
@settings(max_examples=int(os.environ.get("QQ_BATCH_EXAMPLES", "30")), deadline=None)
@given(
    before=results_before,
    aged=st.sampled_from([0, 4_999, 5_000]),
    commands=request_commands,
    tail=batch_tails,
)
def test_a_batchs_adds_read_ahead_answer_as_they_would_one_by_one(
    before: list[tuple[Any, ...]],
    aged: int,
    commands: list[tuple[Any, ...]],
    tail: list[tuple[Any, ...]],
) -> None:
    """The reads of a batch's ADDs sent with its first statements, before any of its
    commands ran, give every answer the model gives for the commands run one by one
    (the ids included: none taken ahead for nothing, none out of turn), and leave the
    same items; `aged`: the results made before are about to expire, or just have."""
    clock = ManualClock()
    model = MemoryQueueStore(clock=clock, result_ttl_ms=5_000)
    store = postgres_store(clock=clock, result_ttl_ms=5_000)
    try:
        for target in (model, store):
            _run_all(target, before)
        clock.advance(aged)
        expected = _run_all(model, commands + tail)

        def work() -> list[Any]:
            store.expect(_expected(commands + tail, keywords=True))
            store.expect_retrieval("a", POOL_PROCESS, 2)
            return _run_all(store, commands + tail)

        assert store.batched(work, lambda _: None, "a") == expected
        assert store.list_items("a") == model.list_items("a")
        probe = [("add", ("a:probe", "{}")), ("retrieve", ("a:probe",))]
        assert [call(store, name, *args) for name, args in probe] == [
            call(model, name, *args) for name, args in probe
        ]
    finally:
        store.close()
