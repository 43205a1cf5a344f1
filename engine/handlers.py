"""The shapes of the functions a queue runs, so that a user's mypy checks their handlers.

    def run_sql(query: dict[str, Any], set_cancel_handler: SetCancelHandler) -> list[Row]: ...
    async def run_api(query: Any, set_cancel_handler: SetCancelHandler) -> Any: ...

A query handler may be sync (it runs in a thread, or in a worker of the pool) or async; its
return value is the query's result. `set_cancel_handler(value)` records a JSON value that
the cancel handler of the same name receives (inside the query definition, as
`cancelHandler`) when the query is cancelled or times out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.stream import QueryStream

SetCancelHandler = Callable[[Any], None]
QueryHandler = Callable[[Any, SetCancelHandler], Any]
# Receives the query definition (a dict: queryHandler, query, queryKey, cancelHandler, ...).
CancelHandler = Callable[[dict[str, Any]], Any]
StreamHandler = Callable[[Any, QueryStream], Awaitable[None]]
SendProcessMessage = Callable[[RetrievedQuery], Awaitable[None]]
