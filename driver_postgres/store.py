"""The queue store on PostgreSQL: one queue shared by supervisors on several hosts.

The rules are the base class's, as for every store; this module holds all the SQL. What
each guarantee rests on:

* every command is one transaction (READ COMMITTED), or, in the supervisor, a savepoint
  of its batch's: what arrived for one prefix while its last batch ran commits together,
  one COMMIT (one WAL flush) for all of it (`batch`);
* decisions that depend on a prefix's counts (RETRIEVE, ADD_AND_RETRIEVE, and ADD, which
  changes them) hold a transaction-scoped advisory lock on the prefix, taken before any
  row lock, so the concurrency budget holds across hosts and transactions never wait on
  each other in a cycle;
* dedup on path is the UNIQUE (prefix, key) constraint; an external id is unique by a
  unique index (a conflict is ExternalIdConflictError, never a second item);
* RESULT_BLOCKING waiters of every host are woken by a NOTIFY that the ACK sends in its
  own transaction (delivered at commit), while another host listens (this host's own
  waiters are woken in-process; `_others_listen`); a notification missed (a listener
  reconnecting, a host that has just started) costs at most `recheck_ms`, the bounded
  re-check of the store;
* a command (or a batch, whole) whose connection broke before its COMMIT was sent is
  re-run on a fresh connection (it had no effect); one that broke during COMMIT is looked
  up by its transaction id (`txid_status`): committed, its answers stand; aborted, it is
  re-run;
* in-process wake-ups run after the COMMIT, never before (`_after_commit`);
* a server that stops answering is noticed by the watchdog (watchdog.py), not waited for.

Each lane of the store (a thread: engine/lanes.py) has a connection of its own, as has
any other thread that calls a command; one more connection listens.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import orjson
import psycopg
from psycopg import sql

from queryqueue.driver_postgres.ahead import AddAhead, adds_read_ahead
from queryqueue.driver_postgres.lean import Executor, Lean, Rows, Statements
from queryqueue.driver_postgres.schema import ACTIVE, PENDING, migrate
from queryqueue.driver_postgres.watchdog import Watchdog
from queryqueue.engine import validation as v
from queryqueue.engine.aio import wait_within
from queryqueue.engine.clock import Clock
from queryqueue.engine.counts import CountChanges
from queryqueue.engine.errors import ExternalIdConflictError, StoreError
from queryqueue.engine.group_commit import call_before_commit
from queryqueue.engine.records import (
    INSERTED_COLUMNS,
    ITEM_COLUMNS,
    RESULT_COLUMNS,
    STATUS_CODE,
    Item,
    PrefixOverview,
    StoredResult,
    inserted_values,
    item_from_row,
    result_from_row,
)
from queryqueue.engine.responses import ItemStatus, QueueId, QueueKey, ResultResponse, ResultStatus
from queryqueue.engine.result_rules import blocking_lookup
from queryqueue.engine.store import DEFAULT_RESULT_TTL_MS, QueueStore
from queryqueue.engine.waiters import AckEvent, Waiter

# An ACK from another host: the waiter reads the result itself (NOTIFY carries no payload).
_FETCH = "\x00fetch"

T = TypeVar("T")
_log = logging.getLogger(__name__)
RECONNECT_ATTEMPTS = 4
RECONNECT_BACKOFF = 0.05  # then doubled: the attempts span about a third of a second
_NO_SAVEPOINT = contextlib.nullcontext()
LISTEN_CHECK_S = 5.0
# By this long after a listener starts, the hosts that listened alone (and sent no
# NOTIFY) have heard its hello: its waiters then look once more for what they ACKed.
LISTEN_GRACE_S = 1.0
CLAIMED_WAIT_S = 5.0
# The active items a prefix's lock reads with it while there are no more (see schema.py):
# most commands need them or nothing; a prefix with many more reads them when asked.
ACTIVE_PREFETCH = 32
# The rows a pool's PENDING head is read ahead with beyond what it asks for (`_Head`).
HEAD_SPARE = 8
_IDLE, _INTRANS = psycopg.pq.TransactionStatus.IDLE, psycopg.pq.TransactionStatus.INTRANS
_SAVEPOINT = "SAVEPOINT command"
_NEXT_SAVEPOINT = "RELEASE SAVEPOINT command; SAVEPOINT command"
_UNDO_SAVEPOINT = "ROLLBACK TO SAVEPOINT command"
# The reads an ADD may make, the same text whether sent ahead (`expect_add`) or not.
# Locking the row found gives the transaction its id (the row's locker): read with it,
# what a lost COMMIT is looked up by costs no statement (`_commit_in_pipeline`).
_FIND_BY_PATH = (
    f"SELECT {ITEM_COLUMNS}, txid_current() FROM items WHERE prefix = %s AND key = %s FOR UPDATE"
)
_EXTERNAL_ID_TAKEN = "SELECT 1 FROM items WHERE external_id = %s"
# An ACK's item, read with the batch's first statements (`PostgresQueueStore.expect`).
_FIND_BY_ID_IN_PREFIX = (
    f"SELECT {ITEM_COLUMNS}, txid_current() FROM items WHERE id = %s AND prefix = %s FOR UPDATE"
)
_LATEST_RESULT_BY_PATH = (
    f"SELECT {RESULT_COLUMNS} FROM results WHERE path = %s AND expire > %s"
    " AND NOT taken ORDER BY id DESC LIMIT 1 FOR UPDATE"
)
# The id of an ADD that will insert, taken with its reads (`expect_add`), so its INSERT
# waits for no answer. Only then: `nextval` is not rolled back, and an id taken by an ADD
# that joins would be a gap no other store leaves. Whether it inserts is the engine's
# rule (`QueueStore._joined`) asked of the same rows: no item at the path, its external
# id nobody's, and no unread result it may be served (`unread_result`). Otherwise NULL,
# and the INSERT returns its id as it did before.
_ID_IF_INSERTED = (
    "SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM items WHERE prefix = %(prefix)s AND key = %(key)s)"
    " AND (%(external_id)s::text IS NULL"
    "  OR NOT EXISTS (SELECT 1 FROM items WHERE external_id = %(external_id)s))"
    " AND (%(since)s::bigint IS NULL OR NOT COALESCE("
    "  (SELECT NOT deleted AND (%(external_id)s::text IS NULL OR external_id IS NULL"
    "    OR external_id = %(external_id)s)"
    "   FROM results WHERE path = %(path)s AND expire > %(since)s AND NOT taken"
    "   ORDER BY id DESC LIMIT 1), false))"
    " THEN nextval(pg_get_serial_sequence('items', 'id')) END, txid_current()"
)
_RESULT_EXPIRE = RESULT_COLUMNS.split(", ").index("expire")
_INSERT_RESULT = (
    "INSERT INTO results (id, path, value, deleted, expire, external_id, consumed_by)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET"
    " path = excluded.path, value = excluded.value, deleted = excluded.deleted,"
    " expire = excluded.expire, external_id = excluded.external_id,"
    " consumed_by = excluded.consumed_by"
)
_INSERT_ITEM = (
    f"INSERT INTO items ({INSERTED_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s,"
    " %s, %s) RETURNING id, txid_current()"
)
_INSERT_ITEM_WITH_ID = (
    f"INSERT INTO items ({INSERTED_COLUMNS}, id) OVERRIDING SYSTEM VALUE VALUES (%s, %s, %s,"
    " %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)


# The server ends this session (an administrator's terminate, a shutdown, a crash
# restart): read as a statement's answer before the socket is seen closed, it means the
# connection is gone as surely as a broken socket does.
_SESSION_ENDED = (
    psycopg.errors.AdminShutdown,
    psycopg.errors.CrashShutdown,
    psycopg.errors.CannotConnectNow,
    psycopg.errors.DatabaseDropped,
    psycopg.errors.IdleSessionTimeout,
)


def _gone(conn: psycopg.Connection[Any], exc: BaseException) -> bool:
    """The connection cannot be used again (what ran on it since BEGIN did not commit).
    One its server ended is closed here, so that the next command takes a fresh one
    (psycopg would not see it broken until its next write)."""
    if isinstance(exc, _SESSION_ENDED) and not conn.closed:
        with contextlib.suppress(psycopg.Error):
            conn.close()
        return True
    return conn.broken or conn.closed


def _flush_when_read(conn: psycopg.Connection[Any]) -> None:
    """Statements of the connection's pipeline leave together, when an answer is read.

    psycopg's pipeline flushes the socket at every `execute` (a poll and a send each, and
    a wake-up of the backend that then competes for the CPU): ~10 a transaction, 18-43 us
    each at idle on the benchmark machine. libpq itself keeps a pipeline's statements in
    its buffer; psycopg flushes it anyway when a result is read (`_fetch_gen(flush=True)`)
    and at the pipeline's end. So each `execute` only hands its statement to libpq here,
    and a Sync (the pipeline's `sync`, a rollback's) is flushed at once, as what follows
    it waits for its answer without flushing. Relies on psycopg's pipeline internals
    (3.2, 3.3); missing, the pipeline stays as psycopg made it."""
    pipeline = conn._pipeline
    queue = getattr(pipeline, "command_queue", None)
    if pipeline is None or queue is None or not hasattr(pipeline, "_communicate_gen"):
        return
    pgconn = conn.pgconn
    sync = pgconn.pipeline_sync

    def communicate() -> Iterator[Any]:
        synced = False
        while queue:
            command = queue.popleft()
            command()
            synced = synced or command == sync
        if synced:
            yield from psycopg.generators.send(pgconn)

    pipeline._communicate_gen = communicate  # type: ignore[method-assign,assignment]


def prefix_lock_key(schema: str, prefix: str) -> str:
    """The advisory lock a prefix's commands take. Advisory locks are one namespace per
    database: the schema is in the key, or two queues in one database (staging and
    production, two test runs) would wait on each other's prefixes."""
    return f"qq:{schema}:{prefix}"


