"""One command's reads and writes in SQLite: the `StoreTransaction` every command of the
store runs through (`SqliteTransaction`: all of the store's SQL but the connection's own),
and the savepoint that undoes one command of a batch alone."""

from __future__ import annotations

import sqlite3
from contextlib import suppress
from pathlib import Path
from typing import Any

from queryqueue.driver_sqlite.ids import IdBlock
from queryqueue.driver_sqlite.schema import ACTIVE, PENDING
from queryqueue.engine.counts import RESULTS, CountChanges
from queryqueue.engine.errors import StoreError
from queryqueue.engine.records import (
    INSERTED_COLUMNS,
    ITEM_COLUMNS,
    RESULT_COLUMNS,
    STATUS_CODE,
    Item,
    PrefixOverview,
    ResultReuse,
    StoredResult,
    inserted_values,
    item_from_row,
    oldest_of,
    result_from_row,
)
from queryqueue.engine.responses import ItemStatus, QueueId, QueueKey

# Formatted once, not per insert; the id named (ids.py) or, past a block, AUTOINCREMENT's.
_VALUES = ", ".join("?" * len(INSERTED_COLUMNS.split(", ")))
_INSERT_ITEM_WITH_ID = f"INSERT INTO items (id, {INSERTED_COLUMNS}) VALUES (?, {_VALUES})"
_INSERT_ITEM_RETURNING_ID = (
    f"INSERT INTO items ({INSERTED_COLUMNS}) VALUES ({_VALUES}) RETURNING id"
)
# The most results the purge of expired ones reads (from the lowest id) to find what it
# deletes. There is no index on `expire`: it cost each result's INSERT a page of the WAL.
PURGE_WINDOW = 4096


class Redo(BaseException):
    """A command failed after writing in a batch run without savepoints: the batch is
    rolled back and run again, each command in a savepoint of its own (`batched`). A
    BaseException: no command's or server's error handling may take it for an answer."""


def database_error(path: Path, exc: sqlite3.Error) -> StoreError:
    """A statement of a command that failed, as the store's error (a command's
    savepoint, or its transaction of its own)."""
    return StoreError(f"queue database {path}: {exc}")


