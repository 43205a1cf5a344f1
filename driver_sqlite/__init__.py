"""The queue store on SQLite in WAL mode."""

from driver_sqlite.store import SqliteQueueStore

__all__ = ["SqliteQueueStore"]