def _scalar(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


def _answered_xid(*cursors: Rows | None) -> int | None:
    """The transaction id one of these writes returned (`RETURNING txid_current()`), if
    its answer is in already (a pipelined write's comes with the next read, or with the
    pipeline's end): asking for it would cost a round trip."""
    for cursor in cursors:
        if cursor is not None and cursor.pgresult is not None:
            row = cursor.fetchone()
            if row is not None:
                return int(row[0])
    return None


def _answered_by_the_ack(key: QueueKey, event: AckEvent) -> ResultResponse | None:
    """The answer a long poll woken by `event` gives without the database: an ACK with
    NULL (no payload), or a result the ACK's own transaction took for a waiter by id
    (a local ACK). None: the result is read, or consumed, in a transaction of its own.
    Decided on the loop, so such a poll costs no hop to a lane and back."""
    if event.result is None or (event.taken and isinstance(key, int)):
        return ResultResponse(
            payload=event.result,
            type=ResultStatus.SUCCESS,
            id=event.id,
            external_id=event.external_id,
        )
    return None


class _Redo(BaseException):
    """A command failed after writing in a batch run without savepoints: the batch is
    rolled back and run again, each command in a savepoint of its own (`batched`). A
    BaseException: no command's or server's error handling may take it for an answer."""


class _Disconnected(StoreError):
    """The connection broke before COMMIT was sent: the command had no effect."""


class _Known(CountChanges):
    """What a transaction has read of the prefixes it holds locked, kept as it writes:
    their counts (`CountChanges`, written once per prefix as the transaction commits:
    `flush`) and their active items (id, key), by id. Nobody else changes them while the
    lock is held, so a second read within the transaction (RETRIEVE's active list after
    it activates, the next command of a batch) costs no statement."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        super().__init__()
        self.active: dict[str, list[tuple[int, str]]] = {}

    def copy(self) -> _Known:
        known = _Known()
        known.counts, known.deltas = self.keep()
        known.active = {prefix: list(rows) for prefix, rows in self.active.items()}
        return known

    def flush(self, conn: Executor) -> Rows | None:
        """Write the counts' changes: before COMMIT, and before a read of the table.
        Returns the last upsert, which returns the transaction's id (`_answered_xid`)."""
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


class _Ending:
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
            self.xid = _scalar(conn, "SELECT txid_current_if_assigned()")
        self.committing = True


class _Head:
    """The head of a prefix's PENDING as one process sees it (the pool's retrieval, at
    the end of a batch that freed a slot or added work), read with the batch's first
    statements and kept up to date with the batch's own writes: under the prefix's lock
    only this transaction changes the prefix's items, so the window read, less what the
    batch activated or deleted, plus what it inserted pending, is what reading it again
    would find. The retrieval then waits for no read of its own. A window that may have
    lost a row it needs (it was read full, and shrank below what is asked) or whose rows
    changed otherwise answers nothing, and the listing is read as it always was."""

    __slots__ = ("cursor", "full", "limit", "prefix", "process_id", "rows", "valid")

    def __init__(self, prefix: str, process_id: str | None, limit: int, cursor: Rows) -> None:
        self.prefix, self.process_id, self.limit = prefix, process_id, limit
        self.cursor: Rows | None = cursor
        self.rows: list[Item] = []
        self.full = False
        self.valid = True

    def _read(self) -> list[Item]:
        cursor, self.cursor = self.cursor, None
        if cursor is not None:
            self.rows = [item_from_row(row) for row in cursor.fetchall()]
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

    def head(self, prefix: str, process_id: str | None, limit: int) -> list[Item] | None:
        if not self.valid or (prefix, process_id) != (self.prefix, self.process_id):
            return None
        rows = self._read()
        if self.full and len(rows) < limit:
            return None
        return rows[:limit]


@dataclass(slots=True)
class _AddReads:
    """An ADD's reads as sent (`_send_add_reads`): what they asked, and their answers."""

    external_id: str | None
    since: int | None
    cursors: dict[tuple[Any, ...], Rows]


def _send_add_reads(
    execute: Callable[..., Rows],
    prefix: str,
    key: str,
    external_id: str | None,
    result_since: int | None,
) -> _AddReads:
    """The reads an ADD of `prefix:key` may make, and the id it takes if it will insert,
    sent without waiting for their answers; keyed as `PostgresTransaction._read_ahead`
    asks for them (the result's by the path alone: `latest_result_by_path` checks that it
    still holds at its own time)."""
    path = f"{prefix}:{key}"
    cursors: dict[tuple[Any, ...], Rows] = {("find", path): execute(_FIND_BY_PATH, (prefix, key))}
    if external_id is not None:
        cursors["external_id", external_id] = execute(_EXTERNAL_ID_TAKEN, (external_id,))
    if result_since is not None:
        cursors["result", path] = execute(_LATEST_RESULT_BY_PATH, (path, result_since))
    cursors["id", path] = execute(
        _ID_IF_INSERTED,
        {
            "prefix": prefix,
            "key": key,
            "path": path,
            "external_id": external_id,
            "since": result_since,
        },
    )
    return _AddReads(external_id, result_since, cursors)


class _Batch:
    """A group commit in progress on one thread's connection: the prefixes whose lock it
    holds (taken by commands that committed into it) and what it knows of them, whether
    it wrote, and what broke it, if anything (then none of it commits).

    `pipelined`: its first run (see `PostgresQueueStore._pipelined`), without savepoints;
    psycopg's idea of the transaction's state is stale in a pipeline, so the batch says
    itself whether a command of it has been kept yet (`kept`)."""

    __slots__ = (
        "adds",
        "ahead",
        "committing",
        "conn",
        "expected",
        "failure",
        "foreseen",
        "head",
        "kept",
        "known",
        "lean",
        "locked",
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
        self.committing: list[Callable[[], object]] = []  # `before_commit`
        self.prefix = prefix  # locked by the command that opens the transaction
        self.pipelined = pipelined
        self.locked: set[str] = set()
        self.known = _Known()
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
        self.ahead: dict[str, _AddReads] = {}
        # How its statements are sent while pipelined (lean.py); None: psycopg's execute.
        self.lean: Lean | None = None
        # The pool's retrieval it will likely make (`PostgresQueueStore.expect_retrieval`):
        # (prefix, process id, rows), its head read ahead too (`head`).
        self.retrieval: tuple[str, str | None, int] | None = None
        self.head: _Head | None = None

    def answered_xid(self) -> int | None:
        """The transaction's id, if a read or a write's answer gave it already."""
        return self.xid if self.xid is not None else _answered_xid(*self.xid_cursors)


class PostgresTransaction:
    def __init__(
        self,
        conn: psycopg.Connection[Any],
        channel: str | None,
        schema: str,
        locked: set[str] | None = None,
        known: _Known | None = None,
        origin: str = "",
        *,
        pipelined: bool = False,
        foreseen: dict[int, Rows] | None = None,
        head: _Head | None = None,
        executor: Executor | None = None,
        batch_ahead: dict[str, _AddReads] | None = None,
    ) -> None:
        self._conn = conn
        # Where its statements go: the connection, or a pipelined batch's Lean.
        self._c: Executor = executor if executor is not None else conn
        self._pipelined = pipelined
        # Where an ACK's NOTIFY goes; None: no other host listens (none is sent).
        self._channel = channel
        self._origin = origin
        self._schema = schema
        self._locked: set[str] = set(locked or ())
        self.known = known.copy() if known is not None else _Known()
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
        # The batch's reads of items by id, sent ahead (`_Batch.foreseen`): shared by its
        # commands, each dropped once a command changes its item (it would be stale).
        self._foreseen = foreseen if foreseen is not None else {}
        self._head = head

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

    def expect_add(self, item: Item, result_since: int | None) -> None:
        """A pipelined batch's ADD sends its reads together, with its lock, and the id it
        takes if it inserts (`_ID_IF_INSERTED`): one round trip for all of them, and its
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
            reads.external_id != item.external_id or (reads.since is None) != (result_since is None)
        ):
            # Not the ADD the batch was told of: it reads in its turn, and so do the next
            # ones (the id it takes now must not come after theirs).
            self._batch_ahead.clear()
            reads = None
        if reads is None:
            reads = _send_add_reads(
                self._c.execute, item.prefix, item.key, item.external_id, result_since
            )
        self._ahead.update(reads.cursors)
        self._result_since = reads.since

    def _read_ahead(self, *asked: Any) -> tuple[bool, tuple[Any, ...] | None]:
        """(True, its row) when `asked` was sent ahead; (False, None) when it was not."""
        cursor = self._ahead.pop(asked, None)
        if cursor is None:
            return False, None
        return True, cursor.fetchone()

    def find(self, key: QueueKey, *, with_payload: bool = False) -> Item | None:
        columns = ITEM_COLUMNS + (", payload" if with_payload else "") + ", txid_current()"
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
                    else _FIND_BY_PATH
                )
                row = self._one(query, (prefix, name))
        return None if row is None else self._found(row)

    def _found(self, row: tuple[Any, ...]) -> Item:
        if self.xid is None:
            self.xid = int(row[-1])
        return item_from_row(row[:-1])

    def external_id_taken(self, external_id: str) -> bool:
        sent, row = self._read_ahead("external_id", external_id)
        if not sent:
            row = self._one(_EXTERNAL_ID_TAKEN, (external_id,))
        return row is not None

    def insert(self, item: Item) -> QueueId:
        self.lock(item.prefix)
        # A savepoint only where a conflict can happen (an external id, unique across
        # prefixes, so not covered by the prefix lock): it leaves the command usable. Not
        # in a pipelined batch: a conflict there runs the batch again, guarded (_Redo).
        savepoint = (
            self._conn.transaction()
            if item.external_id is not None and not self._pipelined
            else _NO_SAVEPOINT
        )
        self.wrote = True
        values = inserted_values(item)
        _, row = self._read_ahead("id", item.path)
        try:
            with savepoint:
                if row is not None and row[0] is not None:
                    # Its id taken with its reads: nothing to wait for. Refused (its external
                    # id taken on another host meanwhile), the pipeline fails, and the batch
                    # runs again guarded, where the INSERT below says so.
                    self._c.execute(_INSERT_ITEM_WITH_ID, (*values, row[0]))
                else:
                    row = self._one(_INSERT_ITEM, values)
        except psycopg.errors.UniqueViolation as exc:
            # The path is locked by prefix, so only an external id of another prefix's
            # item, taken meanwhile on another host, gets here.
            raise ExternalIdConflictError(
                f"external id {item.external_id!r} is already used by another queued item"
            ) from exc
        assert row is not None
        self.xid = int(row[1])
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
        self.wrote = True  # written as the transaction commits (`_Known.flush`)
        self.known.count(prefix, pending, active)

    def activate(self, item: Item, now: int, extra: str | None) -> None:
        self._settle()
        self._write_item(
            item,
            "UPDATE items SET status = %s, heartbeat = %s, extra = %s WHERE id = %s",
            (ACTIVE, now, extra, item.id),
            pending=False,
        )
        self._count(item.prefix, -1, 1)
        self.known.activated(item)

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
        rows = self._all(
            f"SELECT {ITEM_COLUMNS} FROM items WHERE prefix = %s AND status = %s"
            " AND coalesce(heartbeat, created) < %s ORDER BY id",
            (prefix, ACTIVE, now - heartbeat_timeout_ms),
        )
        return [item_from_row(row) for row in rows]

    # -- results ------------------------------------------------------------------------

    def insert_result(self, result: StoredResult) -> None:
        # A result is only ever inserted as its item is completed (an ACK, or a CANCEL
        # with a result), which then notifies the other hosts listening (`acked`): the
        # NOTIFY rides on this INSERT, one statement (a round of psycopg and a backend
        # wake-up) fewer; with none listening, there is none.
        values = (
            result.id,
            result.path,
            result.value,
            result.deleted,
            result.expire,
            result.external_id,
            result.consumed_by,
        )
        if self._channel is None:
            self._write(_INSERT_RESULT, values)
            return
        self._notified.add(result.id)
        self._write(
            f"WITH stored AS ({_INSERT_RESULT}) SELECT pg_notify(%s, %s)",
            (
                *values,
                self._channel,
                self._note(result.id, result.path, False, result.external_id),
            ),
        )

    def result_by_id(self, id: QueueId, now: int) -> StoredResult | None:
        return result_from_row(
            self._one(
                f"SELECT {RESULT_COLUMNS} FROM results WHERE id = %s AND expire > %s"
                " AND NOT taken FOR UPDATE",
                (id, now),
            )
        )

    def latest_result_by_path(self, path: str, now: int) -> StoredResult | None:
        since, sent, row = self._result_since, False, None
        if since is not None:
            sent, row = self._read_ahead("result", path)
            # Read ahead as of `since` (the batch's start, at most now): the path's latest
            # result unexpired then is its latest now too if it still is, and none then is
            # none now. One that expired between is read again, and so are the next ADDs'
            # reads: the id read ahead with it may not be the one this ADD needs (it may
            # insert in its turn, after the ids the next ones took: they leave theirs
            # unused).
            if sent and (since > now or (row is not None and row[_RESULT_EXPIRE] <= now)):
                self._batch_ahead.clear()
                sent = False
        if not sent:
            row = self._one(_LATEST_RESULT_BY_PATH, (path, now))
        return result_from_row(row)

    def latest_result_by_external_id(self, external_id: str, now: int) -> StoredResult | None:
        return result_from_row(
            self._one(
                f"SELECT {RESULT_COLUMNS} FROM results WHERE external_id = %s AND expire > %s"
                " AND NOT taken ORDER BY id DESC LIMIT 1 FOR UPDATE",
                (external_id, now),
            )
        )

    def mark_result_consumed(self, id: QueueId, consumer: str | None = None) -> None:
        self._write(
            "UPDATE results SET deleted = true, consumed_by = %s WHERE id = %s AND NOT deleted",
            (consumer, id),
        )

    def delete_result(self, id: QueueId) -> None:
        # Taken rather than deleted: gone for every read, but the waiters of other hosts,
        # woken by the same ACK, can still fetch it (see `fetch_acked`) until it expires.
        self._write("UPDATE results SET deleted = true, taken = true WHERE id = %s", (id,))

    def fetch_acked(self, id: QueueId, now: int) -> str | None:
        row = self._one("SELECT value FROM results WHERE id = %s AND expire > %s", (id, now))
        return None if row is None else str(row[0])

    def purge_expired_results(self, now: int, limit: int) -> int:
        # A bounded batch, skipping rows another host is purging: never a long lock.
        # Counted by the statement: a pipelined write has no row count to read yet.
        row = self._write(
            "WITH gone AS (DELETE FROM results WHERE id IN (SELECT id FROM results"
            " WHERE expire <= %s LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING 1)"
            " SELECT count(*) FROM gone",
            (now, limit),
        ).fetchone()
        return 0 if row is None else int(row[0])

    def overview(self, now: int) -> tuple[list[PrefixOverview], int]:
        self.known.flush(self._c)
        oldest = dict(self._all("SELECT prefix, min(created) FROM items GROUP BY prefix"))
        found = [
            PrefixOverview(prefix, pending, active, oldest.get(prefix))
            for prefix, pending, active in self._all(
                "SELECT prefix, pending, active FROM prefix_counts"
                " WHERE pending > 0 OR active > 0 ORDER BY prefix"
            )
        ]
        row = self._one("SELECT count(*) FROM results WHERE expire > %s", (now,))
        return found, int(row[0]) if row else 0

    def refresh_active_heartbeats(self, now: int) -> int:
        self._foreseen.clear()
        cursor = self._write("UPDATE items SET heartbeat = %s WHERE status = %s", (now, ACTIVE))
        return cursor.rowcount

    def truncate(self) -> None:
        self._settle()
        self._foreseen.clear()
        if self._head is not None:
            self._head.drop()
        self.known = _Known()
        # DELETE rather than TRUNCATE: the identity keeps counting, ids are never reused.
        self._write("DELETE FROM items")
        self._write("DELETE FROM results")
        self._write("DELETE FROM prefix_counts")

    def acked(self, item: Item, result: str | None) -> None:
        # Delivered when this transaction commits, to every host listening.
        if item.id in self._notified or self._channel is None:
            return  # with its result's INSERT, or nobody else listens
        note = self._note(item.id, item.path, result is None, item.external_id)
        self._write("SELECT pg_notify(%s, %s)", (self._channel, note))

    def _note(self, id: QueueId, path: str, null: bool, external_id: str | None) -> str:
        note = {"id": id, "path": path, "null": null, "ext": external_id, "from": self._origin}
        return orjson.dumps(note).decode()


class PostgresQueueStore(QueueStore):
    """`statement_timeout`, `lock_timeout` and `idle_in_transaction_timeout` (seconds) are
    set on every session, with TCP keepalives: a command that waits longer (a lock held
    by another client, a database that stopped answering) fails with a StoreError naming
    the timeout, on the store's own thread; the supervisor's loop never waits for it."""

    blocking = True
    shared = True

    def __init__(
        self,
        url: str,
        *,
        schema: str = "queryqueue",
        clock: Clock | None = None,
        result_ttl_ms: int = DEFAULT_RESULT_TTL_MS,
        recheck_ms: int = 1_000,
        safety_recheck_ms: int = 30_000,
        connect_timeout: float = 10.0,
        statement_timeout: float = 30.0,
        lock_timeout: float = 10.0,
        idle_in_transaction_timeout: float = 60.0,
        network_timeout: float | None = None,
        lanes: int = 4,
    ) -> None:
        super().__init__(clock=clock, result_ttl_ms=result_ttl_ms)
        self.lanes = lanes
        # A server that stops answering (a partition, a proxy that stops forwarding) sends
        # no timeout error either: a command with no answer after this long has its
        # connection closed under it and fails with a StoreError naming the wait.
        self.network_timeout = (
            statement_timeout + 5.0 if network_timeout is None else network_timeout
        )
        self.session_options = (
            f"-c statement_timeout={round(statement_timeout * 1000)}"
            f" -c lock_timeout={round(lock_timeout * 1000)}"
            f" -c idle_in_transaction_session_timeout={round(idle_in_transaction_timeout * 1000)}"
        )
        if not schema.replace("_", "").isalnum():
            raise ValueError(f"schema must be letters, digits and _, got {schema!r}")
        self.url = url
        self.schema = schema
        self.recheck_ms = recheck_ms
        self.safety_recheck_ms = safety_recheck_ms
        # LISTEN's state: while it is up no ACK is missed, so parked long polls read the
        # table again only every `safety_recheck_ms`; each reconnect is a new epoch, after
        # which they read it at once (a NOTIFY may have come while it was down).
        self._listen_healthy = False
        self._listen_epoch = 0
        self.connect_timeout = connect_timeout
        self.channel = f"queryqueue_ack_{schema}"
        # Whether another host (a store on this schema elsewhere) listens on the channel:
        # counted by the listener, True until it knows (`_listen`).
        self._others_listen = True
        # Signs this store's NOTIFYs: its own waiters were woken by the ACK as it committed,
        # with the result; its NOTIFY, often first on the listener's thread, would wake
        # them with none, to read it back in a transaction of their own.
        self.origin = uuid.uuid4().hex
        self._hello = orjson.dumps({"hello": True, "from": self.origin}).decode()
        self.reconnects = 0
        # A connection per thread: each lane (and a caller's own thread) has its own.
        self._local = threading.local()
        self._inside = threading.local()
        self._refreshed_at = float("-inf")
        # Prefixes the last batch committed on them left with nothing pending (`batch`).
        self._none_pending: set[str] = set()
        self._closed = False
        self._watchdog = Watchdog(self.network_timeout)
        # The statements each connection has prepared for pipelined batches (lean.py).
        self._statements = Statements()
        conn = self._connect()
        try:
            migrate(conn, schema)
        except psycopg.Error as exc:
            conn.close()
            raise StoreError(f"cannot migrate the queue schema {schema!r}: {exc}") from exc
        self._local.conn = conn
        self._listening = threading.Event()
        self._listener = threading.Thread(
            target=self._listen, name=f"queryqueue-listen-{schema}", daemon=True
        )
        self._listener.start()
        self._listening.wait(connect_timeout)

    # -- connections ----------------------------------------------------------------------

    def _connect(
        self, *, autocommit: bool = False, application_name: str | None = None
    ) -> psycopg.Connection[Any]:
        if self._closed:
            raise StoreError("the queue store is closed")
        try:
            conn = psycopg.connect(
                self.url,
                autocommit=autocommit,
                # A server that accepts but never answers is given no longer than one
                # that answers late.
                connect_timeout=max(1, int(min(self.connect_timeout, self.network_timeout))),
                options=f"-c search_path={self.schema} {self.session_options}",
                # A peer that stops answering is noticed in about 20 s, not hours later.
                keepalives=1,
                keepalives_idle=10,
                keepalives_interval=5,
                keepalives_count=2,
                # Says whose connection this is in pg_stat_activity.
                application_name=application_name or f"queryqueue:{self.schema}",
            )
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to the queue database: {exc}") from exc
        self._watchdog.track(conn)
        return conn

    def _connection(self) -> psycopg.Connection[Any]:
        if self._closed:
            raise StoreError("the queue store is closed")
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                self._watchdog.forget(conn)
                with contextlib.suppress(psycopg.Error):
                    conn.close()
                self.reconnects += 1
            fresh = self._connect()
            self._local.conn = fresh
            if conn is not None:
                self._after_outage(fresh)
            return fresh
        return conn

    def _after_outage(self, conn: psycopg.Connection[Any]) -> None:
        """Back after a broken connection: as at a supervisor's start, active items get a
        fresh heartbeat, since nobody could beat them meanwhile; a live one is not reaped
        for the outage, a dead one still is a heartbeat timeout later. Once per second at
        most: the lanes reconnecting after one outage need it only once, and a flapping
        connection should not pay a transaction per reconnect."""
        now = time.monotonic()
        if now - self._refreshed_at < 1.0:
            return
        try:
            with self._watchdog.watching(conn), conn.transaction():
                PostgresTransaction(
                    conn, self._notifying(), self.schema, origin=self.origin
                ).refresh_active_heartbeats(self.clock.now_ms())
            self._refreshed_at = now
        except psycopg.Error:
            pass  # the command that reconnected reports what is wrong

    @contextmanager
    def batch(self, prefix: str | None = None) -> Iterator[None]:
        """Group commit: the commands run inside (on this thread) share one transaction
        and one COMMIT; each is a savepoint of it, undone alone if it fails, but for the
        first, which opens the transaction (a failing first command rolls it back: it held
        nothing else). Lost with its connection, the whole batch is re-run (`batched`).
        `prefix`: its lock is taken first (by the command that opens the transaction), so
        that commands by queue id about its items find them in one statement (`find`)."""
        if getattr(self._local, "batch", None) is not None:
            yield
            return
        conn = self._connection()
        batch = _Batch(conn, prefix, pipelined=not getattr(self._local, "guarded", True))
        effects: list[Callable[[], object]] = []
        self._local.batch, self._local.effects = batch, effects
        ending = _Ending()
        try:
            with self._ended(conn, ending):
                with self._pipelined(batch):
                    yield  # each command is watched on its own (`_command_in`)
                    if batch.failure is not None:
                        raise batch.failure
                    batch.xid_cursors.append(batch.known.flush(batch.lean or conn))
                    self._committing(batch)
                    if batch.pipelined:
                        self._commit_in_pipeline(batch, ending)
                if conn.info.transaction_status not in (_IDLE, _INTRANS):
                    # A command's undo failed: COMMIT would only roll back, silently.
                    raise StoreError("queue database: the batch's transaction was aborted")
                if conn.info.transaction_status == _INTRANS:
                    with self._watchdog.watching(conn):
                        ending.commit_next(conn, batch.wrote, batch.answered_xid())
                        conn.commit()
            self._saw_pending(batch.known)
        finally:
            self._local.batch = self._local.effects = None
            if not conn.broken and conn.info.transaction_status != _IDLE:  # it did not commit
                with contextlib.suppress(psycopg.Error):
                    conn.rollback()
            self._leave_clean(conn, batch)
        deferred: list[Callable[[], object]] | None = getattr(self._local, "deferred", None)
        if deferred is not None:  # done by whoever defers them (`deferring_effects`)
            deferred.extend(effects)
            return
        for effect in effects:  # decide, then act: only what has committed is told
            effect()

    def _saw_pending(self, known: _Known) -> None:
        """A committed batch's counts: whether each prefix it read has anything pending."""
        for prefix, (pending, _) in known.counts.items():
            if pending == 0:
                self._none_pending.add(prefix)
            else:
                self._none_pending.discard(prefix)

    def nothing_pending_seen(self, prefix: str) -> bool:
        return prefix in self._none_pending

    def before_commit(self, callback: Callable[[], object]) -> None:
        batch: _Batch | None = getattr(self._local, "batch", None)
        if batch is not None:
            batch.committing.append(callback)

    @staticmethod
    def _committing(batch: _Batch) -> None:
        """`before_commit`'s callbacks. In a pipelined batch its writes' answers are not
        in yet either: one refused there has the batch run again (`_Redo`), which calls
        its own; what they started for nothing finds its item gone (an ACK of nothing)."""
        callbacks, batch.committing = batch.committing, []
        call_before_commit(callbacks)

    @contextmanager
    def deferring_effects(self) -> Iterator[list[Callable[[], object]]]:
        effects: list[Callable[[], object]] = []
        self._local.deferred = effects
        try:
            yield effects
        finally:
            self._local.deferred = None

    @staticmethod
    def _leave_clean(conn: psycopg.Connection[Any], batch: _Batch) -> None:
        """A connection the batch could not leave idle and out of autocommit (a pipeline
        cut short by a dying server may be left in any state) is closed, not reused: the
        next command gets a fresh one."""
        try:
            if batch.pipelined and not conn.closed:
                conn.autocommit = False
            if conn.closed or conn.info.transaction_status == _IDLE:
                return
        except psycopg.Error:
            pass
        with contextlib.suppress(psycopg.Error):
            conn.close()

    @contextmanager
    def _pipelined(self, batch: _Batch) -> Iterator[None]:
        """A batch's first run (`batched`) sends its statements without waiting for those
        whose answer it does not read (its writes, and its BEGIN): a read waits for all
        before it, the pipeline's end (one round trip, before COMMIT) for what is left.
        Refused there, a statement has the batch run again, guarded and unpipelined
        (`_Redo`), where it is its own command's error. The BEGIN is the batch's own
        (psycopg's would wait for its answer): in autocommit mode until it ends."""
        if not batch.pipelined:
            yield
            return
        conn = batch.conn
        conn.autocommit = True
        pipeline = conn.pipeline()
        with self._watchdog.watching(conn):
            pipeline.__enter__()
            _flush_when_read(conn)
            batch.lean = self._statements.lean(conn)
            try:
                # Through the lean path where it can: psycopg's cursor for a BEGIN and a
                # COMMIT was ~13 % of its lane's CPU at idle (yappi, 2,000 queries).
                (batch.lean or conn).execute("BEGIN")
            except BaseException as exc:
                with contextlib.suppress(psycopg.Error):
                    pipeline.__exit__(type(exc), exc, exc.__traceback__)
                raise
        try:
            yield
        except BaseException as exc:
            with self._watchdog.watching(conn), contextlib.suppress(psycopg.Error):
                pipeline.__exit__(type(exc), exc, exc.__traceback__)
            raise
        try:
            with self._watchdog.watching(conn):
                pipeline.__exit__(None, None, None)
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise  # the batch changed nothing: it runs again whole (`_ended`)
            raise _Redo from exc

    @staticmethod
    def _commit_in_pipeline(batch: _Batch, ending: _Ending) -> None:
        """COMMIT with the pipeline's end, one round trip for both, when the transaction's
        id is known already or it wrote nothing (else COMMIT follows: the id, looked up
        should COMMIT's answer be lost, comes with the pipeline's end)."""
        xid = batch.answered_xid()
        if batch.wrote and xid is None:
            return
        ending.xid, ending.committing = xid, True
        (batch.lean or batch.conn).execute("COMMIT")

    def _pipelined_failure(
        self, batch: _Batch, tx: PostgresTransaction, exc: BaseException
    ) -> BaseException:
        """What a command of a pipelined batch that failed raises. One that wrote, or
        that the database refused, has the batch run again, guarded (`_Redo`): it cannot
        be undone alone, and the refusal may be an earlier command's. But when nothing of
        the batch is kept yet, a refusal (a lock timeout) is rolled back and the batch
        begins again, as a guarded batch's first command would: run again, it would only
        wait out the same lock."""
        conn = batch.conn
        if isinstance(exc, psycopg.OperationalError) and (
            self._watchdog.abandoned(conn) or _gone(conn, exc)
        ):
            return self._broken(batch, exc)
        if not isinstance(exc, psycopg.Error):
            return _Redo() if tx.wrote else exc
        if batch.kept or tx.wrote:
            return _Redo()
        batch.foreseen.clear()  # read under the lock the rollback lets go
        batch.ahead.clear()
        if batch.head is not None:
            batch.head.drop()
        try:
            with self._watchdog.watching(conn):
                conn.rollback()
                conn.execute("BEGIN")
        except psycopg.Error as undo:
            # Not begun again: nothing more of this batch may run (each statement
            # would commit on its own).
            batch.failure = StoreError(f"queue database: cannot begin again: {undo}")
        if isinstance(exc, psycopg.OperationalError):
            return self._broken(batch, exc)
        return StoreError(f"queue database: {exc}")

    def expect(self, commands: Iterable[Sequence[Any]]) -> None:
        """The ACKs by queue id of a pipelined batch with a prefix (its workers' ACKs, in
        the transaction of the ADDs and the retrieval they free a slot for), and the ADDs
        that come before anything that could change what they read (ahead.py): their
        items, and the ADDs' reads, go with the batch's first statements, so the batch
        waits for all of them at once, not once per ACK or ADD."""
        batch: _Batch | None = getattr(self._local, "batch", None)
        if batch is None or not batch.pipelined or batch.prefix is None:
            return
        commands = list(commands)
        batch.expected = [
            command[1][0]
            for command in commands
            if command[0] == "ack" and command[1] and type(command[1][0]) is int
        ]
        batch.adds = adds_read_ahead(commands, batch.prefix)

    def expect_retrieval(self, prefix: str, process_id: str | None, limit: int) -> None:
        """The pool's retrieval this pipelined batch of `prefix` will likely make (its
        slot freed or work added): the head of PENDING is read with its first statements
        (`_Head`), not after its commands, where it cost a round trip of its own."""
        batch: _Batch | None = getattr(self._local, "batch", None)
        if batch is not None and batch.pipelined and batch.prefix == prefix:
            batch.retrieval = (prefix, process_id, limit)

    def _send_expected(self, batch: _Batch) -> None:
        """`expect`'s reads, after the batch's prefix lock (rows are locked after it, as
        every transaction does, or two could wait on each other)."""
        expected, batch.expected = batch.expected, []
        execute = (batch.lean or batch.conn).execute
        for id in expected:
            if id not in batch.foreseen:
                batch.foreseen[id] = execute(_FIND_BY_ID_IN_PREFIX, (id, batch.prefix))
        retrieval, batch.retrieval = batch.retrieval, None
        if retrieval is not None and batch.head is None:
            prefix, process_id, limit = retrieval
            # Rows to spare: the batch's own activations and deletions take some away.
            window = limit + HEAD_SPARE
            cursor = execute(
                f"SELECT {ITEM_COLUMNS}, payload FROM items WHERE prefix = %s AND status = %s"
                " AND (NOT exclusive OR process_id IS NOT DISTINCT FROM %s)"
                " ORDER BY priority DESC, id LIMIT %s",
                (prefix, PENDING, process_id, window),
            )
            batch.head = _Head(prefix, process_id, window, cursor)
        adds, batch.adds = batch.adds, []
        if adds:
            now = self.clock.now_ms()
            for add in adds:
                batch.ahead[add.path] = _send_add_reads(
                    execute, add.prefix, add.key, add.external_id, now if add.if_no_result else None
                )

    @contextmanager
    def _command_in(self, batch: _Batch) -> Iterator[PostgresTransaction]:
        """One command of a batch. Its effects join the batch's once it has succeeded."""
        if batch.failure is not None:
            raise batch.failure
        conn, outer = batch.conn, self._local.effects
        # The first opens the transaction: failing, it is rolled back (it held nothing
        # else), which spares the one-command batch a savepoint's two round trips.
        pipelined = batch.pipelined
        first = not pipelined and conn.info.transaction_status == _IDLE
        effects: list[Callable[[], object]] = []
        self._local.effects = effects
        tx = PostgresTransaction(
            conn,
            self._notifying(),
            self.schema,
            batch.locked,
            batch.known,
            self.origin,
            pipelined=pipelined,
            foreseen=batch.foreseen,
            head=batch.head,
            executor=batch.lean,
            batch_ahead=batch.ahead,
        )
        try:
            with self._watchdog.watching(conn):
                try:
                    if not (first or pipelined):
                        # The last command's savepoint released and this one's taken in
                        # one round trip (psycopg's own savepoint blocks take two).
                        conn.execute(_NEXT_SAVEPOINT if batch.savepoint else _SAVEPOINT)
                        batch.savepoint = True
                    elif batch.prefix is not None:
                        tx.lock(batch.prefix)  # the batch's prefix, before any row
                        self._send_expected(batch)
                        tx._head = batch.head
                    yield tx
                except BaseException as exc:
                    if isinstance(exc, _Redo):
                        raise
                    if pipelined:
                        failure = self._pipelined_failure(batch, tx, exc)
                        if failure is exc:
                            raise
                        raise failure from exc
                    with contextlib.suppress(psycopg.Error):
                        if first:
                            conn.rollback()
                            batch.savepoint = False
                        elif not conn.broken:
                            conn.execute(_UNDO_SAVEPOINT)
                    if isinstance(exc, psycopg.OperationalError):
                        raise self._broken(batch, exc) from exc
                    if isinstance(exc, psycopg.Error):
                        raise StoreError(f"queue database: {exc}") from exc
                    raise
        finally:
            self._local.effects = outer
        batch.kept = True
        batch.xid = batch.xid if batch.xid is not None else tx.xid
        batch.xid_cursors += tx.xid_cursors
        batch.locked |= tx._locked
        batch.known = tx.known
        batch.wrote = batch.wrote or tx.wrote
        outer.extend(effects)

    def _broken(self, batch: _Batch, exc: psycopg.OperationalError) -> StoreError:
        """The error a batch's command reports: its own (a lock or statement timeout), or,
        when its connection broke, what broke the batch (it is re-run whole)."""
        conn = batch.conn
        if self._watchdog.abandoned(conn):
            batch.failure = StoreError(
                f"the queue database did not answer within the network timeout"
                f" ({self.network_timeout:g} s): its connection was closed"
            )
        elif _gone(conn, exc):
            batch.failure = _Disconnected(f"the queue database went away: {exc}")
        else:
            return StoreError(f"queue database: {exc}")
        return batch.failure

    @contextmanager
    def _atomic(self) -> Iterator[PostgresTransaction]:
        batch: _Batch | None = getattr(self._local, "batch", None)
        if batch is not None:
            with self._command_in(batch) as tx:
                yield tx
            return
        conn = self._connection()
        effects: list[Callable[[], object]] = []
        self._local.effects = effects
        ending = _Ending()
        try:
            with self._watchdog.watching(conn), self._ended(conn, ending), conn.transaction():
                tx = PostgresTransaction(conn, self._notifying(), self.schema, origin=self.origin)
                yield tx
                # Leaving the block sends COMMIT.
                ending.commit_next(conn, tx.wrote, _answered_xid(tx.known.flush(conn)))
        finally:
            self._local.effects = None
        for effect in effects:  # decide, then act: only what has committed is told
            effect()

    @contextmanager
    def _ended(self, conn: psycopg.Connection[Any], ending: _Ending) -> Iterator[None]:
        """psycopg's errors as the store reports them; a connection lost during COMMIT is
        looked up by the transaction's id, and one that committed after all stands."""
        try:
            yield
        except psycopg.OperationalError as exc:
            if not self._committed_after_all(conn, exc, ending.xid, ending.committing):
                raise
        except psycopg.Error as exc:
            raise StoreError(f"queue database: {exc}") from exc

    def _after_commit(self, effect: Callable[[], object]) -> None:
        effects: list[Callable[[], object]] | None = getattr(self._local, "effects", None)
        if effects is None:
            effect()
        else:
            effects.append(effect)

    def _committed_after_all(
        self, conn: psycopg.Connection[Any], exc: Exception, xid: int | None, committing: bool
    ) -> bool:
        """The connection failed under a command: True if its COMMIT took effect anyway,
        else the StoreError that says what happened is raised (a `_Disconnected` when
        nothing did, so that the command runs again)."""
        if self._watchdog.abandoned(conn) and not committing:
            raise StoreError(
                f"the queue database did not answer within the network timeout"
                f" ({self.network_timeout:g} s): its connection was closed"
            ) from exc
        if not _gone(conn, exc):
            raise StoreError(f"queue database: {exc}") from exc
        if not committing:
            raise _Disconnected(f"the queue database went away: {exc}") from exc
        if xid is None:  # it wrote nothing: running it again changes nothing either
            raise _Disconnected(f"the queue database went away: {exc}") from exc
        status = self._transaction_status(xid)
        if status == "committed":
            return True
        if status == "aborted":
            raise _Disconnected(f"the queue database went away before COMMIT: {exc}") from exc
        raise StoreError(
            f"the queue database went away during COMMIT and the outcome is unknown: {exc}"
        ) from exc

    def _transaction_status(self, xid: int) -> str | None:
        """`txid_status` of a transaction whose COMMIT got no answer, asked on a fresh
        connection until the database answers it (a restart takes seconds), within
        `connect_timeout`; None if it never did."""
        deadline = time.monotonic() + self.connect_timeout
        delay = RECONNECT_BACKOFF
        while True:
            try:
                status = _scalar(self._connection(), "SELECT txid_status(%s)", (xid,))
                with contextlib.suppress(psycopg.Error):
                    self._local.conn.rollback()
                if status != "in progress":  # its backend may still be finishing it
                    return None if status is None else str(status)
            except (StoreError, psycopg.Error):
                pass
            if time.monotonic() + delay > deadline:
                return None
            time.sleep(delay)
            # Its lane's other commands (heartbeats among them) queue behind this wait:
            # asked at least every quarter second, it ends soon after the database is back.
            delay = min(delay * 2, 0.25)

    def _run_command(self, run: Callable[[], T]) -> T:
        # The one hook: every command (the command table's decorator) runs through here.
        # A command inside another (STALLED calls TO_CANCEL) is retried by the outer one.
        if getattr(self._inside, "command", False) or getattr(self._local, "batch", None):
            return run()
        self._inside.command = True
        try:
            return self._again_if_disconnected(run)
        finally:
            self._inside.command = False

    def _again_if_disconnected(self, command: Callable[[], T]) -> T:
        """Run `command` again on a fresh connection while its connection broke before
        COMMIT (no attempt changed anything), a bounded number of times with backoff;
        then a StoreError says so."""
        delay = RECONNECT_BACKOFF
        for attempt in range(RECONNECT_ATTEMPTS):
            try:
                return command()
            except _Disconnected as exc:
                last = exc
                if attempt:  # the first retry at once: one broken connection is common
                    time.sleep(delay)
                    delay *= 2
        raise StoreError(
            f"the queue database connection broke {RECONNECT_ATTEMPTS} times in a row: {last}"
        ) from last

    def batched(
        self, work: Callable[[], T], undo: Callable[[T], object], prefix: str | None = None
    ) -> T:
        """Run first without savepoints; a command that failed after writing (or that the
        database refused) has the batch rolled back and run again with them (`_Redo`):
        `work` undoes its own (its waiters) as it unwinds. A batch whose connection broke
        before its COMMIT changed nothing: it runs again whole."""
        once = super().batched

        def attempt() -> T:
            self._local.guarded = False
            try:
                return once(work, undo, prefix)
            except _Redo:
                pass
            finally:
                self._local.guarded = True
            return once(work, undo, prefix)

        return self._again_if_disconnected(attempt)

    def close(self) -> None:
        self._closed = True
        self._stop_thread()
        self._watchdog.close()  # every connection of every thread
        # The listener notices within its poll period and ends by itself (a daemon thread).
        self._listener.join(timeout=0.01)

    # -- LISTEN ----------------------------------------------------------------------------

    def _listen(self) -> None:
        delay = 0.05
        while not self._closed:
            try:
                conn = self._connect(autocommit=True, application_name=self._listener_name())
            except StoreError:
                self._listening.set()  # do not hold up the constructor: re-checks cover
                threading.Event().wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            try:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                # The hosts that listened alone notify from now on (`_publish`).
                conn.execute("SELECT pg_notify(%s, %s)", (self.channel, self._hello))
                self._count_listeners(conn)
                self._listen_epoch += 1
                self._listen_healthy = True
                self._listening.set()
                delay = 0.05
                checked = time.monotonic()
                heard_at: float | None = checked + LISTEN_GRACE_S
                while not self._closed:
                    for note in conn.notifies(timeout=0.5):
                        self._publish(note.payload)
                    now = time.monotonic()
                    if heard_at is not None and now >= heard_at:
                        # What another host ACKed unannounced before it heard the hello
                        # is found by one more look of each waiter (a new epoch).
                        self._listen_epoch += 1
                        heard_at = None
                    if now - checked >= LISTEN_CHECK_S:
                        # A silent connection is no proof of a live one (a partition
                        # delivers nothing either): one that stops answering is replaced.
                        with self._watchdog.watching(conn):
                            self._count_listeners(conn)
                        checked = time.monotonic()
            except psycopg.Error:
                pass  # reconnect; what was missed meanwhile, re-checks find
            finally:
                self._listen_healthy = False
                self._others_listen = True  # not known while not listening
                with contextlib.suppress(psycopg.Error):
                    conn.close()

    def _listener_name(self) -> str:
        # As pg_stat_activity keeps it (NAMEDATALEN - 1 bytes; a schema name is ASCII).
        return f"queryqueue-listen:{self.schema}"[:63]

    def _count_listeners(self, conn: psycopg.Connection[Any]) -> None:
        """Whether another listener of this schema's channel is connected: ACKs notify
        while one is. One connecting later says so itself (its hello, `_publish`)."""
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = %s AND pid <> pg_backend_pid()",
            (self._listener_name(),),
        ).fetchone()
        self._others_listen = row is not None and int(row[0]) > 0

    def _notifying(self) -> str | None:
        """The channel an ACK's NOTIFY goes to, or None while no other host listens."""
        return self.channel if self._others_listen else None

    def _publish(self, payload: str) -> None:
        try:
            note = orjson.loads(payload)
            if note.get("from") == self.origin:
                return
            if "hello" in note:  # another host has started listening
                self._others_listen = True
                return
            event = AckEvent(
                int(note["id"]), str(note["path"]), None if note["null"] else _FETCH, note["ext"]
            )
        except (ValueError, KeyError, TypeError):
            return
        self.waiters.publish(event)

    # -- RESULT_BLOCKING across hosts -------------------------------------------------------

    async def result_blocking(self, key: QueueKey, timeout_ms: int) -> ResultResponse | None:
        """As in every store, but the ACK may come from any host: woken by its NOTIFY; the
        table is read again only when a notification may have been missed."""
        v.check_key(key)
        v.check_non_negative_ms("timeout", timeout_ms)
        return await self._blocking_until(key, self._deadline(timeout_ms), None)

    async def result_blocking_wait(
        self, key: QueueKey, timeout_ms: int, waiter: Waiter
    ) -> ResultResponse | None:
        return await self._blocking_until(key, self._deadline(timeout_ms), waiter)

    @staticmethod
    def _deadline(timeout_ms: int) -> float:
        return asyncio.get_running_loop().time() + timeout_ms / 1000

    async def _blocking_until(
        self, key: QueueKey, deadline: float, waiter: Waiter | None
    ) -> ResultResponse | None:
        """Until `deadline` (loop time): subscribe, look, wait for the ACK; looked again
        whenever a notification may have been missed. `waiter`: subscribed, and its first
        look done already (in a server's batch)."""
        loop = asyncio.get_running_loop()
        while True:
            if waiter is None:
                waiter = self.waiters.subscribe(key)
                try:
                    found: ResultResponse | None = await self.run_off_loop(
                        self._again_if_disconnected, functools.partial(self._lookup, key)
                    )
                except BaseException:
                    self.waiters.unsubscribe(waiter)
                    raise
                if found is not None:
                    self.waiters.unsubscribe(waiter)
                    return found
            try:
                event = await self._await_ack(waiter, deadline)
                if event is None and waiter.claimed:
                    event = await self._claimed_event(waiter)
            finally:
                self.waiters.unsubscribe(waiter)
            if event is not None:
                answered = _answered_by_the_ack(key, event)
                if answered is not None:  # on the loop: nothing to read or write
                    return answered
                taken: ResultResponse | None = await self.run_off_loop(
                    self._again_if_disconnected, functools.partial(self._take, key, event)
                )
                return taken
            if loop.time() >= deadline:
                return None
            waiter = None  # a notification may have been missed: subscribe, read again

    @staticmethod
    async def _claimed_event(waiter: Waiter) -> AckEvent | None:
        """An ACK on a lane took the result for this waiter, which timed out before it
        committed: its event comes as the ACK commits (within CLAIMED_WAIT_S, or it did
        not commit: nothing was taken)."""
        try:
            return await wait_within(waiter.future, CLAIMED_WAIT_S)
        except TimeoutError:
            return None

    async def _await_ack(self, waiter: Waiter, deadline: float) -> AckEvent | None:
        """The ACK's event; None at the deadline, or when a re-check is due: the listener
        is down or came back (a new epoch), or `safety_recheck_ms` passed."""
        loop = asyncio.get_running_loop()
        epoch, since = self._listen_epoch, loop.time()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                return await wait_within(waiter.future, min(remaining, self.recheck_ms / 1000))
            except TimeoutError:
                if (
                    not self._listen_healthy
                    or self._listen_epoch != epoch
                    or loop.time() - since >= self.safety_recheck_ms / 1000
                ):
                    return None

    def _lookup(self, key: QueueKey) -> ResultResponse | None:
        with self._atomic() as tx:
            return blocking_lookup(tx, key, self.clock.now_ms())

    def _take(self, key: QueueKey, event: AckEvent) -> ResultResponse | None:
        """The result `event` announced, read or consumed (`_answered_by_the_ack` was not
        enough)."""
        with self._atomic() as tx:
            value: str | None = event.result
            if value == _FETCH:
                value = tx.fetch_acked(event.id, self.clock.now_ms())
                if value is None:
                    return None  # expired meanwhile
            # As in every store: a waiter by path takes the row, a waiter by id leaves it.
            if isinstance(key, int):
                tx.mark_result_consumed(event.id)
            else:
                tx.delete_result(event.id)
        return ResultResponse(
            payload=value, type=ResultStatus.SUCCESS, id=event.id, external_id=event.external_id
        )
