"""A process writing through the SQLite store is `kill -9`ed mid-stream: every command it saw
commit is there after reopening, and no command is there in part."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from queryqueue import SchemaVersionError, SqliteQueueStore, StoreError
from tests.batches import answers_or_errors

WRITER = textwrap.dedent(
    """
    import sys
    from queryqueue.driver_sqlite.store import SqliteQueueStore

    mode = sys.argv[2]
    store = SqliteQueueStore(
        sys.argv[1],
        synchronous=mode.partition("-")[0],
        sync_in_background=mode.endswith("-in-background"),
        checkpoint_every_s=float(sys.argv[3]),
        wal_cap_pages=int(sys.argv[4]),
    )
    out = sys.stdout
    i = 0
    while True:  # runs until killed
        path = f"d:{i}"
        qid = store.add(path, '{"i": %d}' % i, priority=i % 7, orphaned=60).id
        out.write(f"add {i} {qid}\\n")
        if i % 3 == 0:
            store.retrieve(path, concurrency=1_000_000)
            out.write(f"retrieve {i} {qid}\\n")
            store.ack(qid, '{"result": %d}' % i)
            out.write(f"ack {i} {qid}\\n")
        elif i % 3 == 1:
            store.merge_extra(qid, '{"seen": %d}' % i)
            out.write(f"extra {i} {qid}\\n")
        out.write(f"checkpoints {store.checkpointer.rounds} {store.checkpointer.folds}\\n")
        out.flush()
        i += 1
    """
)


# FULL-in-background: a command returns before its commit is synced (the supervisor holds
# its answer until it is): a kill -9 must lose none of them all the same.
@pytest.mark.parametrize("synchronous", ["NORMAL", "FULL", "FULL-in-background"])
@pytest.mark.parametrize(
    "checkpoints",
    [(0.25, 16_384), (0.0005, 8)],
    ids=["default-checkpoints", "checkpointing-and-folding-throughout"],
)
def test_kill_9_loses_no_committed_command_and_leaves_none_partial(
    tmp_path: Path, synchronous: str, checkpoints: tuple[float, int]
) -> None:
    """The kill lands anywhere: in a command, a COMMIT, the checkpoint thread's round or
    the writer's fold of the WAL (the second case does both all the time)."""
    db = tmp_path / "queue.db"
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db), synchronous, *map(str, checkpoints)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        seen: list[str] = []
        deadline = time.monotonic() + 60
        # Past its cap at once: the kill comes once the writer has folded the WAL (after a
        # round of the thread, which is what finds it past its cap), and rounds go on.
        folding, folds = checkpoints[1] == 8, 0
        while sum(line.startswith("ack") for line in seen) < 40 or (folding and folds == 0):
            line = child.stdout.readline()
            assert line, f"writer exited early with {child.poll()}"
            seen.append(line)
            if line.startswith("checkpoints"):
                folds = int(line.split()[2])
            assert time.monotonic() < deadline, "writer too slow"
        os.kill(child.pid, signal.SIGKILL)
        rest, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    # Lines the child wrote before dying were all confirmed commits, flushed or not yet read.
    confirmed = [
        line.split()
        for line in seen + rest.splitlines(keepends=True)
        if line.endswith("\n") and not line.startswith("checkpoints")
    ]

    store = SqliteQueueStore(db)
    try:
        acked = {int(i) for op, i, _ in confirmed if op == "ack"}
        extra = {int(i) for op, i, _ in confirmed if op == "extra"}
        last = max(int(i) for _, i, _ in confirmed)
        for op, i_text, qid_text in confirmed:
            i, qid = int(i_text), int(qid_text)
            if op == "add" and i not in acked:
                got = store.get(qid)
                if got is None and i == last and i % 3 == 0:
                    # The kill fell between its ACK's commit and the line saying so: the
                    # ACK is whole (no item, its result kept), just not confirmed.
                    result = store.result(qid)
                    assert result is not None and result.payload == f'{{"result": {i}}}'
                    continue
                assert got is not None and orjson.loads(got.payload) == {"i": i}
            if op == "ack":
                assert store.get(qid) is None
                result = store.result(qid)
                assert result is not None and result.payload == f'{{"result": {i}}}'
            if op == "extra":
                got = store.get(qid)
                assert got is not None and got.extra == f'{{"seen": {i}}}'
        assert extra and acked
    finally:
        store.close()
    _assert_consistent(db)


