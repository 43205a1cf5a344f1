"""The shapes of the functions a queue runs, so that a user's mypy checks their handlers.

    def run_sql(query: dict[str, Any], set_cancel_handler: SetCancelHandler) -> list[Row]: ...
    async def run_api(query: Any) -> Any: ...   # no cancel handler to set: one argument

A query handler may be sync (it runs in a thread, or in a worker of the pool) or async; its
return value is the query's result. `set_cancel_handler(value)` records a JSON value that
the cancel handler of the same name receives (inside the query definition, as
`cancelHandler`) when the query is cancelled or times out.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, cast

from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.stream import QueryStream

SetCancelHandler = Callable[[Any], None]
QueryHandler = Callable[[Any, SetCancelHandler], Any]
# What may be registered: a handler that sets a cancel handler, or one that takes the
# query alone.
Handler = Callable[[Any, SetCancelHandler], Any] | Callable[[Any], Any]
# Receives the query definition (a dict: queryHandler, query, queryKey, cancelHandler, ...).
CancelHandler = Callable[[dict[str, Any]], Any]
StreamHandler = Callable[[Any, QueryStream], Awaitable[None]]
SendProcessMessage = Callable[[RetrievedQuery], Awaitable[None]]


def as_query_handler(name: str, function: Handler) -> QueryHandler:
    """`function` as the queue calls it, `(query, set_cancel_handler)`: one that takes the
    query alone is wrapped; one that takes neither shape is a TypeError naming it, when it
    is registered rather than at its first query."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return cast(QueryHandler, function)  # a builtin: trusted as it is
    for arity in (2, 1):
        try:
            signature.bind(*range(arity))
        except TypeError:
            continue
        if arity == 2:
            return cast(QueryHandler, function)
        return _with_cancel_argument(cast(Callable[[Any], Any], function))
    raise TypeError(
        f"handler {name!r}: {getattr(function, '__qualname__', function)}{signature} must take"
        " (query) or (query, set_cancel_handler)"
    )


def _with_cancel_argument(function: Callable[[Any], Any]) -> QueryHandler:
    if inspect.iscoroutinefunction(function):

        async def adapted_async(query: Any, set_cancel_handler: SetCancelHandler) -> Any:
            return await function(query)

        return functools.update_wrapper(adapted_async, function)

    def adapted(query: Any, set_cancel_handler: SetCancelHandler) -> Any:
        return function(query)

    return functools.update_wrapper(adapted, function)
