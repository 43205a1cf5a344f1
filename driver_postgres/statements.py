"""The PostgreSQL store's SQL statements and what runs them on a connection: the text of
the reads and writes a command makes (one text whether sent ahead or not), and the
helpers that tell a broken connection and a transaction's id."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg

from queryqueue.driver_postgres.lean import Rows
from queryqueue.engine.records import (
    INSERTED_COLUMNS,
    ITEM_COLUMNS,
    RESULT_COLUMNS,
)

SAVEPOINT = "SAVEPOINT command"
NEXT_SAVEPOINT = "RELEASE SAVEPOINT command; SAVEPOINT command"
UNDO_SAVEPOINT = "ROLLBACK TO SAVEPOINT command"


def found_columns(with_payload: bool = False) -> str:
    """An item as a command finds it: its columns, the store that added it (watches.py)
    and the transaction's id (`PostgresTransaction._found`)."""
    return f"{ITEM_COLUMNS}{', payload' if with_payload else ''}, origin, txid_current()"


FOUND_COLUMNS = found_columns()
# The reads an ADD may make, the same text whether sent ahead (`expect_add`) or not.
# Locking the row found gives the transaction its id (the row's locker): read with it,
# what a lost COMMIT is looked up by costs no statement (`_commit_in_pipeline`).
FIND_BY_PATH = f"SELECT {FOUND_COLUMNS} FROM items WHERE prefix = %s AND key = %s FOR UPDATE"
EXTERNAL_ID_TAKEN = "SELECT 1 FROM items WHERE external_id = %s"
# An ACK's item, read with the batch's first statements (`PostgresQueueStore.expect`).
FIND_BY_ID_IN_PREFIX = f"SELECT {FOUND_COLUMNS} FROM items WHERE id = %s AND prefix = %s FOR UPDATE"
LATEST_RESULT_BY_PATH = (
    f"SELECT {RESULT_COLUMNS} FROM results WHERE path = %s AND expire > %s"
    " AND NOT taken ORDER BY id DESC LIMIT 1 FOR UPDATE"
)
# The id of an ADD that will insert, taken with its reads (`expect_add`), so its INSERT
# waits for no answer. Only then: `nextval` is not rolled back, and an id taken by an ADD
# that joins would be a gap no other store leaves. Whether it inserts is the engine's
# rule (`QueueStore._joined`) asked of the same rows: no item at the path, its external
# id nobody's, and no result it may be served (`reusable_result`: unread, or with a max
# age stored within it and not in shared memory). Otherwise NULL,
# and the INSERT returns its id as it did before.
ID_IF_INSERTED = (
    "SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM items WHERE prefix = %(prefix)s AND key = %(key)s)"
    " AND (%(external_id)s::text IS NULL"
    "  OR NOT EXISTS (SELECT 1 FROM items WHERE external_id = %(external_id)s))"
    " AND (%(since)s::bigint IS NULL OR NOT COALESCE("
    "  (SELECT (NOT deleted OR (expire > %(fresh)s::bigint AND left(value, 8) <> %(shared)s))"
    "   AND (%(external_id)s::text IS NULL OR external_id IS NULL"
    "    OR external_id = %(external_id)s)"
    "   FROM results WHERE path = %(path)s AND expire > %(since)s AND NOT taken"
    "   ORDER BY id DESC LIMIT 1), false))"
    " THEN nextval(pg_get_serial_sequence('items', 'id')) END, txid_current()"
)
RESULT_EXPIRE = RESULT_COLUMNS.split(", ").index("expire")
INSERT_RESULT = (
    "INSERT INTO results (id, path, value, deleted, expire, external_id, consumed_by)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET"
    " path = excluded.path, value = excluded.value, deleted = excluded.deleted,"
    " expire = excluded.expire, external_id = excluded.external_id,"
    " consumed_by = excluded.consumed_by"
)
# An item's columns, then the store that adds it (pool_head.py).
INSERT_ITEM = (
    f"INSERT INTO items ({INSERTED_COLUMNS}, origin) VALUES (%s, %s, %s, %s, %s, %s, %s, %s,"
    " %s, %s, %s, %s, %s) RETURNING id, txid_current()"
)
INSERT_ITEM_WITH_ID = (
    f"INSERT INTO items ({INSERTED_COLUMNS}, origin, id) OVERRIDING SYSTEM VALUE VALUES (%s,"
    " %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)


# The server ends this session (an administrator's terminate, a shutdown, a crash
# restart): read as a statement's answer before the socket is seen closed, it means the
# connection is gone as surely as a broken socket does.
SESSION_ENDED = (
    psycopg.errors.AdminShutdown,
    psycopg.errors.CrashShutdown,
    psycopg.errors.CannotConnectNow,
    psycopg.errors.DatabaseDropped,
    psycopg.errors.IdleSessionTimeout,
)


def gone(conn: psycopg.Connection[Any], exc: BaseException) -> bool:
    """The connection cannot be used again (what ran on it since BEGIN did not commit).
    One its server ended is closed here, so that the next command takes a fresh one
    (psycopg would not see it broken until its next write)."""
    if isinstance(exc, SESSION_ENDED) and not conn.closed:
        with contextlib.suppress(psycopg.Error):
            conn.close()
        return True
    return conn.broken or conn.closed


def flush_when_read(conn: psycopg.Connection[Any]) -> None:
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


def scalar(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


def answered_xid(*cursors: Rows | None) -> int | None:
    """The transaction id one of these writes returned (`RETURNING txid_current()`), if
    its answer is in already (a pipelined write's comes with the next read, or with the
    pipeline's end): asking for it would cost a round trip."""
    for cursor in cursors:
        if cursor is not None and cursor.pgresult is not None:
            row = cursor.fetchone()
            if row is not None:
                return int(row[0])
    return None
