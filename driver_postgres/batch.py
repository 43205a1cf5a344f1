"""What one batch of the PostgreSQL store's commands knows and carries: the counts and
active items of the prefixes it holds locked (`Known`), the head of a pool's PENDING
list (`Head`), the reads sent ahead for its ADDs, and how far it got towards its COMMIT
(`Ending`)."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from queryqueue.driver_postgres.ahead import AddAhead
from queryqueue.driver_postgres.lean import Executor, Lean, Rows
from queryqueue.driver_postgres.statements import (
    EXTERNAL_ID_TAKEN,
    FIND_BY_PATH,
    ID_IF_INSERTED,
    LATEST_RESULT_BY_PATH,
    answered_xid,
    scalar,
)
from queryqueue.engine.counts import CountChanges
from queryqueue.engine.errors import StoreError
from queryqueue.engine.records import Item, ResultReuse, item_from_row
from queryqueue.engine.responses import QueueKey
from queryqueue.engine.result_rules import SHARED_REFERENCE_MARK


class Redo(BaseException):
    """A command failed after writing in a batch run without savepoints: the batch is
    rolled back and run again, each command in a savepoint of its own (`batched`). A
    BaseException: no command's or server's error handling may take it for an answer."""


class Disconnected(StoreError):
    """The connection broke before COMMIT was sent: the command had no effect."""


class Known(CountChanges):
    """What a transaction has read of the prefixes it holds locked, kept as it writes:
    their counts (`CountChanges`, written once per prefix as the transaction commits:
    `flush`) and their active items (id, key), by id. Nobody else changes them while the
    lock is held, so a second read within the transaction (RETRIEVE's active list after
    it activates, the next command of a batch) costs no statement."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        super().__init__()
        self.active: dict[str, list[tuple[int, str]]] = {}

    def copy(self) -> Known:
        known = Known()
        known.counts, known.deltas = self.keep()
        known.active = {prefix: list(rows) for prefix, rows in self.active.items()}
        return known

    def flush(self, conn: Executor) -> Rows | None:
        """Write the counts' changes: before COMMIT, and before a read of the table.
        Returns the last upsert, which returns the transaction's id (`answered_xid`)."""
        cursor = None
        for params in self.take_changes():
            cursor = conn.execute(
                "INSERT INTO prefix_counts AS c (prefix, pending, active) VALUES (%s, %s, %s)"
                " ON CONFLICT (prefix) DO UPDATE SET pending = c.pending + excluded.pending,"
                " active = c.active + excluded.active RETURNING txid_current()",
                params,
            )
        return cursor

    def locked(self, prefix: str, row: tuple[Any, ...]) -> None:
        """What `lock_prefix` read as it took the lock (see schema.py)."""
        self.stored(prefix, row[:2])
        if row[2] is not None and prefix not in self.active:
            self.active[prefix] = [(int(i), str(k)) for i, k in zip(row[2], row[3], strict=True)]

    def activated(self, item: Item) -> None:
        rows = self.active.get(item.prefix)
        if rows is not None:
            bisect.insort(rows, (item.id, item.key))

    def removed(self, item: Item) -> None:
        rows = self.active.get(item.prefix)
        if rows is not None and (item.id, item.key) in rows:
            rows.remove((item.id, item.key))


class Ending:
    """How far a transaction got towards its COMMIT, and its id if it wrote: a COMMIT
    whose answer is lost is looked up by it (`txid_status`)."""

    __slots__ = ("committing", "xid")

    def __init__(self) -> None:
        self.xid: int | None = None
        self.committing = False

    def commit_next(
        self, conn: psycopg.Connection[Any], wrote: bool, xid: int | None = None
    ) -> None:
        """`xid`: known already (the counts' upsert returned it), no round trip for it."""
        if xid is not None:
            self.xid = xid
        elif wrote:  # a read-only transaction costs no round trip for it
            self.xid = scalar(conn, "SELECT txid_current_if_assigned()")
        self.committing = True


