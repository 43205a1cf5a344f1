"""QueueApp: the queue's definition, written once and imported by every process.

    app = QueueApp("sql", concurrency=4)

    @app.handler("sql")
    def run_sql(query: str) -> list[Row]: ...

The supervisor loads it (`--app pkg.module:app`) to run handlers in its worker pool;
request processes call `await run_sql.run(query)` (or `run_sql.run_sync(query)` without
an event loop; `app.run("sql", query)` by name) against the same supervisor, and the pool
runs the query whatever its priority.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import importlib
import inspect
import os
import sys
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Never, TypeVar

from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.engine.codec import Codecs
from queryqueue.engine.driver import QueueDriver
from queryqueue.engine.events import EventLogger
from queryqueue.engine.handlers import CancelHandler, Handler, SendProcessMessage, StreamHandler
from queryqueue.engine.queue import QueryQueue
from queryqueue.engine.retrying import HandlerPolicy
from queryqueue.engine.store import QueueStore
from queryqueue.engine.sync import SyncQueryQueue
from queryqueue.handles import Registration
from queryqueue.hooks import Hook, WorkerHooks, checked

F = TypeVar("F", bound=Callable[..., Any])
K = TypeVar("K", bound=Hook)


class QueueApp:
    """A queue's definition, imported by every process: its prefix, options and handlers
    for the supervisor's pool; `run` and its kin for the processes that ask."""

    def __init__(
        self,
        prefix: str,
        *,
        socket_path: str | Path | None = None,
        worker_concurrency: int = 1,
        concurrency: int | None = None,
        continue_wait_timeout: float | None = None,
        execution_timeout: float | None = None,
        orphaned_timeout: float | None = None,
        heartbeat_interval: float | None = None,
        fast_track: bool | None = None,
        logger: EventLogger | None = None,
        **unknown: Never,
    ) -> None:
        """The queue `prefix`, as every process sees it. `socket_path`: the supervisor
        callers ask (None: $QUERYQUEUE_SOCKET, then the default path).
        `worker_concurrency`: queries each worker process runs at once (async handlers as
        tasks on its loop, sync ones on its threads); 1, the default, suits CPU-bound
        handlers, more suits handlers that wait on a data source. The others are
        QueryQueue's (None: its default). A name it does not take is a `TypeError` here,
        and mypy's error, not a surprise at the first query."""
        _check_options(unknown)
        if isinstance(worker_concurrency, bool) or not isinstance(worker_concurrency, int):
            raise TypeError(f"worker_concurrency is a number, not {worker_concurrency!r}")
        if worker_concurrency < 1:
            raise ValueError(f"worker_concurrency must be 1 or more, not {worker_concurrency}")
        self.worker_concurrency = worker_concurrency
        given = {
            "concurrency": concurrency,
            "continue_wait_timeout": continue_wait_timeout,
            "execution_timeout": execution_timeout,
            "orphaned_timeout": orphaned_timeout,
            "heartbeat_interval": heartbeat_interval,
            "fast_track": fast_track,
            "logger": logger,
        }
        self.prefix = prefix
        # What it sets, no more: the supervisor's pool reads its budget and timeouts here.
        self.queue_options: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        # Results' types, both ways: workers encode and callers decode with the same ones.
        self.codecs = Codecs()
        self.query_handlers: dict[str, Handler] = {}
        self.handler_policies: dict[str, HandlerPolicy] = {}
        self.cancel_handlers: dict[str, CancelHandler] = {}
        self.stream_handler: StreamHandler | None = None
        # One client queue per process and event loop, made on first use. Weak keys: a
        # closed loop's queue goes with it (an id() key could be reused by the next loop).
        self._queues: dict[int, weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, QueryQueue]]
        self._queues = {}
        self._sync_queues: dict[int, SyncQueryQueue] = {}  # by pid: a fork makes its own
        self.socket_path = Path(socket_path) if socket_path is not None else None
        self.hooks = WorkerHooks()
        # What a worker's start hooks open for its queries to share (`on_worker_start`).
        self.state = SimpleNamespace()

    def handler(
        self,
        name: str,
        *,
        retries: int = 0,
        retry_on: tuple[type[BaseException], ...] = (Exception,),
        backoff: float = 0.5,
        execution_timeout: float | None = None,
        max_age: float | None = None,
    ) -> Registration:
        """Register the query handler `name`: `(query)` or `(query, set_cancel_handler)`,
        sync or async; its return value is the query's result. It becomes a typed
        `QueryHandle`: `await handle.run(query)` runs it in the pool, and returns what the
        function returns; calling the handle calls the function. Any other signature is
        a TypeError here (and mypy's error where the decorator is applied).

        `retries`: run it again, up to that many times, when it raises one of `retry_on`
        (transient errors of a data source), `backoff` seconds later, doubled each time,
        with jitter; all attempts share the execution timeout: the queue's, or
        `execution_timeout` where it is shorter. `max_age`: the default of its calls'
        `max_age` (see `run`)."""
        return Registration(
            self, name, HandlerPolicy(retries, retry_on, backoff, execution_timeout, max_age)
        )

    def on_worker_start(self, hook: K) -> K:
        """Register `hook()` (sync or async) to run in each worker process before it takes
        a query: open what its queries share there (a connection pool into `app.state`)."""
        self.hooks.on_start.append(checked(hook))
        return hook

    def on_worker_stop(self, hook: K) -> K:
        """Register `hook()` (sync or async) to run in each worker process once its last
        query has ended: close what a start hook opened."""
        self.hooks.on_stop.append(checked(hook))
        return hook

    def cancel_handler(self, name: str) -> Callable[[F], F]:
        """Register the cancel handler of handler `name`: it gets the query's definition,
        `cancelHandler` in it what the handler set, when the query is cancelled or times out."""

        def register(function: F) -> F:
            self.cancel_handlers[name] = function
            return function

        return register

    def stream(self, function: F) -> F:
        """Register the stream handler: `(query, stream)`, writing rows to `stream`."""
        self.stream_handler = function
        return function

    def codec(
        self,
        cls: type,
        name: str | None = None,
        *,
        encode: Callable[[Any], Any] | None = None,
        decode: Callable[[Any], Any] | None = None,
    ) -> None:
        """Results may hold `cls`: `encode` makes JSON of it, `decode` gives it back (a
        dataclass needs neither). See `engine/codec.py` for what is built in."""
        self.codecs.register(cls, name, encode=encode, decode=decode)

    def make_queue(
        self,
        driver: QueueDriver | QueueStore | None,
        *,
        send_process_message_fn: SendProcessMessage | None = None,
        **overrides: Any,
    ) -> QueryQueue:
        """A `QueryQueue` of this app on `driver` (a store, a driver; None: in memory),
        `overrides` over its options."""
        options = {**self.queue_options, **overrides}
        return QueryQueue(
            self.prefix,
            query_handlers=self.query_handlers,
            cancel_handlers=self.cancel_handlers,
            stream_handler=self.stream_handler,
            driver=driver,
            send_process_message_fn=send_process_message_fn,
            codecs=self.codecs,
            handler_policies=self.handler_policies,
            **options,
        )

    def pool_queue(self, driver: SocketQueueDriver, **overrides: Any) -> QueryQueue:
        """A queue on the supervisor whose executions are handed to its worker pool (the
        driver's `hand_off`; streams stay here, where their stream lives).

        The supervisor reconciles for its pool (after every ADD and ACK, in process, next
        to the store), so this process reconciles only for its own stream items."""
        overrides.setdefault("reconcile", False)
        return self.make_queue(driver, **overrides)

    def client_queue(self) -> QueryQueue:
        """This process's queue on the supervisor, with executions handed to its pool."""
        queues = self._queues.setdefault(os.getpid(), weakref.WeakKeyDictionary())
        loop = asyncio.get_running_loop()
        queue = queues.get(loop)
        if queue is None:
            queue = queues[loop] = self.pool_queue(self._driver())
        return queue

    async def run(
        self,
        query_handler: str,
        query: Any,
        *,
        key: Any = None,
        priority: int = 0,
        timeout: float | None = None,  # noqa: ASYNC109 - the caller's deadline, like Future.result(timeout)
        request_id: str | None = None,
        execution_timeout: float | None = None,
        max_age: float | None = None,
    ) -> Any:
        """Run the query in the supervisor's pool (or join an identical one in flight) and
        return its result: `QueryQueue.run` on this process's queue. `key`: what makes two
        calls the same query, sharing one execution (None: the query itself, so identical
        queries share and different ones never do). `execution_timeout`: seconds its
        execution may take, where shorter than its handler's and queue's. `max_age`:
        answer from the query's stored result if it is younger than that many seconds,
        read before or not, without running it again (None: the handler's `max_age`, if
        it has one; else only a result nobody has read yet). A handle's `run` is this,
        typed."""
        return await self.client_queue().run(
            query_handler,
            query if key is None else key,
            query,
            priority=priority,
            timeout=timeout,
            request_id=request_id,
            execution_timeout=execution_timeout,
            max_age=max_age,
        )

    @contextlib.asynccontextmanager
    async def view(
        self,
        query_handler: str,
        query: Any,
        *,
        key: Any = None,
        priority: int = 0,
        timeout: float | None = None,  # noqa: ASYNC109 - as run's
    ) -> AsyncIterator[Any]:
        """`run`, reading a binary result in place: an Arrow table over the shared memory
        the worker wrote, valid inside the `async with` (its lease ends on exit, or with the
        process). A result that was not in shared memory is a private copy."""
        view = await self.client_queue().run(
            query_handler,
            query if key is None else key,
            query,
            priority=priority,
            timeout=timeout,
            view=True,
        )
        try:
            yield view.value
        finally:
            await view.release()

    def run_sync(
        self,
        query_handler: str,
        query: Any,
        *,
        key: Any = None,
        priority: int = 0,
        timeout: float | None = None,
        request_id: str | None = None,
        execution_timeout: float | None = None,
        max_age: float | None = None,
    ) -> Any:
        """`run` for code without an event loop (a Flask or Django view, a thread): blocks
        until the result. Nothing runs in this process, whatever the priority."""
        return self.sync_queue().run(
            query_handler,
            query if key is None else key,
            query,
            priority=priority,
            timeout=timeout,
            request_id=request_id,
            execution_timeout=execution_timeout,
            max_age=max_age,
        )

    def sync_queue(self) -> SyncQueryQueue:
        """This process's sync face on the supervisor (made on first use, on a private loop)."""
        queue = self._sync_queues.get(os.getpid())
        if queue is None:
            queue = self._sync_queues[os.getpid()] = SyncQueryQueue(
                make=lambda: self.pool_queue(self._driver())
            )
        return queue

    def _driver(self) -> SocketQueueDriver:
        return SocketQueueDriver(self.socket_path, decode_in_place=True)

    async def cancel(self, query_key: Any) -> bool:
        """Cancel the query of this key (or this query, asked without one): its waiters get
        `QueryCancelledError`, the worker running it its cancel handler. False if it was
        neither queued nor running."""
        queue = self.client_queue()
        return await queue.cancel_query(queue.hash_query_key(query_key))

    async def execute_in_queue(
        self, query_handler: str, query_key: Any, query: Any, priority: int = 0, **options: Any
    ) -> Any:
        """Cube's call: one long poll, `ContinueWaitError` if it ends first (see `run`)."""
        return await self.client_queue().execute_in_queue(
            query_handler, query_key, query, priority, **options
        )

    async def aclose(self, grace: float = 5.0) -> None:
        """Close this event loop's queue and its connection to the supervisor: call it where
        the loop ends (FastAPI's lifespan, the end of `asyncio.run`). Streams running here
        get `grace` seconds to finish."""
        queues = self._queues.get(os.getpid())
        queue = queues.pop(asyncio.get_running_loop(), None) if queues is not None else None
        if queue is not None:
            await queue.close(grace)
            await queue.driver.close()

    def close(self) -> None:
        """Stop this process's sync face, if it was made (request processes may also just
        exit: nothing of theirs is lost)."""
        queue = self._sync_queues.pop(os.getpid(), None)
        if queue is not None:
            queue.close()


