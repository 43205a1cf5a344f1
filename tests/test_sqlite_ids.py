"""SQLite's queue ids, taken from blocks committed ahead (driver_sqlite/ids.py): a batch's
hand-offs leave before its COMMIT, so no id may be given twice, whatever becomes of it."""

from __future__ import annotations

import functools
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from queryqueue import SqliteQueueStore
from queryqueue.driver_sqlite.ids import IdBlock
from queryqueue.engine.errors import StoreError
from tests.sqlite_util import committed

P = "p"


def _seen(seen: list[tuple[int, bool]], db: Path, queue_id: int) -> None:
    seen.append((queue_id, committed(db, queue_id)))


def test_a_batch_whose_commit_fails_after_its_hand_off_gives_none_of_its_ids_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its `before_commit` ran (a worker may be running its query): the next item takes
    another id, here and in the next store on the file."""
    db = tmp_path / "q.db"
    store = SqliteQueueStore(db)
    try:
        commit, handed = store._commit, list[int]()

        def fails_once() -> None:
            monkeypatch.setattr(store, "_commit", commit)
            raise sqlite3.OperationalError("disk I/O error")

        monkeypatch.setattr(store, "_commit", fails_once)

        def work() -> int:
            id = store.add(f"{P}:lost", "{}").id
            assert id is not None
            store.before_commit(lambda: handed.append(id))
            return id

        with pytest.raises(StoreError, match="disk I/O error"):
            store.batched(work, lambda _: None)
        assert len(handed) == 1 and not committed(db, handed[0])
        again = store.add(f"{P}:next", "{}").id
        assert again is not None and again > handed[0]
    finally:
        store.close()
    reopened = SqliteQueueStore(db)
    try:
        later = reopened.add(f"{P}:later", "{}").id
        assert later is not None and later > again
    finally:
        reopened.close()


def test_a_batch_undone_before_its_hand_off_gives_its_ids_again(tmp_path: Path) -> None:
    """Nothing of it left the store: no gap."""
    store = SqliteQueueStore(tmp_path / "q.db")
    try:
        taken: list[int | None] = []

        def fails() -> None:
            taken.append(store.add(f"{P}:undone", "{}").id)
            raise StoreError("the batch fails")

        with pytest.raises(StoreError):
            store.batched(fails, lambda _: None)
        assert store.add(f"{P}:next", "{}").id == taken[0]
    finally:
        store.close()


def test_a_batch_that_handed_off_early_and_failed_gives_none_of_its_ids_again(
    tmp_path: Path,
) -> None:
    """`hands_off_early` (a supervisor filling its workers' slots before the rest of the
    batch runs): from then on, the batch's ids are a worker's as if its COMMIT had started,
    whatever becomes of it. Outside a batch it says no."""
    store = SqliteQueueStore(tmp_path / "q.db")
    try:
        assert not store.hands_off_early()
        taken: list[int | None] = []

        def fails_after_a_hand_off() -> None:
            taken.append(store.add(f"{P}:handed", "{}").id)
            assert store.hands_off_early()
            taken.append(store.add(f"{P}:after", "{}").id)
            raise StoreError("a later command fails the batch")

        with pytest.raises(StoreError):
            store.batched(fails_after_a_hand_off, lambda _: None)
        assert all(i is not None for i in taken)
        again = store.add(f"{P}:next", "{}").id
        assert again is not None and again > max(i for i in taken if i is not None)
        assert [(r.id, r.queue_id) for r in store.pending(P)] == [("next", again)]  # undone
    finally:
        store.close()


def test_a_store_killed_in_the_middle_of_a_batch_leaves_its_ids_to_no_one(
    tmp_path: Path,
) -> None:
    """kill -9 after an item took its id, before its batch committed (a hand-off may have
    left with it): the next store on the file starts after that id."""
    db = tmp_path / "q.db"
    SqliteQueueStore(db).close()  # the schema, so that the child only adds
    script = textwrap.dedent(
        f"""
        import os, signal
        from queryqueue import SqliteQueueStore
        store = SqliteQueueStore({str(db)!r})
        store.add("{P}:committed", "{{}}")
        def work():
            id = store.add("{P}:lost", "{{}}").id
            print(id, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        store.batched(work, lambda _: None)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -9, out
    lost = int(out.split()[0])
    store = SqliteQueueStore(db)
    try:
        assert not committed(db, lost)
        assert [row.id for row in store.pending(P)] == ["committed"]
        later = store.add(f"{P}:later", "{}").id
        assert later is not None and later > lost
    finally:
        store.close()


def test_two_stores_on_one_file_take_ids_from_blocks_of_their_own(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    first, second = SqliteQueueStore(db), SqliteQueueStore(db)
    try:
        ids = [
            store.add(f"{P}:{i}", "{}").id for i, store in enumerate([first, second, first, second])
        ]
        assert len(set(ids)) == 4, ids
        assert ids[0] is not None and ids[2] == ids[0] + 1
    finally:
        first.close()
        second.close()


def test_a_batch_of_more_items_than_its_block_has_left_hands_off_once_it_committed(
    tmp_path: Path,
) -> None:
    """Ids past the block are AUTOINCREMENT's, in the transaction: that batch's
    `before_commit` waits for its COMMIT, and the ids stay unique and rising."""
    db = tmp_path / "q.db"
    store = SqliteQueueStore(db)
    try:
        store._ids = IdBlock(size=4)
        seen: list[tuple[int, bool]] = []

        def work() -> list[int]:
            ids = [store.add(f"{P}:{i}", "{}").id for i in range(10)]
            taken = [id for id in ids if id is not None]
            assert len(taken) == len(ids)
            for id in taken:
                store.before_commit(functools.partial(_seen, seen, db, id))
            return taken

        ids = store.batched(work, lambda _: None)
        assert ids == sorted(set(ids)), ids
        assert seen == [(id, True) for id in ids]
        # The next batch reserves a block again: hand-offs before its COMMIT.
        seen.clear()

        def one() -> int | None:
            id = store.add(f"{P}:after", "{}").id
            assert id is not None
            store.before_commit(lambda: seen.append((id, committed(db, id))))
            return id

        after = store.batched(one, lambda _: None)
        assert after is not None and after > ids[-1]
        assert seen == [(after, False)]
    finally:
        store.close()
