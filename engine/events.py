"""Queue events: Cube's messages and fields, to a `logger(message, fields)` callable and to
Python `logging` (logger `queryqueue.queue`, the fields under `extra={"queue_fields": ...}`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

EventLogger = Callable[[str, dict[str, Any]], None]

ADDED_TO_QUEUE = "Added to queue"
WAITING_FOR_QUERY = "Waiting for query"
FINISHED_WAITING = "Finished waiting for query"
REMOVING_ORPHANED = "Removing orphaned query"
CANCELLING_MANUAL = "Cancelling query manual"
PERFORMING_QUERY = "Performing query"
PERFORMING_COMPLETED = "Performing query completed"
ERROR_WHILE_QUERYING = "Error while querying"
QUERY_CANCELLED = "Query cancelled while it ran"
RETRYING_QUERY = "Retrying query"  # its handler failed with an error its policy retries
CANCELLING_TIMEOUT = "Cancelling query due to timeout"
CANCELLING_EXTERNAL = "Cancelling query due to external cancellation"
HEARTBEAT = "Query processing heartbeat"
ERROR_UPDATING_HEARTBEAT = "Error updating heartbeat"
ERROR_CHECKING_EXTERNAL = "Error checking for external cancellation"
ERROR_QUERY_UPDATE = "Error while query update"
ERROR_WHILE_CANCEL = "Error while cancel"
ORPHANED_RESULT = "Orphaned execution result"
SKIP_PROCESSING = "Skip processing"
QUEUE_STORAGE_ERROR = "Queue storage error"
ERROR_PROCESSING_MESSAGE = "Error while processing message"

_WARNINGS = {
    ORPHANED_RESULT,
    REMOVING_ORPHANED,
    CANCELLING_TIMEOUT,
    CANCELLING_EXTERNAL,
    QUERY_CANCELLED,
    RETRYING_QUERY,
}
_ERRORS = {
    ERROR_UPDATING_HEARTBEAT,
    ERROR_CHECKING_EXTERNAL,
    ERROR_QUERY_UPDATE,
    ERROR_WHILE_CANCEL,
    QUEUE_STORAGE_ERROR,
    ERROR_PROCESSING_MESSAGE,
    ERROR_WHILE_QUERYING,
}

_log = logging.getLogger("queryqueue.queue")


class Events:
    def __init__(self, logger: EventLogger | None = None) -> None:
        self._logger = logger

    def wanted(self, message: str) -> bool:
        """Does anyone listen for `message`? Fields that cost a store round trip (the
        queue listing of "Waiting for query") are only gathered for a listener."""
        return self._logger is not None or _log.isEnabledFor(_level(message))

    def emit(
        self, message: str, fields: dict[str, Any], *, exc_info: BaseException | None = None
    ) -> None:
        if self._logger is not None:
            self._logger(message, fields)
        level = _level(message)
        if _log.isEnabledFor(level):
            _log.log(
                level,
                "%s %s",
                message,
                fields,
                exc_info=exc_info,
                extra={"queue_event": message, "queue_fields": fields},
            )


def _level(message: str) -> int:
    if message in _ERRORS:
        return logging.ERROR
    return logging.WARNING if message in _WARNINGS else logging.DEBUG