class Savepoint:
    """A command's savepoint inside a batch, opened by its first write: a command that only
    reads costs no SAVEPOINT and RELEASE. (Left open until the COMMIT instead of released,
    savepoints measured slower: every page written checks each one still open.)

    Unguarded (a batch's first run), it only notes that the command wrote: commands fail
    before writing (decide, then act), so a batch whose commands all succeed or fail
    before any write needs no savepoint at all (6 statements a query fewer); one that
    failed after writing is run again guarded (`Redo`)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        counts: CountChanges,
        ids: IdBlock,
        *,
        guarded: bool = True,
    ) -> None:
        self._c = conn
        self._path = path
        self._counts = counts
        self._counted = counts.keep() if guarded else None
        self._ids = ids
        self._ids_at = ids.next  # a command undone gives its ids again: no gap
        self._guarded = guarded
        self.opened = False

    def open(self) -> None:
        if self.opened:
            return
        if not self._c.in_transaction:
            # SQLite rolled the whole batch back (a full disk, say): a write now would
            # commit on its own, statement by statement, apart from the rest of the batch.
            raise StoreError(f"the batch's transaction on {self._path} was rolled back")
        if not self._guarded:
            self.opened = True
            return
        try:
            self._c.execute("SAVEPOINT command")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open a savepoint on {self._path}: {exc}") from exc
        self.opened = True

    def undo(self) -> None:
        if self.opened and not self._guarded:
            raise Redo  # its writes cannot be undone alone: the batch runs again, guarded
        if self.opened:  # else there is nothing to undo, and no savepoint of its own
            with suppress(sqlite3.Error):
                self._c.execute("ROLLBACK TO command")
                self._c.execute("RELEASE command")
            if self._counted is not None:
                self._counts.restore(self._counted)
            self._ids.next = self._ids_at

    def release(self) -> None:
        if self.opened and self._guarded:
            try:
                self._c.execute("RELEASE command")
            except sqlite3.Error as exc:
                raise database_error(self._path, exc) from exc


class SqliteTransaction:
    """The hooks on one connection. Inside a batch, `savepoint` is the command's: every
    write calls `_write()` first, so a command that only reads opens none."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        counts: CountChanges,
        stored: dict[str, tuple[int, int]],
        ids: IdBlock,
        savepoint: Savepoint | None = None,
    ) -> None:
        self._c = conn
        self._counts = counts
        self._ids = ids
        self._stored = stored  # the counters as last committed (read only here)
        self._savepoint = savepoint

    def _write(self) -> None:
        if self._savepoint is not None:
            self._savepoint.open()

    def _one(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._c.execute(sql, params).fetchone()
        return row

    # -- items ------------------------------------------------------------------------

    def expect_add(self, item: Item, reuse: ResultReuse | None) -> None:
        pass  # a read costs no round trip here

    def find(self, key: QueueKey, *, with_payload: bool = False) -> Item | None:
        columns = ITEM_COLUMNS + (", payload" if with_payload else "")
        if isinstance(key, int):
            row = self._one(f"SELECT {columns} FROM items WHERE id = ?", (key,))
        else:
            prefix, _, name = key.rpartition(":")
            row = self._one(
                f"SELECT {columns} FROM items WHERE prefix = ? AND key = ?", (prefix, name)
            )
        return None if row is None else item_from_row(row)

    def external_id_taken(self, external_id: str) -> bool:
        return self._one("SELECT 1 FROM items WHERE external_id = ?", (external_id,)) is not None

    def insert(self, item: Item) -> QueueId:
        self._write()
        id = self._ids.take()
        if id is None:  # a transaction of more items than a block has left (ids.py)
            row = self._one(_INSERT_ITEM_RETURNING_ID, inserted_values(item))
            assert row is not None
            id = int(row[0])
            self._ids.used(id)
        else:
            self._c.execute(_INSERT_ITEM_WITH_ID, (id, *inserted_values(item)))
        if item.status == "pending":
            self._count(item.prefix, 1, 0)
        else:
            self._count(item.prefix, 0, 1)
        return id

    def _count(self, prefix: str, pending: int, active: int) -> None:
        self._write()
        self._counts.count(prefix, pending, active)  # kept as the transaction commits

    def activate(self, item: Item, now: int, extra: str | None) -> None:
        self._write()
        self._c.execute(
            "UPDATE items SET status = ?, heartbeat = ?, extra = ? WHERE id = ?",
            (ACTIVE, now, extra, item.id),
        )
        self._count(item.prefix, -1, 1)

    def deactivate(self, item: Item, now: int) -> None:
        self._write()
        self._c.execute(
            f"UPDATE items SET status = {PENDING}, heartbeat = ? WHERE id = ?", (now, item.id)
        )
        self._count(item.prefix, 1, -1)

    def set_heartbeat(self, item: Item, now: int) -> None:
        self._write()
        self._c.execute("UPDATE items SET heartbeat = ? WHERE id = ?", (now, item.id))

    def set_orphaned(self, item: Item, deadline: int) -> None:
        self._write()
        self._c.execute("UPDATE items SET orphaned = ? WHERE id = ?", (deadline, item.id))

    def set_extra(self, item: Item, extra: str | None) -> None:
        self._write()
        self._c.execute("UPDATE items SET extra = ? WHERE id = ?", (extra, item.id))

    def delete(self, item: Item) -> None:
        self._write()
        self._c.execute("DELETE FROM items WHERE id = ?", (item.id,))
        if item.status == "pending":
            self._count(item.prefix, -1, 0)
        else:
            self._count(item.prefix, 0, -1)

    def counts(self, prefix: str) -> tuple[int, int]:
        known = self._counts.counts.get(prefix)
        if known is not None:
            return known
        return self._counts.stored(prefix, self._stored.get(prefix))

    # A status in a WHERE is written out, never bound: items_orphaned is partial (status
    # 0), and a bound value that might decide whether it serves has SQLite prepare the
    # statement again at every run (10.9 us this one, 4.6 us written out).

    def active_keys(self, prefix: str) -> list[str]:
        rows = self._c.execute(
            f"SELECT key FROM items WHERE prefix = ? AND status = {ACTIVE} ORDER BY id", (prefix,)
        )
        return [row[0] for row in rows]

    def items(
        self,
        prefix: str,
        status: ItemStatus | None,
        *,
        process_id: str | None,
        with_payload: bool,
        limit: int | None,
    ) -> list[Item]:
        columns = ITEM_COLUMNS + (", payload" if with_payload else "")
        where = "prefix = ? AND (exclusive = 0 OR process_id IS ?)"
        params: list[Any] = [prefix, process_id]
        if status is not None:
            where += f" AND status = {STATUS_CODE[status]}"
        order = "id" if status == "active" else "priority DESC, id"
        sql = f"SELECT {columns} FROM items WHERE {where} ORDER BY {order}"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return [item_from_row(row) for row in self._c.execute(sql, params)]

    def pool_head(self, prefix: str, process_id: str, limit: int) -> list[Item]:
        return self.items(prefix, "pending", process_id=process_id, with_payload=True, limit=limit)

    def orphaned_items(self, prefix: str, now: int, orphaned_timeout_ms: int) -> list[Item]:
        # Two index ranges on items_orphaned; NULL deadlines never satisfy `orphaned < ?`.
        # INDEXED BY, or the planner may walk PENDING instead.
        rows = self._c.execute(
            f"SELECT {ITEM_COLUMNS} FROM items INDEXED BY items_orphaned"
            f" WHERE prefix = ? AND status = {PENDING} AND orphaned < ?"
            f" UNION ALL SELECT {ITEM_COLUMNS} FROM items INDEXED BY items_orphaned"
            f" WHERE prefix = ? AND status = {PENDING} AND orphaned IS NULL AND created < ?"
            " ORDER BY priority DESC, id",
            (prefix, now, prefix, now - orphaned_timeout_ms),
        )
        return [item_from_row(row) for row in rows]

    def stalled_items(self, prefix: str, now: int, heartbeat_timeout_ms: int) -> list[Item]:
        rows = self._c.execute(
            f"SELECT {ITEM_COLUMNS} FROM items"
            f" WHERE prefix = ? AND status = {ACTIVE} AND coalesce(heartbeat, created) < ?"
            " ORDER BY id",
            (prefix, now - heartbeat_timeout_ms),
        )
        return [item_from_row(row) for row in rows]

    # -- results ------------------------------------------------------------------------

    def insert_result(self, result: StoredResult) -> None:
        self._write()
        self._counts.count(RESULTS, 1, 0)  # a result's id is its item's: a new row
        self._c.execute(
            "INSERT OR REPLACE INTO results (id, path, value, deleted, expire, external_id,"
            " consumed_by) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                result.id,
                result.path,
                result.value,
                int(result.deleted),
                result.expire,
                result.external_id,
                result.consumed_by,
            ),
        )

    def result_by_id(self, id: QueueId, now: int) -> StoredResult | None:
        return result_from_row(
            self._one(
                f"SELECT {RESULT_COLUMNS} FROM results WHERE id = ? AND expire > ?", (id, now)
            )
        )

    def latest_result_by_path(self, path: str, now: int) -> StoredResult | None:
        return result_from_row(
            self._one(
                f"SELECT {RESULT_COLUMNS} FROM results WHERE path = ? AND expire > ?"
                " ORDER BY id DESC LIMIT 1",
                (path, now),
            )
        )

    def latest_result_by_external_id(self, external_id: str, now: int) -> StoredResult | None:
        return result_from_row(
            self._one(
                f"SELECT {RESULT_COLUMNS} FROM results WHERE external_id = ? AND expire > ?"
                " ORDER BY id DESC LIMIT 1",
                (external_id, now),
            )
        )

    def mark_result_consumed(self, id: QueueId, consumer: str | None = None) -> None:
        self._write()
        self._c.execute(
            "UPDATE results SET deleted = 1, consumed_by = ? WHERE id = ? AND deleted = 0",
            (consumer, id),
        )

    def delete_result(self, id: QueueId) -> None:
        self._write()
        gone = self._c.execute("DELETE FROM results WHERE id = ?", (id,)).rowcount
        self._counts.count(RESULTS, -gone, 0)

    def purge_expired_results(self, now: int, limit: int) -> int:
        # By id, from the lowest, stopping at `limit` expired: a result's id is its item's,
        # so ids come about in the order results expire, but for an item that waited longer
        # than those after it (a lower priority). Such a result, not yet expired, is passed
        # over, up to PURGE_WINDOW of them; past that the purge waits for them to expire
        # (within the TTL they were stored with), and reads never see an expired result
        # meanwhile.
        self._write()
        cursor = self._c.execute(
            "DELETE FROM results WHERE id IN (SELECT id FROM"
            " (SELECT id, expire FROM results ORDER BY id LIMIT ?) WHERE expire <= ? LIMIT ?)",
            (PURGE_WINDOW, now, limit),
        )
        self._counts.count(RESULTS, -cursor.rowcount, 0)
        return cursor.rowcount

    def overview(self, now: int) -> tuple[list[PrefixOverview], int]:
        stored = self._stored
        counted = [
            (prefix, *self._counts.stored(prefix, stored.get(prefix)))
            for prefix in sorted(stored.keys() | self._counts.deltas.keys())
            if prefix != RESULTS
        ]
        found = [
            PrefixOverview(prefix, pending, active, self._oldest(prefix))
            for prefix, pending, active in counted
            if pending > 0 or active > 0
        ]
        # Held: stored and not yet purged (an expired one is never read, and soon purged).
        return found, self._counts.stored(RESULTS, stored.get(RESULTS))[0]

    def _oldest(self, prefix: str) -> int | None:
        return oldest_of(self._one, prefix, "?")

    def refresh_active_heartbeats(self, now: int) -> int:
        self._write()
        cursor = self._c.execute(f"UPDATE items SET heartbeat = ? WHERE status = {ACTIVE}", (now,))
        return cursor.rowcount

    def acked(self, item: Item, result: str | None) -> None:
        pass  # one process: waiters are woken in process, after the commit

    def watch(self, key: QueueKey, now: int) -> None:
        pass  # one process: every ACK wakes its waiters

    def truncate(self) -> None:
        self._write()
        # DELETE rather than DROP: AUTOINCREMENT keeps counting, so ids are never reused.
        self._c.execute("DELETE FROM items")
        self._c.execute("DELETE FROM results")
        self._counts.forget()
        for prefix, (pending, active) in self._stored.items():  # all back to zero
            self._counts.stored(prefix, (pending, active))
            self._counts.count(prefix, -pending, -active)
