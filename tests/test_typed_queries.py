"""Queries and keys carry the result codec's types: a handler gets its Decimal, date or
UUID back as it was sent, a key of typed values hashes, and a value with no codec is an
`InvalidCommandError` naming its type and where it is. Identical queries asked without a
key share one execution; different ones never do."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

import pytest

from queryqueue import InvalidCommandError, MemoryQueueStore, QueryQueue

TYPED = {
    "price": Decimal("12.50"),
    "day": dt.date(2026, 12, 1),
    "at": dt.datetime(2026, 12, 1, 9, 30, tzinfo=dt.UTC),
    "id": uuid.UUID("6f1c2a36-0000-4000-8000-000000000001"),
    "raw": b"\x00\xff",
    "rows": [[Decimal("1.5"), None], [Decimal("2"), dt.date(2026, 1, 2)]],
}


def _queue(seen: list[Any]) -> QueryQueue:
    async def echo(query: Any) -> Any:
        seen.append(query)
        await asyncio.sleep(0.05)
        return query

    return QueryQueue("typed", query_handlers={"echo": echo}, driver=MemoryQueueStore())


async def test_the_handler_gets_the_querys_types_back_and_so_does_the_caller() -> None:
    seen: list[Any] = []
    queue = _queue(seen)
    try:
        assert await queue.run("echo", ["typed", dt.date(2026, 12, 1)], TYPED) == TYPED
        assert seen == [TYPED]
        assert type(seen[0]["price"]) is Decimal and type(seen[0]["day"]) is dt.date
    finally:
        await queue.close(grace=0)


async def test_a_key_of_typed_values_hashes_and_keeps_apart_what_differs() -> None:
    seen: list[Any] = []
    queue = _queue(seen)
    try:
        day, other = dt.date(2026, 12, 1), dt.date(2026, 12, 2)
        assert queue.hash_query_key([day]) == queue.hash_query_key([dt.date(2026, 12, 1)])
        assert queue.hash_query_key([day]) != queue.hash_query_key([other])
        assert queue.hash_query_key([day]) != queue.hash_query_key(["2026-12-01"])
        first, second = await asyncio.gather(
            queue.run("echo", [day], {"n": 1}), queue.run("echo", [day], {"n": 1})
        )
        assert first == second == {"n": 1} and len(seen) == 1  # one execution, shared
    finally:
        await queue.close(grace=0)


@pytest.mark.parametrize(
    ("key", "query", "named"),
    [
        ("k", {"a": [1, object()]}, r"query holds a builtins\.object at query\['a'\]\[1\]"),
        ([1, {"when": object()}], {}, r"query key holds a builtins\.object at query key\[1\]"),
        ("k", {1: "a"}, r"the query holds a builtins\.int at query, a dict key"),
    ],
)
async def test_a_value_with_no_codec_is_refused_naming_its_type_and_place(
    key: Any, query: Any, named: str
) -> None:
    seen: list[Any] = []
    queue = _queue(seen)
    try:
        with pytest.raises(InvalidCommandError, match=named):
            await queue.run("echo", key, query)
        assert seen == [] and await queue.get_queries() == []  # nothing queued
    finally:
        await queue.close(grace=0)
