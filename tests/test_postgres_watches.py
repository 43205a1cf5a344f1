"""Two stores on one PostgreSQL schema, as two hosts' supervisors: an ACK of a query its
own host added tells the other host only where that host waits for it (it watches the
path), and a waiter elsewhere is woken by the ACK, never by a re-check."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from queryqueue.driver_postgres.watches import WATCH_MS
from queryqueue.engine.clock import ManualClock
from tests.postgres_util import URL, postgres_store, require_postgres
from tests.recording import record_calls, record_returns
from tests.waiting import wait_until, wait_until_sync

# Longer than any test: a waiter that missed its ACK would not look again within it.
NO_RECHECK_MS = 600_000


@pytest.fixture
def hosts() -> Iterator[tuple[Any, Any]]:
    require_postgres()
    a = postgres_store(safety_recheck_ms=NO_RECHECK_MS)
    b = postgres_store(schema=a.schema, safety_recheck_ms=NO_RECHECK_MS)
    try:
        wait_until_sync(
            lambda: a.others_listen and b.others_listen, within=30, what="each heard the other"
        )
        yield a, b
    finally:
        b.close()
        a.close()


def watched(store: Any) -> list[str]:
    with psycopg.connect(URL, autocommit=True) as conn:
        rows = conn.execute(f"SELECT path FROM {store.schema}.watches ORDER BY path").fetchall()
    return [row[0] for row in rows]


async def parked(
    monkeypatch: pytest.MonkeyPatch, store: Any, key: Any
) -> tuple[asyncio.Future[Any], list[Any]]:
    """A long poll of `store` for `key`, once its first look has ended (found nothing),
    and what each of its looks found."""
    looked = record_returns(monkeypatch, store, "_lookup")
    waiter = asyncio.ensure_future(store.result_blocking(key, 60_000))
    await wait_until(lambda: looked == [None], within=30)
    return waiter, looked


async def woken_by_the_ack(waiter: asyncio.Future[Any], looked: list[Any]) -> None:
    """The long poll answered with the ACK's result, by its NOTIFY: no second look."""
    found = await asyncio.wait_for(waiter, 20)
    assert found is not None and found.payload == '"done"'
    assert len(looked) == 1


def test_an_ack_of_a_hosts_own_query_nobody_watches_tells_no_other_host(
    hosts: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = hosts
    notes = record_calls(monkeypatch, b, "_publish")  # what b's listener hears
    quiet = a.add("p:quiet", "{}").id
    assert a.ack(quiet, '"r1"').success
    # Added by b: a's ACK of it is announced. NOTIFYs arrive in commit order, so once
    # b has heard this one, it has heard every earlier one a sent.
    told = b.add("p:told", "{}").id
    assert a.ack(told, '"r2"').success
    wait_until_sync(
        lambda: any(f'"id":{told},' in args[0] for args in notes),
        within=30,
        what="b hearing the ACK of its own query",
    )
    assert not [args for args in notes if f'"id":{quiet},' in args[0]]
    assert watched(a) == []


async def test_a_waiter_for_a_query_not_added_yet_is_woken_by_the_other_hosts_ack(
    hosts: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = hosts
    waiter, looked = await parked(monkeypatch, b, "p:later")
    assert watched(b) == ["p:later"]
    item = a.add("p:later", "{}").id
    assert a.ack(item, '"done"').success
    await woken_by_the_ack(waiter, looked)


async def test_a_waiter_by_id_for_another_hosts_query_is_woken_by_its_ack(
    hosts: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = hosts
    item = a.add("p:theirs", "{}").id
    waiter, looked = await parked(monkeypatch, b, item)
    assert watched(b) == ["p:theirs"]
    assert a.ack(item, '"done"').success
    await woken_by_the_ack(waiter, looked)


async def test_a_waiter_for_its_own_hosts_query_watches_nothing(
    hosts: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = hosts
    item = b.add("p:mine", "{}").id
    waiter, looked = await parked(monkeypatch, b, "p:mine")
    assert watched(b) == []
    # Another host's ACK of b's query is always announced.
    assert a.ack(item, '"done"').success
    await woken_by_the_ack(waiter, looked)


def test_an_expired_watch_is_purged() -> None:
    require_postgres()
    clock = ManualClock()
    a = postgres_store(clock=clock)
    b = postgres_store(schema=a.schema, clock=clock)
    try:
        wait_until_sync(lambda: b.others_listen, within=30, what="b heard of a")

        async def wait_briefly() -> Any:
            return await b.result_blocking("p:gone", 0)

        assert asyncio.run(wait_briefly()) is None
        assert watched(b) == ["p:gone"]
        clock.advance(WATCH_MS - 1)
        b.purge_expired()
        assert watched(b) == ["p:gone"]
        clock.advance(1)
        b.purge_expired()
        assert watched(b) == []
    finally:
        b.close()
        a.close()
