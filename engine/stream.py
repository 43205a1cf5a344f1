"""QueryStream: rows from a stream handler to the caller that asked, in the same process."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

_END = object()


class QueryStream:
    """An async iterator of rows with backpressure: `write()` waits while `maxsize` rows are
    unread. The handler writes and returns; the queue ends the stream after it."""

    def __init__(
        self,
        query_key_hash: str,
        alias_name_to_member: Mapping[str, str] | None = None,
        *,
        maxsize: int = 1_000,
    ) -> None:
        self.query_key_hash = query_key_hash
        self._aliases = dict(alias_name_to_member or {})
        self._rows: asyncio.Queue[Any] = asyncio.Queue(maxsize)
        self._error: BaseException | None = None
        self.closed = False

    async def write(self, row: Any) -> None:
        """A row for every reader of the stream (the handler writes them)."""
        if self.closed:
            raise RuntimeError("write to a closed query stream")
        if self._aliases and isinstance(row, Mapping):
            row = {self._aliases.get(k, k): v for k, v in row.items()}
        await self._rows.put(row)

    async def end(self, error: BaseException | None = None) -> None:
        """No more rows; with `error`, its readers raise it after the rows written."""
        if self.closed:
            return
        self.closed = True
        self._error = error
        await self._rows.put(_END)

    def __aiter__(self) -> QueryStream:
        return self

    async def __anext__(self) -> Any:
        row = await self._rows.get()
        if row is _END:
            # Leave the marker for any other reader, then stop.
            self._rows.put_nowait(_END)
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        return row

    async def rows(self) -> list[Any]:
        """Every row, once the stream has ended."""
        return [row async for row in self]


class Streams:
    """This process's query streams by key hash (a stream lives where it was asked for),
    and the callers waiting for one to start: a caller subscribes before anything can
    dispatch its stream, so a handler that starts at once writes to a listener."""

    def __init__(self) -> None:
        self._by_key: dict[str, QueryStream] = {}
        self._waiters: dict[str, set[asyncio.Future[QueryStream]]] = {}

    def get(self, query_key_hash: str) -> QueryStream | None:
        return self._by_key.get(query_key_hash)

    def create(self, query_key_hash: str, query: Any) -> QueryStream:
        """The stream of a query that starts here, handed to whoever waits for it."""
        aliases = query.get("aliasNameToMember") if isinstance(query, Mapping) else None
        stream = self._by_key[query_key_hash] = QueryStream(query_key_hash, aliases)
        for waiter in self._waiters.pop(query_key_hash, ()):
            if not waiter.done():
                waiter.set_result(stream)
        return stream

    def ended(self, stream: QueryStream) -> None:
        """`stream`'s handler is over: a later caller of its key starts a new one."""
        if self._by_key.get(stream.query_key_hash) is stream:
            del self._by_key[stream.query_key_hash]

    def subscribe(self, query_key_hash: str) -> asyncio.Future[QueryStream]:
        waiter: asyncio.Future[QueryStream] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(query_key_hash, set()).add(waiter)
        return waiter

    def unsubscribe(self, query_key_hash: str, waiter: asyncio.Future[QueryStream]) -> None:
        waiters = self._waiters.get(query_key_hash)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[query_key_hash]
