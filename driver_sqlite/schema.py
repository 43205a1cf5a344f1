"""The SQLite schema, in one place, as numbered migrations.

`PRAGMA user_version` records the version; each migration runs in the same transaction
that records it, and a database newer than this code is refused rather than guessed at.
"""

from __future__ import annotations

import sqlite3

from queryqueue.engine.errors import SchemaVersionError

# Statuses as stored; the store speaks "pending"/"active".
PENDING = 0
ACTIVE = 1

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE items (
            id          INTEGER PRIMARY KEY AUTOINCREMENT,  -- the QueueId; never reused
            prefix      TEXT    NOT NULL,
            key         TEXT    NOT NULL,
            status      INTEGER NOT NULL,                   -- 0 pending, 1 active
            priority    INTEGER NOT NULL,
            created     INTEGER NOT NULL,                   -- ms
            heartbeat   INTEGER,                            -- ms
            orphaned    INTEGER,                            -- absolute deadline, ms
            extra       TEXT,
            process_id  TEXT,
            exclusive   INTEGER NOT NULL,
            external_id TEXT,
            payload     TEXT    NOT NULL,                   -- last: scans never read it
            UNIQUE (prefix, key)
        );
        -- PENDING (priority desc, id asc), ACTIVE and the active-key lists
        CREATE INDEX items_queue ON items (prefix, status, priority DESC, id);
        -- ORPHANED: by own deadline, or by creation time for items without one
        CREATE INDEX items_orphaned ON items (prefix, status, orphaned, created);
        -- partial: items without an external id (most) cost no index write
        CREATE UNIQUE INDEX items_external_id ON items (external_id) WHERE external_id IS NOT NULL;

        -- Counters, so ADD and RETRIEVE never count(*) a backlog.
        CREATE TABLE prefix_counts (
            prefix  TEXT PRIMARY KEY,
            pending INTEGER NOT NULL,
            active  INTEGER NOT NULL
        ) WITHOUT ROWID;

        CREATE TABLE results (
            id          INTEGER PRIMARY KEY,                -- the item's QueueId
            path        TEXT    NOT NULL,
            value       TEXT    NOT NULL,
            deleted     INTEGER NOT NULL,                   -- consumed by a path read
            expire      INTEGER NOT NULL,                   -- ms
            external_id TEXT,
            consumed_by TEXT                                -- token of the consuming read
        );
        CREATE INDEX results_path ON results (path, id);
        CREATE INDEX results_external_id ON results (external_id, id) WHERE external_id IS NOT NULL;
        CREATE INDEX results_expire ON results (expire);
        """,
    ),
    (
        2,
        """
        -- ORPHANED reads pending items only: an item inserted active (the fast track) or
        -- deleted active (its ACK) writes no page of this index (one WAL frame each).
        DROP INDEX items_orphaned;
        CREATE INDEX items_orphaned ON items (prefix, orphaned, created) WHERE status = 0;
        """,
    ),
    (
        3,
        """
        -- The counters live in the writer's memory, counted from the items as it opens: a
        -- table of them cost each transaction a statement and a WAL frame.
        DROP TABLE prefix_counts;
        """,
    ),
    (
        4,
        """
        -- The purge of expired results walks the results from the lowest id instead (the
        -- store's purge_expired_results): this index cost every result's INSERT a page
        -- written to the WAL, for a read made once a second.
        DROP INDEX results_expire;
        """,
    ),
]

LATEST_VERSION = MIGRATIONS[-1][0]

# Each prefix's counters, counted from its items: the store as it opens (it keeps them
# in memory from then on), and `queryqueue inspect`.
COUNT_BY_PREFIX = (
    f"SELECT prefix, sum(status = {PENDING}), sum(status = {ACTIVE}) FROM items GROUP BY prefix"
)


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the database to LATEST_VERSION; returns the version found before."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        (found,) = conn.execute("PRAGMA user_version").fetchone()
        if found > LATEST_VERSION:
            raise SchemaVersionError(
                f"database schema version {found} is newer than this queryqueue knows "
                f"({LATEST_VERSION}); upgrade queryqueue"
            )
        for version, script in MIGRATIONS:
            if version > found:
                for statement in _statements(script):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {version}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return int(found)


def _statements(script: str) -> list[str]:
    # executescript() would COMMIT our transaction; split instead (no ';' inside our DDL).
    lines = [line.split("--", 1)[0] for line in script.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]
