"""One of the demo's request processes: its users ask their share of the queries through
the supervisor, cancel one while it runs, and report each outcome to the demo."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from queryqueue.demo_plan import INTERACTIVE_PER_CLIENT, THINK_TIME, Outcome, Request, digest


def client_main(
    socket_path: str,
    warehouse: str,
    requests: list[Request],
    users: int,
    settings: dict[str, Any],
    outcomes: Any,
    go: Any,
    interactive: list[Request] | None = None,
    interactive_go: Any = None,
) -> None:
    """A process's entry: its `users` ask `requests` once `go` is set, then, once
    `interactive_go` is, its interactive lookups one at a time."""
    client = DemoClient(socket_path, warehouse, settings, outcomes)
    asyncio.run(client.run(requests, users, go, interactive or [], interactive_go))


class DemoClient:
    def __init__(
        self, socket_path: str, warehouse: str, settings: dict[str, Any], outcomes: Any
    ) -> None:
        self.socket_path, self.warehouse, self.settings = socket_path, warehouse, settings
        self.outcomes = outcomes  # where each Outcome goes (the demo's queue)
        self.fast_tracked: set[str] = set()  # request ids the fast track took
        self.cancelled: set[int] = set()  # the requests this process cancelled
        self.cancelling: set[asyncio.Task[None]] = set()
        self.todo: asyncio.Queue[Request] = asyncio.Queue()

    def _event(self, message: str, fields: dict[str, Any]) -> None:
        if message == "Added to queue" and fields.get("fastTrack"):
            self.fast_tracked.add(str(fields.get("requestId")))

    async def run(
        self,
        requests: list[Request],
        users: int,
        go: Any,
        interactive: list[Request],
        interactive_go: Any,
    ) -> None:
        from queryqueue.demo_app import app
        from queryqueue.driver_socket.client import SocketQueueDriver

        driver = SocketQueueDriver(self.socket_path)
        self.queue = app.pool_queue(driver, logger=self._event, **self.settings)
        for request in requests:
            self.todo.put_nowait(request)
        go.wait()
        try:
            await asyncio.gather(*(self._user() for _ in range(users)))
            if interactive and interactive_go is not None:
                await asyncio.to_thread(interactive_go.wait)  # every process's load is done
                # One user per process with a little think time between lookups, the
                # processes out of step: as people at screens, not a load generator.
                client = (interactive[0].index - 100_000) // INTERACTIVE_PER_CLIENT
                await asyncio.sleep(THINK_TIME * client / 4)
                for request in interactive:
                    self.todo.put_nowait(request)
                    await self._user()
                    await asyncio.sleep(THINK_TIME)
        finally:
            await self.queue.shutdown(grace=0)
            await driver.close()

    async def _user(self) -> None:
        while not self.todo.empty():
            request = self.todo.get_nowait()
            try:
                result = await self._ask(request)
            except Exception as exc:  # reported, never lost
                result = Outcome(
                    request.index, request.kind, request.sql, request.priority, 0.0, "error"
                )
                result.detail = f"{type(exc).__name__}: {exc}"
            self.outcomes.put(result)

    async def _ask(self, request: Request) -> Outcome:
        from queryqueue.engine.errors import QueryCancelledError, QueryError, QueryTimeoutError

        request_id = f"{os.getpid()}-{request.index}"
        query = {"warehouse": self.warehouse, "sql": request.sql}
        started = time.perf_counter()

        def outcome(status: str, **details: Any) -> Outcome:
            return Outcome(
                request.index, request.kind, request.sql, request.priority,
                time.perf_counter() - started, status,
                fast_tracked=request_id in self.fast_tracked, **details,
            )  # fmt: skip

        queue = self.queue
        if request.kind == "stream":
            stream = await queue.execute_in_queue(
                "stream", [request.sql], query, request.priority, request_id=request_id
            )
            rows = await stream.rows()
            return outcome("ok", digest=digest(rows), rows=len(rows))
        if request.kind == "cancel":
            self.cancelling.add(asyncio.ensure_future(self._cancel_when_running(request)))
        try:
            result = await queue.run(
                "sql", [request.sql], query, priority=request.priority,
                request_id=request_id, stage_query_key=[request.sql],
            )  # fmt: skip
        except QueryCancelledError:
            return outcome("cancelled" if request.index in self.cancelled else "error")
        except QueryTimeoutError as exc:
            return outcome("timed out", detail=str(exc))
        except QueryError as exc:
            return outcome("error", detail=str(exc))
        return outcome("ok", digest=digest(result), rows=len(result))

    async def _cancel_when_running(self, request: Request) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stage = await self.queue.get_query_stage([request.sql])
            if stage is not None and stage["stage"] == "Executing query":
                await asyncio.sleep(0.3)  # let it run a little: it is interrupted, not skipped
                break
            await asyncio.sleep(0.05)
        self.cancelled.add(request.index)
        await self.queue.cancel_query_by_request_id(f"{os.getpid()}-{request.index}")
