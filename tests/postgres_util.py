"""PostgreSQL for tests: a fresh schema per store, dropped when the store closes; the
test is skipped, with the reason, when no server is reachable."""

from __future__ import annotations

import functools
import os
import uuid
from typing import Any

import pytest

URL = os.environ.get("QUERYQUEUE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


@functools.cache
def unavailable() -> str | None:
    """Why PostgreSQL tests cannot run here, or None."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install -e '.[test]')"
    try:
        with psycopg.connect(URL, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return f"no PostgreSQL server at {URL}: {str(exc).strip().splitlines()[0]}"
    return None


def require_postgres() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


def fresh_schema() -> str:
    return f"qq_t_{uuid.uuid4().hex[:12]}"


def drop_schema(schema: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(URL, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def postgres_store(**options: Any) -> Any:
    """A PostgresQueueStore on a schema of its own; closing it drops the schema."""
    require_postgres()
    from queryqueue.driver_postgres.store import PostgresQueueStore

    schema = options.pop("schema", None) or fresh_schema()
    store = PostgresQueueStore(URL, schema=schema, **options)
    close = store.close

    def close_and_drop() -> None:
        close()
        drop_schema(schema)

    store.close = close_and_drop  # type: ignore[method-assign]
    return store
