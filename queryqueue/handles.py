"""Typed handles: what `@app.handler(name)` makes of a function.

    @app.handler("sql")
    async def run_sql(query: Sql) -> list[Row]: ...

    rows = await run_sql.run(Sql("SELECT 1"))   # list[Row] to mypy, run in the pool
    rows = await run_sql(Sql("SELECT 1"))       # the function itself, here (a unit test)

The handle knows its queue and its name, so a call site cannot name a handler that does
not exist or pass a query of another type, and its result has the handler's return type
(an async handler's awaited one). Its shape is checked twice: by mypy where the decorator
is applied (the overloads below take `(query)` and `(query, set_cancel_handler)`, sync or
async, nothing else) and by `as_query_handler` as it is registered.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, cast, overload

from queryqueue.engine.handlers import SetCancelHandler, as_query_handler
from queryqueue.engine.retrying import HandlerPolicy

if TYPE_CHECKING:
    from queryqueue.app import QueueApp

Q = TypeVar("Q")  # the query the handler takes
T = TypeVar("T")  # its result, as a caller receives it
P = ParamSpec("P")  # what follows the query: nothing, or set_cancel_handler
R = TypeVar("R")  # what calling the function returns (T, or a coroutine of T)


class QueryHandle(Generic[Q, T, P, R]):
    """A registered query handler: called, it is the function it wraps; `run`,
    `run_sync` and `view` ask the app's supervisor to run it on a query (or join an
    identical one in flight), with `QueueApp.run`'s options."""

    def __init__(self, app: QueueApp, name: str, function: Callable[Concatenate[Q, P], R]):
        self.app = app
        self.name = name
        self.function = function
        functools.update_wrapper(self, function)  # its name, docstring and signature

    def __call__(self, query: Q, *args: P.args, **kwargs: P.kwargs) -> R:
        """The handler itself, run here, as if it had not been registered."""
        return self.function(query, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<QueryHandle {self.app.prefix}:{self.name} of {self.function!r}>"

    async def run(
        self,
        query: Q,
        *,
        key: Any = None,
        priority: int = 0,
        timeout: float | None = None,  # noqa: ASYNC109 - as QueueApp.run's
        request_id: str | None = None,
        execution_timeout: float | None = None,
        max_age: float | None = None,
    ) -> T:
        """`QueueApp.run` of this handler: its result, typed as the handler returns it."""
        result = await self.app.run(
            self.name, query, key=key, priority=priority, timeout=timeout,
            request_id=request_id, execution_timeout=execution_timeout, max_age=max_age,
        )  # fmt: skip
        return cast(T, result)

    def run_sync(
        self,
        query: Q,
        *,
        key: Any = None,
        priority: int = 0,
        timeout: float | None = None,
        request_id: str | None = None,
        execution_timeout: float | None = None,
        max_age: float | None = None,
    ) -> T:
        """`QueueApp.run_sync` of this handler, for code without an event loop."""
        result = self.app.run_sync(
            self.name, query, key=key, priority=priority, timeout=timeout,
            request_id=request_id, execution_timeout=execution_timeout, max_age=max_age,
        )  # fmt: skip
        return cast(T, result)

    @contextlib.asynccontextmanager
    async def view(
        self,
        query: Q,
        *,
        key: Any = None,
        priority: int = 0,
        timeout: float | None = None,  # noqa: ASYNC109 - as QueueApp.run's
    ) -> AsyncIterator[Any]:
        """`QueueApp.view` of this handler: a binary result read in place."""
        async with self.app.view(
            self.name, query, key=key, priority=priority, timeout=timeout
        ) as value:
            yield value


class Registration:
    """`@app.handler(name, ...)`: registers the function it decorates and gives back its
    handle. The overloads are the shapes a handler may have; mypy refuses any other
    where the decorator is applied."""

    def __init__(self, app: QueueApp, name: str, policy: HandlerPolicy) -> None:
        self.app = app
        self.name = name
        self.policy = policy

    @overload
    def __call__(
        self, function: Callable[[Q], Coroutine[Any, Any, T]]
    ) -> QueryHandle[Q, T, [], Coroutine[Any, Any, T]]: ...
    @overload
    def __call__(
        self, function: Callable[[Q, SetCancelHandler], Coroutine[Any, Any, T]]
    ) -> QueryHandle[Q, T, [SetCancelHandler], Coroutine[Any, Any, T]]: ...
    @overload
    def __call__(self, function: Callable[[Q], T]) -> QueryHandle[Q, T, [], T]: ...
    @overload
    def __call__(
        self, function: Callable[[Q, SetCancelHandler], T]
    ) -> QueryHandle[Q, T, [SetCancelHandler], T]: ...
    def __call__(self, function: Callable[..., Any]) -> QueryHandle[Any, Any, ..., Any]:
        if isinstance(function, QueryHandle):  # another app's handler: its function
            function = function.function
        as_query_handler(self.name, function)  # its shape checked now, not at its first query
        self.app.query_handlers[self.name] = function
        if self.policy.applies():
            self.app.handler_policies[self.name] = self.policy
        return QueryHandle(self.app, self.name, function)
