"""One command's reads and writes in PostgreSQL: the `StoreTransaction` every command of
the store runs through, inside its batch's transaction (a savepoint of its own where the
batch is guarded), with the prefix's advisory lock taken before any row lock."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import orjson
import psycopg

from queryqueue.driver_postgres.batch import AddReads, Head, Known, send_add_reads
from queryqueue.driver_postgres.hosts import HostLease, owner_of
from queryqueue.driver_postgres.lean import Executor, Rows
from queryqueue.driver_postgres.pool_head import PoolHeads
from queryqueue.driver_postgres.results import ResultRows
from queryqueue.driver_postgres.schema import ACTIVE, PENDING
from queryqueue.driver_postgres.statements import (
    EXTERNAL_ID_TAKEN,
    FIND_BY_PATH,
    INSERT_ITEM,
    INSERT_ITEM_WITH_ID,
    found_columns,
    prefix_lock_key,
)
from queryqueue.driver_postgres.watches import Watches
from queryqueue.engine.errors import ExternalIdConflictError
from queryqueue.engine.records import (
    ITEM_COLUMNS,
    STATUS_CODE,
    Item,
    PrefixOverview,
    ResultReuse,
    inserted_values,
    item_from_row,
    oldest_of,
)
from queryqueue.engine.responses import ItemStatus, QueueId, QueueKey

# The active items a prefix's lock reads with it while there are no more (see schema.py):
# most commands need them or nothing; a prefix with many more reads them when asked.
ACTIVE_PREFETCH = 32
NO_SAVEPOINT = contextlib.nullcontext()


class PostgresTransaction(Watches, ResultRows, PoolHeads):
    def __init__(
        self,
        conn: psycopg.Connection[Any],
        channel: str | None,
        schema: str,
        locked: set[str] | None = None,
        known: Known | None = None,
        origin: str = "",
        *,
        pipelined: bool = False,
        foreseen: dict[int, Rows] | None = None,
        head: Head | None = None,
        executor: Executor | None = None,
        batch_ahead: dict[str, AddReads] | None = None,
        lease: HostLease | None = None,
        origins: dict[QueueKey, tuple[bool, str]] | None = None,
    ) -> None:
        self._conn = conn
        self._lease = lease  # this host's, whose owner its activations name (hosts.py)
        # Where its statements go: the connection, or a pipelined batch's Lean.
        self._c: Executor = executor if executor is not None else conn
        self._pipelined = pipelined
        # Where an ACK's NOTIFY goes; None: no other host listens (none is sent).
        self._channel = channel
        self._origin = origin
        self._schema = schema
        self._locked: set[str] = set(locked or ())
        self.known = known.copy() if known is not None else Known()
        self.wrote = False
        # The transaction's id, as a write returned it (a COMMIT whose answer is lost is
        # looked up by it); or the writes that return it, answered or not yet.
        self.xid: int | None = None
        self.xid_cursors: list[Rows] = []
        # Locks taken in a pipeline whose answer (what `lock_prefix` read) is not read
        # yet: it comes with the next statement whose answer is (`_settle`).
        self._unsettled: list[tuple[str, Rows]] = []
        # Reads sent ahead of the command that reads them (`expect_add`), by what they ask.
        self._ahead: dict[tuple[Any, ...], Rows] = {}
        # The batch's ADDs' reads sent with its first statements (ahead.py), by path.
        self._batch_ahead = batch_ahead if batch_ahead is not None else {}
        # The time the result read ahead was read for (`latest_result_by_path`).
        self._result_since: int | None = None
        # Items whose NOTIFY went with their result's INSERT (`insert_result`).
        self._notified: set[int] = set()
        # The batch's reads of items by id, sent ahead (`Batch.foreseen`): shared by its
        # commands, each dropped once a command changes its item (it would be stale).
        self._foreseen = foreseen if foreseen is not None else {}
        self._head = head
        self._batch_origins = origins if origins is not None else {}
        self.origins = {}

    def _write_item(
        self, item: Item, query: str, params: tuple[Any, ...], *, pending: bool = True
    ) -> Rows:
        """A write to `item`'s row: what the batch read of it ahead is stale from now on.
        `pending`: it stays pending if it was (else the head's `gone` follows)."""
        self._foreseen.pop(item.id, None)
        if self._head is not None:
            if pending:
                self._head.changed(item)
            else:
                self._head.gone(item)
        return self._write(query, params)

    def _write(self, query: str, params: tuple[Any, ...] = ()) -> Rows:
        """A statement that changes data: the transaction then has an id to look up
        should its COMMIT's answer be lost (see `PostgresQueueStore._atomic`)."""
        self.wrote = True
        return self._c.execute(query, params)

    def _one(self, query: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._c.execute(query, params).fetchone()
        return row

    def _all(self, query: str, params: tuple[Any, ...] | list[Any] = ()) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self._c.execute(query, params).fetchall()
        return rows

    def lock(self, prefix: str) -> None:
        """Serialize this transaction with every other one on `prefix`, on every host."""
        if prefix not in self._locked:
            # With what every command reads next under it: no statement of its own for it.
            cursor = self._c.execute(
                "SELECT * FROM lock_prefix(%s, %s, %s)",
                (prefix_lock_key(self._schema, prefix), prefix, ACTIVE_PREFETCH),
            )
            self._locked.add(prefix)
            self._unsettled.append((prefix, cursor))
            if not self._pipelined:
                self._settle()

    def _settle(self) -> None:
        """What the locks taken read, into `known`: before it is read or changed (it
        counts what this transaction changes from what they read)."""
        unsettled, self._unsettled = self._unsettled, []
        for prefix, cursor in unsettled:
            row = cursor.fetchone()
            assert row is not None
            self.known.locked(prefix, row)

    # -- items ------------------------------------------------------------------------

    def expect_add(self, item: Item, reuse: ResultReuse | None) -> None:
        """A pipelined batch's ADD sends its reads together, with its lock, and the id it
        takes if it inserts (`ID_IF_INSERTED`): one round trip for all of them, and its
        INSERT waits for nothing (an idle ADD waited four times: its find, the path's
        result, its INSERT's id, the batch's end; now twice). A read the ADD does not make
        (it joined the item found) was for nothing. Sent with the batch's first
        statements already (ahead.py), they are taken from there: the batch waits once
        for all its ADDs' reads, not once an ADD."""
        if not self._pipelined:
            return  # run guarded, each read waits for its answer as it comes
        self.lock(item.prefix)
        reads = self._batch_ahead.pop(item.path, None)
        if reads is not None and (
            reads.external_id != item.external_id or not reads.asks_as(reuse)
        ):
            # Not the ADD the batch was told of: it reads in its turn, and so do the next
            # ones (the id it takes now must not come after theirs).
            self._batch_ahead.clear()
            reads = None
        if reads is None:
            reads = send_add_reads(self._c.execute, item.prefix, item.key, item.external_id, reuse)
        self._ahead.update(reads.cursors)
        self._result_since = reads.since

    def _read_ahead(self, *asked: Any) -> tuple[bool, tuple[Any, ...] | None]:
        """(True, its row) when `asked` was sent ahead; (False, None) when it was not."""
        cursor = self._ahead.pop(asked, None)
        if cursor is None:
            return False, None
        return True, cursor.fetchone()

    def find(self, key: QueueKey, *, with_payload: bool = False) -> Item | None:
        columns = found_columns(with_payload)
        if isinstance(key, int):
            cursor = None if with_payload else self._foreseen.pop(key, None)
            if cursor is not None:
                row = cursor.fetchone()
                if row is not None:
                    return self._found(row)
            if self._locked:  # an item of a prefix this transaction holds: one statement
                row = self._one(
                    f"SELECT {columns} FROM items WHERE id = %s AND prefix = ANY(%s) FOR UPDATE",
                    (key, list(self._locked)),
                )
                if row is not None:
                    return self._found(row)
            # Items never change prefix: read it unlocked, lock the prefix, then the row.
            found = self._one("SELECT prefix FROM items WHERE id = %s", (key,))
            if found is None:
                return None
            self.lock(found[0])
            row = self._one(f"SELECT {columns} FROM items WHERE id = %s FOR UPDATE", (key,))
        else:
            prefix, _, name = key.rpartition(":")
            self.lock(prefix)
            sent, row = (False, None) if with_payload else self._read_ahead("find", key)
            if not sent:
                query = (
                    f"SELECT {columns} FROM items WHERE prefix = %s AND key = %s FOR UPDATE"
                    if with_payload
                    else FIND_BY_PATH
                )
                row = self._one(query, (prefix, name))
        return None if row is None else self._found(row)

    def _found(self, row: tuple[Any, ...]) -> Item:
        """An item read with its store of origin and the transaction's id (FOUND_COLUMNS)."""
        if self.xid is None:
            self.xid = int(row[-1])
        item = item_from_row(row[:-2])
        self._seen(item, row[-2])
        return item

    def external_id_taken(self, external_id: str) -> bool:
        sent, row = self._read_ahead("external_id", external_id)
        if not sent:
            row = self._one(EXTERNAL_ID_TAKEN, (external_id,))
        return row is not None

    def insert(self, item: Item) -> QueueId:
        self.lock(item.prefix)
        # A savepoint only where a conflict can happen (an external id, unique across
        # prefixes, so not covered by the prefix lock): it leaves the command usable. Not
        # in a pipelined batch: a conflict there runs the batch again, guarded (Redo).
        savepoint = (
            self._conn.transaction()
            if item.external_id is not None and not self._pipelined
            else NO_SAVEPOINT
        )
        self.wrote = True
        values = (*inserted_values(item), self._origin or None)
        _, row = self._read_ahead("id", item.path)
        try:
            with savepoint:
                if row is not None and row[0] is not None:
                    # Its id taken with its reads: nothing to wait for. Refused (its external
                    # id taken on another host meanwhile), the pipeline fails, and the batch
                    # runs again guarded, where the INSERT below says so.
                    self._c.execute(INSERT_ITEM_WITH_ID, (*values, row[0]))
                else:
                    row = self._one(INSERT_ITEM, values)
        except psycopg.errors.UniqueViolation as exc:
            # The path is locked by prefix, so only an external id of another prefix's
            # item, taken meanwhile on another host, gets here.
            raise ExternalIdConflictError(
                f"external id {item.external_id!r} is already used by another queued item"
            ) from exc
        assert row is not None
        self.xid = int(row[1])
        self._seen(replace(item, id=int(row[0])), self._origin)
        if self._head is not None:
            self._head.inserted(replace(item, id=int(row[0])))
        if item.status == "pending":
            self._count(item.prefix, 1, 0)
        else:
            self._count(item.prefix, 0, 1)
            self.known.activated(replace(item, id=int(row[0])))
        return int(row[0])

    def _count(self, prefix: str, pending: int, active: int) -> None:
        self._settle()
        self.wrote = True  # written as the transaction commits (`Known.flush`)
        self.known.count(prefix, pending, active)

    def activate(self, item: Item, now: int, extra: str | None) -> None:
        self._settle()
        self._write_item(
            item,
            "UPDATE items SET status = %s, heartbeat = %s, extra = %s, owner = %s WHERE id = %s",
            (ACTIVE, now, extra, owner_of(self._lease), item.id),
            pending=False,
        )
        self._count(item.prefix, -1, 1)
        self.known.activated(item)

    def deactivate(self, item: Item, now: int) -> None:
        self._settle()
        self._foreseen.pop(item.id, None)
        if self._head is not None:
            self._head.drop()  # a pending item more: read the head again
        self._write(
            "UPDATE items SET status = %s, heartbeat = %s, owner = NULL WHERE id = %s",
            (PENDING, now, item.id),
        )
        self._count(item.prefix, 1, -1)
        self.known.removed(item)

    def set_heartbeat(self, item: Item, now: int) -> None:
        self._write_item(item, "UPDATE items SET heartbeat = %s WHERE id = %s", (now, item.id))

    def set_orphaned(self, item: Item, deadline: int) -> None:
        self._write_item(item, "UPDATE items SET orphaned = %s WHERE id = %s", (deadline, item.id))

    def set_extra(self, item: Item, extra: str | None) -> None:
        self._write_item(item, "UPDATE items SET extra = %s WHERE id = %s", (extra, item.id))

    def delete(self, item: Item) -> None:
        self._settle()
        cursor = self._write_item(
            item,
            "DELETE FROM items WHERE id = %s RETURNING txid_current()",
            (item.id,),
            pending=False,
        )
        if self.xid is None:
            self.xid_cursors.append(cursor)
        if item.status == "pending":
            self._count(item.prefix, -1, 0)
        else:
            self._count(item.prefix, 0, -1)
            self.known.removed(item)

    def counts(self, prefix: str) -> tuple[int, int]:
        self.lock(prefix)
        self._settle()
        known = self.known.counts.get(prefix)
        if known is None:
            row = self._one(
                "SELECT pending, active FROM prefix_counts WHERE prefix = %s", (prefix,)
            )
            known = self.known.stored(prefix, row)
        return known

    def active_keys(self, prefix: str) -> list[str]:
        self.lock(prefix)
        self._settle()
        rows = self.known.active.get(prefix)
        if rows is None:
            rows = self.known.active[prefix] = [
                (int(row[0]), str(row[1]))
                for row in self._all(
                    "SELECT id, key FROM items WHERE prefix = %s AND status = %s ORDER BY id",
                    (prefix, ACTIVE),
                )
            ]
        return [key for _, key in rows]

    def items(
        self,
        prefix: str,
        status: ItemStatus | None,
        *,
        process_id: str | None,
        with_payload: bool,
        limit: int | None,
    ) -> list[Item]:
        if self._head is not None and status == "pending" and with_payload and limit:
            head = self._head.head(prefix, process_id, limit)
            if head is not None:
                return head
        columns = ITEM_COLUMNS + (", payload" if with_payload else "")
        where = "prefix = %s AND (NOT exclusive OR process_id IS NOT DISTINCT FROM %s)"
        params: list[Any] = [prefix, process_id]
        if status is not None:
            where += " AND status = %s"
            params.append(STATUS_CODE[status])
        order = "id" if status == "active" else "priority DESC, id"
        query = f"SELECT {columns} FROM items WHERE {where} ORDER BY {order}"
        if limit is not None:
            query += " LIMIT %s"
            params.append(limit)
        return [item_from_row(row) for row in self._all(query, params)]

    def orphaned_items(self, prefix: str, now: int, orphaned_timeout_ms: int) -> list[Item]:
        rows = self._all(
            f"SELECT {ITEM_COLUMNS} FROM items WHERE prefix = %s AND status = %s"
            " AND (orphaned < %s OR (orphaned IS NULL AND created < %s))"
            " ORDER BY priority DESC, id",
            (prefix, PENDING, now, now - orphaned_timeout_ms),
        )
        return [item_from_row(row) for row in rows]

    def stalled_items(self, prefix: str, now: int, heartbeat_timeout_ms: int) -> list[Item]:
        """Active items whose heartbeat is older than the timeout, or whose host's lease ran
        out (hosts.py)."""
        stalled, params = "coalesce(heartbeat, created) < %s", (now - heartbeat_timeout_ms,)
        if self._lease is not None:
            leased, more = self._lease.stalled_clause(now)
            stalled, params = f"({stalled} OR {leased})", params + more
        rows = self._all(
            f"SELECT {ITEM_COLUMNS} FROM items WHERE prefix = %s AND status = %s"
            f" AND {stalled} ORDER BY id",
            (prefix, ACTIVE, *params),
        )
        return [item_from_row(row) for row in rows]

    def overview(self, now: int) -> tuple[list[PrefixOverview], int]:
        self.known.flush(self._c)
        found = [
            PrefixOverview(prefix, pending, active, self._oldest(prefix))
            for prefix, pending, active in self._all(
                "SELECT prefix, pending, active FROM prefix_counts"
                " WHERE pending > 0 OR active > 0 ORDER BY prefix"
            )
        ]
        # Held, as the statistics count live rows (every host's inserts and deletes, up to
        # a second late): a count(*) would read every result kept.
        row = self._one("SELECT pg_stat_get_live_tuples('results'::regclass)")
        return found, int(row[0]) if row else 0

    def _oldest(self, prefix: str) -> int | None:
        return oldest_of(self._one, prefix, "%s")

    def refresh_active_heartbeats(self, now: int) -> int:
        """This host's active items (and those no host owns): another's that died while
        this one was away still go when its lease or their heartbeats say."""
        self._foreseen.clear()
        cursor = self._write(
            "UPDATE items SET heartbeat = %s WHERE status = %s AND (owner IS NULL OR owner = %s)",
            (now, ACTIVE, owner_of(self._lease)),
        )
        return cursor.rowcount

    def truncate(self) -> None:
        self._settle()
        self._foreseen.clear()
        if self._head is not None:
            self._head.drop()
        self.known = Known()
        # DELETE rather than TRUNCATE: the identity keeps counting, ids are never reused.
        self._write("DELETE FROM items")
        self._write("DELETE FROM results")
        self._write("DELETE FROM prefix_counts")

    def acked(self, item: Item, result: str | None) -> None:
        # Delivered when this transaction commits, to every host listening.
        if item.id in self._notified or self._channel is None:
            return  # with its result's INSERT, or nobody else listens
        note = self._note(item.id, item.path, result is None, item.external_id)
        condition, params = self._notify_condition(item.id, item.path)
        self._write(f"SELECT pg_notify(%s, %s){condition}", (self._channel, note, *params))

    def _note(self, id: QueueId, path: str, null: bool, external_id: str | None) -> str:
        note = {"id": id, "path": path, "null": null, "ext": external_id, "from": self._origin}
        return orjson.dumps(note).decode()
