"""The PostgreSQL schema, as numbered migrations.

Everything lives in one schema of the database (default `queryqueue`), so several queues
can share a server. The version is recorded in `schema_version`; migrations run under a
transaction-scoped advisory lock, so supervisors starting together migrate once; a
database newer than this code is refused.
"""

from __future__ import annotations

import re
from typing import Any

from queryqueue.driver_postgres.hosts import MIGRATION as HOSTS_MIGRATION
from queryqueue.engine.errors import SchemaVersionError

PENDING = 0
ACTIVE = 1

MIGRATIONS: list[tuple[int, list[str]]] = [
    (
        1,
        [
            """
            CREATE TABLE items (
                id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- never reused
                prefix      text     NOT NULL,
                key         text     NOT NULL,
                status      smallint NOT NULL,              -- 0 pending, 1 active
                priority    integer  NOT NULL,
                created     bigint   NOT NULL,              -- ms, from the injected clock
                heartbeat   bigint,
                orphaned    bigint,                         -- absolute deadline, ms
                extra       text,
                process_id  text,
                exclusive   boolean  NOT NULL,
                external_id text,
                payload     text     NOT NULL,
                UNIQUE (prefix, key)                        -- dedup on path, enforced here
            )
            """,
            "CREATE INDEX items_queue ON items (prefix, status, priority DESC, id)",
            "CREATE INDEX items_orphaned ON items (prefix, status, orphaned, created)",
            """
            CREATE UNIQUE INDEX items_external_id ON items (external_id)
                WHERE external_id IS NOT NULL
            """,
            """
            CREATE TABLE prefix_counts (
                prefix  text PRIMARY KEY,
                pending integer NOT NULL,
                active  integer NOT NULL
            )
            """,
            """
            CREATE TABLE results (
                id          bigint  PRIMARY KEY,            -- the item's queue id
                path        text    NOT NULL,
                value       text    NOT NULL,
                deleted     boolean NOT NULL,
                expire      bigint  NOT NULL,
                external_id text,
                consumed_by text,
                taken       boolean NOT NULL DEFAULT false  -- by a RESULT_BLOCKING by path
            )
            """,
            "CREATE INDEX results_path ON results (path, id)",
            """
            CREATE INDEX results_external_id ON results (external_id, id)
                WHERE external_id IS NOT NULL
            """,
            "CREATE INDEX results_expire ON results (expire)",
        ],
    ),
    (
        2,
        [
            # A prefix's lock and what a command reads first under it, in one statement:
            # its counts and, while they are few, its active items (id, key) by id. In a
            # function, so that the reads take their snapshot after the lock is granted
            # (a statement's own snapshot would be older than the lock).
            f"""
            CREATE FUNCTION lock_prefix(lock_key text, of_prefix text, active_limit integer)
            RETURNS TABLE (pending integer, active integer, ids bigint[], keys text[])
            LANGUAGE plpgsql VOLATILE AS $$
            BEGIN
                PERFORM pg_advisory_xact_lock(hashtextextended(lock_key, 0));
                SELECT c.pending, c.active INTO pending, active
                    FROM prefix_counts c WHERE c.prefix = of_prefix;
                pending := coalesce(pending, 0);
                active := coalesce(active, 0);
                IF active <= active_limit THEN
                    SELECT coalesce(array_agg(i.id ORDER BY i.id), '{{}}'),
                           coalesce(array_agg(i.key ORDER BY i.id), '{{}}')
                        INTO ids, keys
                        FROM items i WHERE i.prefix = of_prefix AND i.status = {ACTIVE};
                END IF;
                RETURN NEXT;
            END
            $$
            """,
        ],
    ),
    # Which host's store activated an item, and each host's lease on its items (hosts.py).
    (3, HOSTS_MIGRATION),
    # Tables that stay compact under churn. Room on each page (fill factor) lets an update
    # that changes no indexed column stay on its page, with no new index entry (a HOT
    # update): an item's heartbeats and extra, a result read, a prefix's counts (every
    # batch), a host's lease (every tenth of it). Vacuumed after 2 % of a table is dead,
    # not the default 20 %: a queue's tables turn over their whole content all the time.
    (
        4,
        [
            "ALTER TABLE items SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02,"
            " autovacuum_vacuum_threshold = 1000)",
            "ALTER TABLE results SET (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.02,"
            " autovacuum_vacuum_threshold = 1000)",
            "ALTER TABLE prefix_counts SET (fillfactor = 50)",
            "ALTER TABLE hosts SET (fillfactor = 50)",
        ],
    ),
    # The store that added each item: its host's pool takes it first (pool_head.py).
    # Items added before have none, and are every host's alike.
    (5, ["ALTER TABLE items ADD COLUMN origin text"]),
    # The paths a host's long polls wait on where another host may complete the query
    # unannounced (watches.py), until `expire` (ms).
    (6, ["CREATE TABLE watches (path text PRIMARY KEY, expire bigint NOT NULL)"]),
]

LATEST_VERSION = MIGRATIONS[-1][0]


# A schema's name as PostgreSQL keeps an unquoted one: migrations quote it and sessions
# do not (search_path, advisory lock keys), so "QQUpper" would be two schemas at once.
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def check_schema(name: str) -> str:
    """`name`, if it is a lower-case identifier; else a ValueError saying what is."""
    if not isinstance(name, str) or _SCHEMA_NAME.fullmatch(name) is None:
        raise ValueError(
            f"a queue schema is a lower-case identifier (a-z, 0-9 and _, not starting with a"
            f" digit, at most 63 characters), got {name!r}"
        )
    return name


def migrate(conn: Any, schema: str) -> int:
    """Create `schema` if needed and bring it to LATEST_VERSION; returns the version found.

    `conn` is a psycopg connection (not in a transaction)."""
    from psycopg import sql

    with conn.transaction():
        # One migrator at a time, whichever host starts first.
        conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"qq-migrate:{schema}",)
        )
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version integer NOT NULL)")
        row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
        found = int(row[0]) if row and row[0] is not None else 0
        if found > LATEST_VERSION:
            raise SchemaVersionError(
                f"queue schema {schema!r} is at version {found}, newer than this queryqueue "
                f"knows ({LATEST_VERSION}); upgrade queryqueue"
            )
        for version, statements in MIGRATIONS:
            if version > found:
                for statement in statements:
                    conn.execute(statement)
                conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (version,))
    return found
