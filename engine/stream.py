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
        if self.closed:
            raise RuntimeError("write to a closed query stream")
        if self._aliases and isinstance(row, Mapping):
            row = {self._aliases.get(k, k): v for k, v in row.items()}
        await self._rows.put(row)

    async def end(self, error: BaseException | None = None) -> None:
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
        return [row async for row in self]