def _assert_consistent(db: Path) -> None:
    """No half-applied command: an acked item has no row left. (The counters are counted
    from the rows as a store opens.)"""
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        both = conn.execute("SELECT count(*) FROM items JOIN results USING (id)").fetchone()
        assert both == (0,)
    finally:
        conn.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    SqliteQueueStore(db).close()
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 999")
    conn.close()
    with pytest.raises(SchemaVersionError, match="999"):
        SqliteQueueStore(db)


def test_a_new_database_has_small_pages_and_an_existing_one_keeps_its_own(
    tmp_path: Path,
) -> None:
    """A new database is made with the store's page size (its commits write smaller WAL
    frames); one made earlier with 4 KiB pages opens with them, its items intact."""
    from queryqueue.driver_sqlite.store import PAGE_SIZE

    big = orjson.dumps({"sql": "x" * 10_000}).decode()  # overflow pages too
    new = SqliteQueueStore(tmp_path / "new.db")
    try:
        new.add("p:a", big)
        assert new.connection.execute("PRAGMA page_size").fetchone() == (PAGE_SIZE,)
    finally:
        new.close()
    assert PAGE_SIZE != 4096
    old = tmp_path / "old.db"
    conn = sqlite3.connect(old)
    conn.execute("PRAGMA page_size = 4096")
    conn.execute("CREATE TABLE t (x)")  # the database exists: its page size is fixed
    conn.close()
    store = SqliteQueueStore(old)
    try:
        store.add("p:b", big)
    finally:
        store.close()
    store = SqliteQueueStore(old)
    try:
        assert store.connection.execute("PRAGMA page_size").fetchone() == (4096,)
        definition = store.get("p:b")
        assert definition is not None and definition.payload == big
    finally:
        store.close()
    again = SqliteQueueStore(tmp_path / "new.db")
    try:
        definition = again.get("p:a")
        assert definition is not None and definition.payload == big
    finally:
        again.close()


def _steps(store: SqliteQueueStore, run: Callable[[], object]) -> int:
    """SQLite virtual machine steps taken by `run` on the store's connection."""
    steps = 0

    def step() -> int:
        nonlocal steps
        steps += 1
        return 0

    store.connection.set_progress_handler(step, 1)
    try:
        run()
    finally:
        store.connection.set_progress_handler(None, 1)
    return steps


def _results(store: SqliteQueueStore, ids: range, expire: int) -> None:
    with store.connection:
        store.connection.executemany(
            "INSERT INTO results (id, path, value, deleted, expire) VALUES (?, ?, '1', 0, ?)",
            [(i, f"p:{i}", expire) for i in ids],
        )


def test_the_purge_reads_no_more_results_however_many_are_kept(tmp_path: Path) -> None:
    """No index on `expire` (each result's INSERT wrote a page of it): the purge walks the
    results from the lowest id and reads at most PURGE_WINDOW of them, so a table of
    results none of which has expired costs it the same at 6,000 rows as at 60,000. With
    expired ones first it stops at its batch, and it passes over up to PURGE_WINDOW not
    yet expired to reach those behind them."""
    from queryqueue.driver_sqlite.transaction import PURGE_WINDOW
    from queryqueue.engine.clock import ManualClock
    from queryqueue.engine.listing import PURGE_BATCH

    clock = ManualClock(1_000_000)
    small, large = (
        SqliteQueueStore(tmp_path / "s.db", clock=clock),
        SqliteQueueStore(tmp_path / "l.db", clock=clock),
    )
    try:
        _results(small, range(1, 6_001), expire=2_000_000)
        _results(large, range(1, 60_001), expire=2_000_000)
        assert PURGE_WINDOW < 6_000
        idle_small = _steps(small, small.purge_expired)
        idle_large = _steps(large, large.purge_expired)
        assert idle_small == idle_large
        assert small.purge_expired() == large.purge_expired() == 0
    finally:
        small.close()
        large.close()
    # 100 not yet expired at the lowest ids, then 10,000 expired: each purge deletes a
    # batch of those, and stops there.
    mixed = SqliteQueueStore(tmp_path / "m.db", clock=clock)
    try:
        _results(mixed, range(1, 101), expire=2_000_000)
        _results(mixed, range(101, 10_101), expire=500_000)
        assert [mixed.purge_expired() for _ in range(3)] == [PURGE_BATCH] * 3
        assert _steps(mixed, mixed.purge_expired) < idle_small // 10
        (kept,) = mixed.connection.execute(
            "SELECT count(*) FROM results WHERE id <= 100"
        ).fetchone()
        (left,) = mixed.connection.execute("SELECT count(*) FROM results WHERE id > 100").fetchone()
        assert (kept, left) == (100, 10_000 - 4 * PURGE_BATCH)
    finally:
        mixed.close()


