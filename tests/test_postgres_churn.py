"""A queue's tables on PostgreSQL turn over their whole content all the time: they are
made so that the updates of a running item (its heartbeats) and of a prefix's counts stay
on their page, with no new index entry (HOT updates), and vacuum comes early."""

from __future__ import annotations

import psycopg

from queryqueue.driver_postgres.store import PostgresQueueStore
from tests.postgres_util import URL, drop_schema, fresh_schema, require_postgres
from tests.waiting import wait_until_sync


def _updates(schema: str, table: str) -> tuple[int, int]:
    """(updates, of which HOT) of `table` as the statistics have them."""
    with psycopg.connect(URL, autocommit=True) as conn:
        row = conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
            " WHERE schemaname = %s AND relname = %s",
            (schema, table),
        ).fetchone()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


def test_heartbeats_and_counts_are_updated_in_place() -> None:
    require_postgres()
    schema = fresh_schema()
    store = PostgresQueueStore(URL, schema=schema)
    try:
        queue_id = store.add("p:a", "{}").id
        store.retrieve("p:a", concurrency=1)
        for _ in range(50):
            assert store.heartbeat(queue_id)
        for i in range(50):
            store.add(f"p:more{i}", "{}")
    finally:
        store.close()  # its sessions end: their statistics are reported
    try:
        # All but a few: a page that fills still takes an update elsewhere now and then.
        wait_until_sync(lambda: _updates(schema, "items")[1] >= 45, within=20, what="HOT")
        wait_until_sync(lambda: _updates(schema, "prefix_counts")[1] >= 45, within=20)
        with psycopg.connect(URL, autocommit=True) as conn:
            options = conn.execute(
                "SELECT c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relname = 'items'",
                (schema,),
            ).fetchone()
        assert options is not None and "autovacuum_vacuum_scale_factor=0.02" in options[0]
    finally:
        drop_schema(schema)
