"""The queue store on PostgreSQL: one queue shared by the supervisors of several hosts.

Needs psycopg 3 (`pip install 'queryqueue[postgres]'`). Without it the name still imports,
so the SQLite default needs nothing more; making a store says what to install."""

from __future__ import annotations

from typing import Any

try:
    from queryqueue.driver_postgres.store import PostgresQueueStore
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] != "psycopg":
        raise
    _missing = exc

    class PostgresQueueStore:  # type: ignore[no-redef]
        """Stands in while psycopg is not installed."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError(
                "PostgresQueueStore needs psycopg 3: pip install 'queryqueue[postgres]'"
            ) from _missing


__all__ = ["PostgresQueueStore"]