class AppNotFoundError(ValueError):
    """An `--app` reference that does not name an importable QueueApp; the message says why
    in one line."""


def load_app(reference: str) -> QueueApp:
    """`pkg.module:attribute` → the QueueApp it names, looked up from the current directory
    first (as Celery, RQ and Huey do), then the import path."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise AppNotFoundError(f"an app reference looks like pkg.module:app, got {reference!r}")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AppNotFoundError(
            f"cannot import {module_name!r} for --app {reference}: {exc}"
        ) from exc
    app = getattr(module, attribute, None)
    if not isinstance(app, QueueApp):
        apps = sorted(name for name, value in vars(module).items() if isinstance(value, QueueApp))
        found = f"a {type(app).__name__}" if app is not None else f"not in {module_name}"
        close = difflib.get_close_matches(attribute, apps, n=1)
        hint = (
            f": did you mean {module_name}:{close[0]}?"
            if close
            else f" (its QueueApps: {', '.join(apps)})"
            if apps
            else f" ({module_name} defines no QueueApp)"
        )
        raise AppNotFoundError(f"--app {reference}: {attribute!r} is {found}, not a QueueApp{hint}")
    return app


def _check_options(options: dict[str, Any]) -> None:
    known = set(inspect.signature(QueueApp).parameters) - {"prefix", "unknown"}
    for name in options.keys() - known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = (
            f": did you mean {close[0]!r}?" if close else f" (it takes {', '.join(sorted(known))})"
        )
        raise TypeError(f"QueueApp got an option QueryQueue does not take, {name!r}{hint}")
