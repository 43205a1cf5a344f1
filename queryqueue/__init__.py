"""queryqueue: identical in-flight queries run once, each queue has a concurrency budget,
urgent work goes first, and callers wait for results across processes.

    from queryqueue import QueueApp

    app = QueueApp("sql", concurrency=4)

    @app.handler("sql")
    def run_sql(query: dict[str, Any]) -> list[list[Any]]: ...

    rows = await run_sql.run({"sql": "SELECT 1"})   # or run_sql.run_sync(...)

Every public name is importable from here; the subpackages (`queryqueue.engine`, the
stores, `queryqueue.supervisor`) are the implementation and may move.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from queryqueue.app import QueueApp
from queryqueue.client import Client
from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.driver_sqlite import SqliteQueueStore
from queryqueue.engine.binary import ResultView
from queryqueue.engine.codec import Codecs
from queryqueue.engine.driver import LocalQueueDriver, QueueDriver
from queryqueue.engine.errors import (
    AuthenticationError,
    CommandRejectedError,
    CommandTimeoutError,
    ContinueWaitError,
    ExclusiveAccessError,
    ExternalIdConflictError,
    InvalidCommandError,
    QueryCancelledError,
    QueryError,
    QueryTimeoutError,
    QueueClosedError,
    QueueError,
    ResultTooLargeError,
    SchemaVersionError,
    StoreError,
    SupervisorUnavailableError,
    UnknownHandlerError,
    UnknownQueueError,
    WorkerLostError,
)
from queryqueue.engine.handlers import CancelHandler, QueryHandler, SetCancelHandler
from queryqueue.engine.hashing import hash_query_key
from queryqueue.engine.memory_store import MemoryQueueStore
from queryqueue.engine.queue import QueryQueue
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.store import QueueStore
from queryqueue.engine.stream import QueryStream
from queryqueue.engine.sync import SyncQueryQueue
from queryqueue.engine.version import package_version
from queryqueue.handles import QueryHandle

if TYPE_CHECKING:
    from queryqueue.driver_postgres import PostgresQueueStore

__version__ = package_version()

__all__ = [
    "AuthenticationError",
    "CancelHandler",
    "Client",
    "Codecs",
    "CommandRejectedError",
    "CommandTimeoutError",
    "ContinueWaitError",
    "ExclusiveAccessError",
    "ExternalIdConflictError",
    "InvalidCommandError",
    "LocalQueueDriver",
    "MemoryQueueStore",
    "PostgresQueueStore",
    "QueryCancelledError",
    "QueryError",
    "QueryHandle",
    "QueryHandler",
    "QueryQueue",
    "QueryStream",
    "QueryTimeoutError",
    "QueueApp",
    "QueueClosedError",
    "QueueDriver",
    "QueueError",
    "QueueStore",
    "ResultTooLargeError",
    "ResultView",
    "RetrievedQuery",
    "SchemaVersionError",
    "SetCancelHandler",
    "SocketQueueDriver",
    "SqliteQueueStore",
    "StoreError",
    "SupervisorUnavailableError",
    "SyncQueryQueue",
    "UnknownHandlerError",
    "UnknownQueueError",
    "WorkerLostError",
    "__version__",
    "hash_query_key",
]


if not TYPE_CHECKING:  # hidden from mypy, which then checks every other name users import

    def __getattr__(name: str) -> Any:
        # psycopg is an extra: the PostgreSQL store is imported on first use, not with the
        # package (and without psycopg it imports a stand-in that says what to install).
        if name == "PostgresQueueStore":
            from queryqueue.driver_postgres import PostgresQueueStore

            return PostgresQueueStore
        raise AttributeError(f"module 'queryqueue' has no attribute {name!r}")
