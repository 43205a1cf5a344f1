"""A query's cancel handler, called wherever the query is cancelled from (by its key, by a
request id, its timeout, or its removal noticed elsewhere), and the query stopped if it
runs in this process."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from queryqueue.engine import events as ev
from queryqueue.engine.connection import QueryDef
from queryqueue.engine.errors import QueryError
from queryqueue.engine.execution import Execution
from queryqueue.engine.responses import QueueId

if TYPE_CHECKING:
    from queryqueue.engine.queue import QueryQueue


async def call_cancel_handler(
    queue: QueryQueue, query_def: QueryDef, queue_id: QueueId | None, execution: Execution | None
) -> None:
    """Call the cancel handler of the query's handler, and stop `execution` (the query
    running here, if it does): an async handler stops; a thread can only be abandoned.
    A failure is an event, never raised."""
    name = query_def.get("queryHandler")
    task = execution.handler_task if execution is not None else None
    running_here = execution is not None and task is not None and not task.done()
    if execution is not None:
        # Delivered: the heartbeat must not report the removal as an external cancel too.
        execution.external_cancel_fired = True
        execution.cancelled = running_here
    try:
        cancel = queue.cancel_handlers.get(str(name))
        if cancel is None:
            if not running_here:
                raise QueryError(f"No cancel handler for {name}")
        else:
            outcome = cancel(query_def)
            if inspect.isawaitable(outcome):
                await outcome
    except Exception as exc:
        queue.events.emit(
            ev.ERROR_WHILE_CANCEL,
            {
                "queueId": queue_id,
                "queryKey": query_def.get("queryKey"),
                "queuePrefix": queue.prefix,
                "error": repr(exc),
            },
        )
    finally:
        if running_here and task is not None:
            task.cancel()