def test_a_version_3_database_loses_its_expire_index_and_keeps_its_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 4 drops the index on results' `expire`. Results written at version 3 are
    there after the upgrade, read as before, and purged once expired."""
    from queryqueue.driver_sqlite import schema
    from queryqueue.engine.clock import ManualClock

    db = tmp_path / "queue.db"
    clock = ManualClock(1_000_000)
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:3])
    monkeypatch.setattr(schema, "LATEST_VERSION", 3)
    store = SqliteQueueStore(db, clock=clock, result_ttl_ms=1_000)
    first = store.add("p:first", "{}").id
    store.ack(first, '{"r": 1}')
    clock.advance(500)
    second = store.add("p:second", "{}").id
    store.ack(second, '{"r": 2}')
    assert store.connection.execute(
        "SELECT 1 FROM sqlite_master WHERE name = 'results_expire'"
    ).fetchone()
    store.close()
    monkeypatch.undo()
    store = SqliteQueueStore(db, clock=clock, result_ttl_ms=1_000)
    try:
        assert store.connection.execute("PRAGMA user_version").fetchone() == (
            schema.LATEST_VERSION,
        )
        assert not store.connection.execute(
            "SELECT 1 FROM sqlite_master WHERE name = 'results_expire'"
        ).fetchone()
        got = store.result(first)
        assert got is not None and got.payload == '{"r": 1}'
        clock.advance(600)  # `first` expired, `second` not
        assert store.purge_expired() == 1
        assert store.result(second) is not None
    finally:
        store.close()


def test_a_version_1_database_is_migrated_and_its_pending_items_still_orphan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 2 makes items_orphaned partial (pending items only: an item inserted or
    deleted active writes no page of it). Items written at version 1 are there after the
    upgrade, and ORPHANED still finds the pending ones, by their deadline or by age."""
    from queryqueue.driver_sqlite import schema
    from queryqueue.engine.clock import ManualClock

    db = tmp_path / "queue.db"
    clock = ManualClock(1_000_000)
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:1])
    monkeypatch.setattr(schema, "LATEST_VERSION", 1)
    store = SqliteQueueStore(db, clock=clock)
    store.add("p:own", "{}", orphaned=5)  # its own deadline: 5 s
    store.add("p:old", "{}")  # by age
    store.add("p:run", "{}")
    store.retrieve("p:run")
    store.close()
    monkeypatch.undo()
    clock.advance(10_000)
    store = SqliteQueueStore(db, clock=clock)
    try:
        version = store.connection.execute("PRAGMA user_version").fetchone()[0]
        assert version == schema.LATEST_VERSION
        assert [r.id for r in store.orphaned(60_000, "p")] == ["own"]
        assert [r.id for r in store.orphaned(5_000, "p")] == ["own", "old"]
        assert [r.id for r in store.active("p")] == ["run"]
    finally:
        store.close()


def test_what_another_connection_wrote_is_counted(tmp_path: Path) -> None:
    """The counters are kept in the writer's memory. A second store on the same file (a
    process in development, say) writes between two of the first one's transactions: the
    first sees it (`PRAGMA data_version`) and counts its items again, so each answers
    with the counts of the items there."""
    db = tmp_path / "queue.db"
    first, second = SqliteQueueStore(db), SqliteQueueStore(db)
    try:
        assert first.add("p:a", "{}").pending == 1
        assert second.add("p:b", "{}").pending == 2
        recounts = first.recounts
        assert first.add("p:c", "{}").pending == 3
        assert first.recounts == recounts + 1
        assert first.add("p:d", "{}").pending == 4  # nothing new elsewhere: no recount
        assert first.recounts == recounts + 1
        assert second.retrieve("p:a", concurrency=5) is not None
        answer = first.retrieve("p:b", concurrency=5)
        assert answer is not None and answer.pending == 2 and answer.active == "a,b"
    finally:
        first.close()
        second.close()


def test_reopening_keeps_state_and_id_sequence(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    store = SqliteQueueStore(db)
    first = store.add("p:a", "{}").id
    store.add("p:b", "{}")
    store.ack(first, '{"r":1}')
    store.close()
    store = SqliteQueueStore(db, synchronous="FULL")
    try:
        assert [row.id for row in store.pending("p")] == ["b"]
        assert store.result(first) is not None
        assert store.add("p:c", "{}").id == first + 2
    finally:
        store.close()


def test_unopenable_database_is_a_store_error(tmp_path: Path) -> None:
    not_a_db = tmp_path / "garbage.db"
    not_a_db.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=r"garbage\.db"):
        SqliteQueueStore(not_a_db)
    with pytest.raises(ValueError, match="synchronous"):
        SqliteQueueStore(tmp_path / "x.db", synchronous="OFF")  # type: ignore[arg-type]


