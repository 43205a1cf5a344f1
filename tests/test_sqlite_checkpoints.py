"""WAL checkpoints off the writer's path: commits run none, a thread of the store folds the
WAL back, and a WAL a busy writer keeps from restarting is folded by the writer itself
between two transactions, once past its cap."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from queryqueue import SqliteQueueStore
from tests.waiting import wait_until_sync


def _add(store: SqliteQueueStore, n: int, tag: str) -> None:
    for i in range(n):
        store.add(f"c:{tag}{i}", f'{{"i": {i}}}')


def _fold_due(store: SqliteQueueStore) -> bool:
    return store.checkpointer.fold_due


def test_a_commit_runs_no_checkpoint_and_a_round_folds_the_whole_wal(tmp_path: Path) -> None:
    store = SqliteQueueStore(tmp_path / "q.db", checkpoint_every_s=None)
    try:
        assert store.connection.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
        _add(store, 200, "a")
        frames, folded = store.checkpointer.step()
        assert frames > 0 and folded == frames
        assert not store.checkpointer.fold_due  # far below the cap
        assert store.checkpointer.describe()["checkpoints"] == 1
    finally:
        store.close()
    # What the round folded back is in the database file itself.
    conn = sqlite3.connect(tmp_path / "q.db")
    try:
        assert conn.execute("SELECT count(*) FROM items").fetchone() == (200,)
    finally:
        conn.close()


def test_a_wal_past_its_cap_is_folded_by_the_writer_and_starts_over(tmp_path: Path) -> None:
    """A reader's snapshot stands in for what a busy writer does to a background round:
    frames written after it cannot be folded by the round, so the WAL cannot restart.
    Past the cap, the writer folds them before its next transaction; that transaction
    then starts the WAL over (without the fold it would append past the cap)."""
    store = SqliteQueueStore(tmp_path / "q.db", checkpoint_every_s=None, wal_cap_pages=40)
    reader = sqlite3.connect(tmp_path / "q.db", isolation_level=None)
    try:
        _add(store, 10, "before")
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM items").fetchone()  # its snapshot: now
        _add(store, 30, "after")
        frames, folded = store.checkpointer.step()
        assert folded < frames and frames >= 40  # the frames after the snapshot stay
        assert _fold_due(store)
        reader.execute("COMMIT")
        _add(store, 1, "next")  # folds first, then writes at the start of the WAL
        assert not _fold_due(store) and store.checkpointer.folds == 1
        restarted, _ = store.checkpointer.step()
        assert restarted < frames
        assert store.get("c:after29") is not None and store.get("c:next0") is not None
    finally:
        reader.close()
        store.close()


def test_the_thread_runs_rounds_after_commits_and_stops_at_close(tmp_path: Path) -> None:
    store = SqliteQueueStore(tmp_path / "q.db", checkpoint_every_s=0.01)
    checkpointer = store.checkpointer
    thread = checkpointer._thread
    assert thread is not None and thread.is_alive()
    try:
        _add(store, 20, "a")
        wait_until_sync(lambda: checkpointer.rounds >= 1, what="a background round")
        wait_until_sync(lambda: not checkpointer.dirty, what="the round after the last commit")
        assert checkpointer.wal_frames > 0
    finally:
        store.close()
    assert not thread.is_alive()


def test_a_failed_round_is_counted_and_logged_and_the_next_retries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteQueueStore(tmp_path / "q.db", checkpoint_every_s=None)
    try:
        _add(store, 5, "a")
        working = store.checkpointer.connection
        store.checkpointer.connection = sqlite3.connect(":memory:")
        store.checkpointer.connection.close()  # a round on it fails: a closed connection
        assert store.checkpointer.step() == (0, 0)
        assert store.checkpointer.failures == 1
        assert "checkpoint of" in caplog.text and "the next round retries" in caplog.text
        store.checkpointer.connection = working
        frames, folded = store.checkpointer.step()
        assert frames > 0 and folded == frames
    finally:
        store.close()
