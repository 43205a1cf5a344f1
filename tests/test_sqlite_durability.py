"""A process writing through the SQLite store is `kill -9`ed mid-stream: every command it saw
commit is there after reopening, and no command is there in part. And a batch: a failing
command undone alone, and the prefix counters right through rollbacks and reopens."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pytest

from queryqueue import SqliteQueueStore, StoreError
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


def _write_until_killed(
    db: Path, synchronous: str, checkpoints: tuple[float, int]
) -> tuple[list[str], str]:
    """The writer's lines read before its kill -9, and those it had written still unread."""
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
    return seen, rest


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


def _counters(store: SqliteQueueStore) -> dict[str, tuple[int, int]]:
    """The prefixes' counters `store` keeps (as last committed), which agree with its items,
    as its count of results held agrees with its results."""
    from queryqueue.engine.counts import RESULTS

    _assert_consistent(store.path)
    kept = dict(store._stored)
    assert kept == store._count_items()
    return {prefix: counts for prefix, counts in kept.items() if prefix != RESULTS}


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
    seen, rest = _write_until_killed(db, synchronous, checkpoints)
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