def test_a_command_failing_in_a_batch_is_undone_alone_after_its_writes_or_before_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a batch a command's savepoint opens at its first write. An ACK that fails
    after its DELETE is rolled back to its own savepoint; an ADD that fails before writing
    anything rolls back nothing, not the command before it."""
    from queryqueue.driver_sqlite.transaction import SqliteTransaction

    def failing_counts(self: SqliteTransaction, prefix: str) -> tuple[int, int]:
        raise sqlite3.OperationalError("counts refused")

    def failing_insert_result(self: SqliteTransaction, result: object) -> None:
        raise sqlite3.OperationalError("insert_result refused")

    store = SqliteQueueStore(tmp_path / "queue.db")
    runs = 0
    try:
        first = store.add("p:a", "{}").id

        def work() -> list[object]:
            nonlocal runs
            runs += 1
            return answers_or_errors(
                lambda: store.add("p:b", "{}"),
                lambda: store.add("q:x", "{}"),  # fails reading: no savepoint of its own
                lambda: store.ack(first, '{"r": 1}'),  # fails after deleting the item
                lambda: store.add("p:c", "{}"),
            )

        with monkeypatch.context() as patch:
            original = SqliteTransaction.counts
            patch.setattr(
                SqliteTransaction,
                "counts",
                lambda self, prefix: (
                    failing_counts(self, prefix) if prefix == "q" else original(self, prefix)
                ),
            )
            patch.setattr(SqliteTransaction, "insert_result", failing_insert_result)
            answers = store.batched(work, lambda _: None)
        assert [type(a).__name__ for a in answers] == [
            "AddToQueueResponse",
            "StoreError",
            "StoreError",
            "AddToQueueResponse",
        ]
        assert "counts refused" in str(answers[1]) and "insert_result refused" in str(answers[2])
        # Run without savepoints first; the ACK failed after its write: run again, guarded.
        assert runs == 2
        assert [row.id for row in store.pending("p")] == ["a", "b", "c"]
        assert store.pending("q") == []
        assert store.result(first) is None
        assert store.add("p:d", "{}").pending == 4  # the counters hold the undo too
        assert store.ack(first, '{"r": 2}').success  # and the store goes on
    finally:
        store.close()


def test_a_batch_whose_commands_do_not_fail_after_writing_opens_no_savepoint(
    tmp_path: Path,
) -> None:
    """Commands decide, then write: a batch of them, failures before any write included,
    runs once and without SAVEPOINT or RELEASE (two statements per writing command)."""
    store = SqliteQueueStore(tmp_path / "queue.db", checkpoint_every_s=None)
    statements: list[str] = []
    try:
        first = store.add("p:a", "{}").id
        store.add("other:e", "{}", external_id="e")
        store.connection.set_trace_callback(statements.append)
        answers = store.batched(
            lambda: answers_or_errors(
                lambda: store.add("p:b", "{}"),
                lambda: store.retrieve("p:a", concurrency=2),
                lambda: store.add("p:bad", "{}", external_id="e"),  # refused before writing
                lambda: store.ack(first, '{"r": 1}'),
                lambda: store.retrieve_next("p", concurrency=2, process_id="pool"),
            ),
            lambda _: None,
        )
        store.connection.set_trace_callback(None)
        assert [type(a).__name__ for a in answers] == [
            "AddToQueueResponse",
            "RetrieveResponse",
            "ExternalIdConflictError",
            "AckResponse",
            "list",
        ]
        assert [s.split()[0] for s in statements].count("BEGIN") == 1
        assert not [s for s in statements if s.startswith(("SAVEPOINT", "RELEASE", "ROLLBACK"))]
        # The counters (an ADD, a RETRIEVE, an ACK and the pool's retrieval changed them)
        # cost no statement: kept in memory as the batch commits.
        assert statements[-1] == "COMMIT" and "PRAGMA data_version" in statements
        assert len([s for s in statements if "count" in s.lower()]) == 0
        assert store.result(first) is not None and [r.id for r in store.active("p")] == ["b"]
        assert _counters(store) == {"p": (0, 1), "other": (1, 0)}
        # A batch opened directly (no `batched` to run it again) keeps its savepoints.
        statements.clear()
        store.connection.set_trace_callback(statements.append)
        with store.batch():
            store.add("p:e", "{}")
        store.connection.set_trace_callback(None)
        assert [s.split()[0] for s in statements if s.startswith(("SAVEPOINT", "RELEASE"))] == [
            "SAVEPOINT",
            "RELEASE",
        ]
    finally:
        store.close()


def _counters(store: SqliteQueueStore) -> dict[str, tuple[int, int]]:
    """The counters `store` keeps (as last committed), which agree with its items."""
    _assert_consistent(store.path)
    kept = dict(store._stored)
    assert kept == store._count_items()
    return kept


def test_the_counters_hold_through_batches_a_batch_rolled_back_whole_and_a_reopen(
    tmp_path: Path,
) -> None:
    """The counter rows match the items after batches, single commands and a batch rolled
    back whole (its RETRIEVE's active item included), and a reopened store counts the same."""
    db = tmp_path / "queue.db"
    store = SqliteQueueStore(db)
    try:
        a = store.add("p:a", "{}").id
        store.add("q:z", "{}")

        def work() -> None:
            store.add("p:b", "{}")
            assert store.retrieve("p:b", concurrency=5) is not None
            store.ack(a, '{"r": 1}')

        store.batched(work, lambda _: None)

        def rolled_back() -> None:
            store.add("p:c", "{}")
            assert store.retrieve("p:c", concurrency=5) is not None
            raise RuntimeError("the batch is abandoned")

        with pytest.raises(RuntimeError):
            store.batched(rolled_back, lambda _: None)
        # As committed: b active, nothing pending in p; c was never there.
        answer = store.retrieve("p:b", concurrency=5)
        assert answer is not None and answer.active == "b" and answer.pending == 0
        assert store.add("p:c", "{}").pending == 1
        store.batched(lambda: store.add("p:e", "{}"), lambda _: None)  # the last write
        assert _counters(store) == {"p": (2, 1), "q": (1, 0)}
    finally:
        store.close()
    store = SqliteQueueStore(db)
    try:
        added = store.add("p:d", "{}")
        assert added.pending == 3
        assert store.retrieve("p:d", concurrency=5) is not None
        assert [row.id for row in store.active("p")] == ["b", "d"]
        assert _counters(store) == {"p": (2, 2), "q": (1, 0)}
    finally:
        store.close()


def test_after_sqlite_rolls_a_batch_back_its_later_commands_write_nothing_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some errors (a full disk) make SQLite roll back the whole transaction. The commands
    of the batch after it must not write in autocommit, each statement on its own: they
    fail, and the batch with them."""
    from queryqueue.driver_sqlite.transaction import SqliteTransaction

    def rolls_everything_back(self: SqliteTransaction, item: object, now: int) -> None:
        self._c.execute("ROLLBACK")  # as SQLite does itself on SQLITE_FULL
        raise sqlite3.OperationalError("database or disk is full")

    store = SqliteQueueStore(tmp_path / "queue.db")
    try:
        first = store.add("p:a", "{}").id

        with monkeypatch.context() as patch:
            patch.setattr(SqliteTransaction, "set_heartbeat", rolls_everything_back)
            with pytest.raises(StoreError):
                store.batched(
                    lambda: answers_or_errors(
                        lambda: store.add("p:b", "{}"),
                        lambda: store.heartbeat(first),  # SQLite rolls the batch back
                        lambda: store.add("p:c", "{}"),
                    ),
                    lambda _: None,
                )
        assert [row.id for row in store.pending("p")] == ["a"]
        assert store.add("p:d", "{}").pending == 2
    finally:
        store.close()
    _assert_consistent(tmp_path / "queue.db")


def test_counters_kept_for_the_commit_are_not_written_alone_after_sqlite_rolled_back(
    tmp_path: Path,
) -> None:
    """A batch's counter changes wait for its COMMIT. If SQLite rolled the transaction back
    meanwhile (a full disk, say) with nothing written since, they must not be written in
    autocommit on their own: the COMMIT fails, and neither the item nor a count is kept."""
    store = SqliteQueueStore(tmp_path / "queue.db")
    try:
        with pytest.raises(StoreError), store.batch():
            store.add("p:a", "{}")
            store.connection.execute("ROLLBACK")  # as SQLite does by itself on some errors
        assert store.pending("p") == []
        assert store.add("p:b", "{}").pending == 1
        assert _counters(store) == {"p": (1, 0)}
    finally:
        store.close()
