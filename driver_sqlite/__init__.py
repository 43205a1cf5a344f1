"""The queue store on SQLite in WAL mode."""

from queryqueue.driver_sqlite.store import SqliteQueueStore

__all__ = ["SqliteQueueStore"]
