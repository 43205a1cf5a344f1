"""The SQLite store's database file: a newer schema refused, page sizes kept, the purge's
bounded reads, migrations from earlier versions, what another connection wrote, reopening."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from queryqueue import SchemaVersionError, SqliteQueueStore, StoreError


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


def _backlog(store: SqliteQueueStore, pending: int) -> None:
    """`pending` items of three priorities on prefix p (one of them active), and one item
    of prefix q, added in one transaction."""

    def add() -> None:
        for i in range(pending):
            store.add(f"p:{i}", "{}", priority=(0, 5, 10)[i % 3])
        store.add("q:0", "{}")
        store.retrieve("p:1", concurrency=1_000)

    store.batched(add, lambda _: None)


def test_stats_read_no_more_of_the_backlog_however_long_it_is(tmp_path: Path) -> None:
    """`stats` (the store's `describe`) counts pending and active items from the counters
    and finds each prefix's oldest item one index seek per priority group: the same
    virtual machine steps, within a level or two of the index, with 2,000 items pending
    as with 100,000, and the right oldest item either way."""
    from queryqueue.engine.clock import ManualClock

    clock = ManualClock(1_000_000)
    small = SqliteQueueStore(tmp_path / "s.db", clock=clock)
    large = SqliteQueueStore(tmp_path / "l.db", clock=clock)
    try:
        _backlog(small, 2_000)
        _backlog(large, 100_000)
        clock.advance(5_000)
        # Fifty times the backlog: a level or two more of the index to seek through.
        assert _steps(large, large.describe) < 1.5 * _steps(small, small.describe)
        prefixes = {row["prefix"]: row for row in large.describe()["prefixes"]}
        assert (prefixes["p"]["pending"], prefixes["p"]["active"]) == (99_999, 1)
        assert prefixes["p"]["oldest_age_ms"] == prefixes["q"]["oldest_age_ms"] == 5_000
    finally:
        small.close()
        large.close()