class Head:
    """The head of a prefix's PENDING as one process sees it (the pool's retrieval, at
    the end of a batch that freed a slot or added work), read with the batch's first
    statements and kept up to date with the batch's own writes: under the prefix's lock
    only this transaction changes the prefix's items, so the window read, less what the
    batch activated or deleted, plus what it inserted pending, is what reading it again
    would find. The retrieval then waits for no read of its own. A window that may have
    lost a row it needs (it was read full, and shrank below what is asked) or whose rows
    changed otherwise answers nothing, and the listing is read as it always was."""

    __slots__ = ("cursor", "full", "limit", "local", "prefix", "process_id", "rows", "valid")

    def __init__(self, prefix: str, process_id: str | None, limit: int, cursor: Rows) -> None:
        self.prefix, self.process_id, self.limit = prefix, process_id, limit
        self.cursor: Rows | None = cursor
        self.rows: list[Item] = []
        # The ids of the window's rows this store added (pool_head.py).
        self.local: set[int] = set()
        self.full = False
        self.valid = True

    def _read(self) -> list[Item]:
        cursor, self.cursor = self.cursor, None
        if cursor is not None:
            self.rows = _read_window(cursor.fetchall(), self.local)
            self.full = len(self.rows) >= self.limit
        return self.rows

    def sees(self, item: Item) -> bool:
        return item.prefix == self.prefix and (
            not item.exclusive or item.process_id == self.process_id
        )

    def inserted(self, item: Item) -> None:
        if not self.valid or item.status != "pending" or not self.sees(item):
            return
        rows, order = self._read(), (-item.priority, item.id)
        at = bisect.bisect([(-row.priority, row.id) for row in rows], order)
        if at < len(rows) or not self.full:  # past a full window: in the part not read
            rows.insert(at, item)
            self.local.add(item.id)  # inserted by this store

    def gone(self, item: Item) -> None:
        """Activated or deleted: no longer pending."""
        if self.valid and self.sees(item):
            self.rows = [row for row in self._read() if row.id != item.id]

    def changed(self, item: Item) -> None:
        """A write to a row the window may hold, other than `gone`'s."""
        if self.valid and self.sees(item) and any(r.id == item.id for r in self._read()):
            self.valid = False

    def drop(self) -> None:
        self.valid, self.cursor, self.rows = False, None, []

    def window(self, prefix: str, process_id: str | None, limit: int) -> list[Item] | None:
        """Every row of the window, when its first `limit` are what a read would find."""
        if not self.valid or (prefix, process_id) != (self.prefix, self.process_id):
            return None
        rows = self._read()
        if self.full and len(rows) < limit:
            return None
        return rows

    def head(self, prefix: str, process_id: str | None, limit: int) -> list[Item] | None:
        rows = self.window(prefix, process_id, limit)
        return None if rows is None else rows[:limit]


def _read_window(rows: list[tuple[Any, ...]], local: set[int]) -> list[Item]:
    """A head's rows, each with whether this store added it (`HEAD_WINDOW`), as items;
    the ids it added, into `local`."""
    items = []
    for row in rows:
        item = item_from_row(row[:-1])
        if row[-1]:
            local.add(item.id)
        items.append(item)
    return items


@dataclass(slots=True)
class AddReads:
    """An ADD's reads as sent (`send_add_reads`): what they asked, and their answers."""

    external_id: str | None
    reuse: ResultReuse | None
    cursors: dict[tuple[Any, ...], Rows]

    @property
    def since(self) -> int | None:
        return None if self.reuse is None else self.reuse.since

    def asks_as(self, reuse: ResultReuse | None) -> bool:
        """Whether they are the reads an ADD reusing `reuse` makes: a result read alone,
        or read with a max age, or none (the max age itself may differ by the ms between
        the batch's start and the ADD's turn: a result that turned too old meanwhile is
        one the ADD inserts for, without the id read ahead)."""
        if self.reuse is None or reuse is None:
            return self.reuse is reuse
        return (self.reuse.fresh_after is None) == (reuse.fresh_after is None)


