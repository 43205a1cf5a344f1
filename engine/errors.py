"""The exception family of queryqueue.

A leaf module: it imports nothing of ours, so every layer can raise and catch these.
No storage or socket exception escapes a public API untranslated.
"""

from __future__ import annotations


class QueueError(Exception):
    """Base of every error queryqueue raises on purpose."""


class InvalidCommandError(QueueError, ValueError):
    """A command was given bad input; nothing was changed.

    The message names the argument and what is wrong with it.
    """


class ExternalIdConflictError(InvalidCommandError):
    """EXTERNAL_ID is already carried by another queued item."""


class ExclusiveAccessError(InvalidCommandError):
    """RETRIEVE of an EXCLUSIVE item by a connection that did not declare a process id."""


class StoreError(QueueError):
    """The store itself failed (I/O, corruption, locked database)."""


class SchemaVersionError(StoreError):
    """The database was written by a newer queryqueue than this one."""


class ContinueWaitError(QueueError):
    """The long poll ended before the result arrived; the caller should ask again."""

    def __init__(self, message: str = "Continue wait") -> None:
        super().__init__(message)


class QueryError(QueueError):
    """The query failed; the message is its handler's error message (results carry only that)."""


class QueryTimeoutError(QueueError, TimeoutError):
    """A query ran past its execution timeout (raised inside the executing process)."""


class SupervisorUnavailableError(QueueError, ConnectionError):
    """The supervisor cannot be reached (not running, or gone and not back in time)."""


class CommandRejectedError(QueueError):
    """The supervisor refused a command for a reason with no more specific error here."""


class CommandTimeoutError(QueueError, TimeoutError):
    """The supervisor did not answer a command in time."""
