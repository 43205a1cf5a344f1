"""One query executing in this process (`Executor`), and the fields its events carry."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from queryqueue.engine.codec import Codecs
from queryqueue.engine.loop_run import LoopRun
from queryqueue.engine.retrieved import RetrievedQuery


@dataclass(eq=False)
class Execution:
    """One query executing in this process."""

    retrieved: RetrievedQuery
    cancel_handler: Any = None
    cancelled: bool = False  # cancelled from outside: the handler's end is not an error of its own
    stopped: Exception | None = None  # its error, stopped while it ran on the loop's thread
    on_loop: LoopRun | None = None  # its sync handler runs on the loop's thread now
    external_cancel_fired: bool = False
    finished: bool = False  # the handler is done: the heartbeat loop must end
    handler_task: asyncio.Future[Any] | None = None
    side_tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    timeout: float = 0.0  # seconds it has, every attempt of its handler included


def query_of(retrieved: RetrievedQuery, codecs: Codecs) -> Any:
    """The query its handler gets: typed values (`queryTypes`) given back their types (a
    tree that does not fit fails the query with a `QueryError`)."""
    value = retrieved.query.get("query")
    types = retrieved.query.get("queryTypes")
    return value if types is None else codecs.decode(value, types)


def execution_context(prefix: str, retrieved: RetrievedQuery) -> dict[str, Any]:
    """The fields of the events about an execution (Cube's, by their names)."""
    query = retrieved.query
    inner = query.get("query")
    flags: Mapping[str, Any] = inner if isinstance(inner, Mapping) else {}
    return {
        "queueId": retrieved.queue_id,
        "processingId": retrieved.processing_id,
        "queryKey": query.get("queryKey"),
        "queuePrefix": prefix,
        "requestId": query.get("requestId"),
        "queueSize": retrieved.queue_size,
        "addedToQueueTime": query.get("addedToQueueTime"),
        "metadata": flags.get("metadata"),
        "preAggregationId": None,
        "newVersionEntry": flags.get("newVersionEntry"),
        "preAggregation": flags.get("preAggregation"),
    }