def send_add_reads(
    execute: Callable[..., Rows],
    prefix: str,
    key: str,
    external_id: str | None,
    reuse: ResultReuse | None,
) -> AddReads:
    """The reads an ADD of `prefix:key` may make, and the id it takes if it will insert,
    sent without waiting for their answers; keyed as `PostgresTransaction._read_ahead`
    asks for them (the result's by the path alone: `latest_result_by_path` checks that it
    still holds at its own time)."""
    path = f"{prefix}:{key}"
    cursors: dict[tuple[Any, ...], Rows] = {("find", path): execute(FIND_BY_PATH, (prefix, key))}
    if external_id is not None:
        cursors["external_id", external_id] = execute(EXTERNAL_ID_TAKEN, (external_id,))
    if reuse is not None:
        cursors["result", path] = execute(LATEST_RESULT_BY_PATH, (path, reuse.since))
    cursors["id", path] = execute(
        ID_IF_INSERTED,
        {
            "prefix": prefix,
            "key": key,
            "path": path,
            "external_id": external_id,
            "since": None if reuse is None else reuse.since,
            "fresh": None if reuse is None else reuse.fresh_after,
            "shared": SHARED_REFERENCE_MARK,
        },
    )
    return AddReads(external_id, reuse, cursors)


class Batch:
    """A group commit in progress on one thread's connection: the prefixes whose lock it
    holds (taken by commands that committed into it) and what it knows of them, whether
    it wrote, and what broke it, if anything (then none of it commits).

    `pipelined`: its first run (see `PostgresQueueStore._pipelined`), without savepoints;
    psycopg's idea of the transaction's state is stale in a pipeline, so the batch says
    itself whether a command of it has been kept yet (`kept`)."""

    __slots__ = (
        "adds",
        "ahead",
        "conn",
        "expected",
        "failure",
        "foreseen",
        "head",
        "kept",
        "known",
        "lean",
        "locked",
        "origins",
        "pipelined",
        "prefix",
        "retrieval",
        "savepoint",
        "wrote",
        "xid",
        "xid_cursors",
    )

    def __init__(
        self, conn: psycopg.Connection[Any], prefix: str | None, *, pipelined: bool = False
    ) -> None:
        self.conn = conn
        self.prefix = prefix  # locked by the command that opens the transaction
        self.pipelined = pipelined
        self.locked: set[str] = set()
        self.known = Known()
        self.wrote = False
        self.kept = False
        self.xid: int | None = None
        self.xid_cursors: list[Rows | None] = []
        self.failure: StoreError | None = None
        self.savepoint = False  # a command's savepoint is open
        # Items its commands will ask for by id (`PostgresQueueStore.expect`): read with
        # the batch's first statements, after its prefix's lock (`foreseen`, by id).
        self.expected: list[int] = []
        self.foreseen: dict[int, Rows] = {}
        # Its ADDs whose reads go with its first statements too (ahead.py), and, sent, those
        # reads by path, until the ADD of the path takes them (`expect_add`).
        self.adds: list[AddAhead] = []
        self.ahead: dict[str, AddReads] = {}
        # How its statements are sent while pipelined (lean.py); None: psycopg's execute.
        self.lean: Lean | None = None
        # The pool's retrieval it will likely make (`PostgresQueueStore.expect_retrieval`):
        # (prefix, process id, rows), its head read ahead too (`head`).
        self.retrieval: tuple[str, str | None, int] | None = None
        self.head: Head | None = None
        # Which items this store added, as its commands that succeeded found them
        # (watches.py), by id and by path.
        self.origins: dict[QueueKey, tuple[bool, str]] = {}

    def answered_xid(self) -> int | None:
        """The transaction's id, if a read or a write's answer gave it already."""
        return self.xid if self.xid is not None else answered_xid(*self.xid_cursors)
