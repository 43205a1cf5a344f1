"""The exception family of queryqueue.

A leaf module: it imports nothing of ours, so every layer can raise and catch these.
No storage or socket exception escapes a public API untranslated.
"""

from __future__ import annotations

from typing import Any


class QueueError(Exception):
    """Base of every error queryqueue raises on purpose."""


class InvalidCommandError(QueueError, ValueError):
    """A command was given bad input; nothing was changed.

    The message names the argument and what is wrong with it.
    """


class UnknownQueueError(InvalidCommandError):
    """An ADD for a queue the supervisor's pools do not serve (a typo in a prefix, two
    projects on one socket): refused at once, naming the queues served."""


class UnknownHandlerError(InvalidCommandError):
    """An ADD for a handler the queue's app does not have: refused at once, naming the
    handlers it has."""


class ExternalIdConflictError(InvalidCommandError):
    """EXTERNAL_ID is already carried by another queued item."""


class ExclusiveAccessError(InvalidCommandError):
    """RETRIEVE of an EXCLUSIVE item by a connection that did not declare a process id."""


class StoreError(QueueError):
    """The store itself failed (I/O, corruption, locked database)."""


class SchemaVersionError(StoreError):
    """The database was written by a newer queryqueue than this one."""


class ContinueWaitError(QueueError):
    """The long poll ended before the result arrived; the caller should ask again.

    `queue_id` names the item waited for, when there was one: `run()` re-polls it."""

    def __init__(self, message: str = "Continue wait", *, queue_id: int | None = None) -> None:
        super().__init__(message)
        self.queue_id = queue_id


class QueryError(QueueError):
    """The query failed: its handler raised, in whichever process ran it.

    `error_type` is the name of the handler's exception class and `remote_traceback` the
    traceback text where the executing process sent one (None for errors of Cube clients,
    whose results carry only a message)."""

    def __init__(
        self,
        message: str,
        *,
        error_type: str | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only fields survive pickling (a worker, a multiprocessing result).
        return (_rebuild, (type(self), str(self), self.error_type, self.remote_traceback))


def _rebuild(
    cls: type[QueryError], message: str, error_type: str | None, remote_traceback: str | None
) -> QueryError:
    return cls(message, error_type=error_type, remote_traceback=remote_traceback)


class QueryCancelledError(QueryError):
    """The query was cancelled (by `cancel_query`, `queryqueue cancel`, or by request id)
    while its callers waited: every waiter gets this, and nothing runs it again."""


class WorkerLostError(QueryError):
    """The query killed the worker running it too many times (`--max-worker-deaths`): it
    is not run again."""


class QueryTimeoutError(QueryError, TimeoutError):
    """A query ran past its execution timeout, or a caller's `run(..., timeout=)` deadline
    passed before its result arrived."""


class ResultTooLargeError(QueueError):
    """A result no transport can carry (no room in shared memory, and over the socket's
    frame limit): the query fails with this error for its waiters instead."""


class QueueClosedError(QueueError):
    """The queue was closed (`close()`): it takes no new work."""


class SupervisorUnavailableError(QueueError, ConnectionError):
    """The supervisor cannot be reached (not running, or gone and not back in time)."""


class AuthenticationError(QueueError):
    """A TCP client did not present the supervisor's auth token."""


class CommandRejectedError(QueueError):
    """The supervisor refused a command for a reason with no more specific error here."""


class CommandTimeoutError(QueueError, TimeoutError):
    """The supervisor did not answer a command in time."""
