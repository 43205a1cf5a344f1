"""Two stores on one PostgreSQL schema, as two hosts' supervisors: each pool takes the
queries its own host added first, within a priority, a head start and PENDING's head."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from queryqueue.driver_postgres.pool_head import HEAD_SPARE, LOCAL_FIRST_MS
from queryqueue.engine.clock import ManualClock
from tests.postgres_util import postgres_store, require_postgres

POOL = "pool"


@pytest.fixture
def hosts() -> Iterator[tuple[Any, Any, ManualClock]]:
    require_postgres()
    clock = ManualClock()
    a = postgres_store(clock=clock)
    b = postgres_store(clock=clock, schema=a.schema)
    try:
        yield a, b, clock
    finally:
        b.close()
        a.close()


def taken(store: Any, limit: int = 1, concurrency: int = 3) -> list[str]:
    return [
        next_item.key
        for next_item in store.retrieve_next(
            "q", concurrency=concurrency, process_id=POOL, limit=limit
        )
    ]


def test_each_pool_takes_its_own_hosts_query_before_an_older_one_of_another(
    hosts: tuple[Any, Any, ManualClock],
) -> None:
    a, b, clock = hosts
    a.add("q:a1", "{}")
    clock.advance(1)
    b.add("q:b1", "{}")
    clock.advance(1)
    a.add("q:a2", "{}")
    assert taken(b) == ["b1"]
    assert taken(a, limit=2) == ["a1", "a2"]


def test_a_query_of_another_host_waits_at_most_the_head_start(
    hosts: tuple[Any, Any, ManualClock],
) -> None:
    a, b, clock = hosts
    a.add("q:early", "{}")
    clock.advance(LOCAL_FIRST_MS - 1)
    b.add("q:within", "{}")
    clock.advance(2)
    b.add("q:past", "{}")
    # Added less than the head start after it: ahead. More than that: behind it.
    assert taken(b, limit=2) == ["within", "early"]


def test_priorities_are_never_crossed_for_a_hosts_own_query(
    hosts: tuple[Any, Any, ManualClock],
) -> None:
    a, b, clock = hosts
    a.add("q:urgent", "{}", priority=5)
    clock.advance(1)
    b.add("q:own", "{}")
    assert taken(b) == ["urgent"]


def test_nothing_behind_the_head_is_taken_ahead_of_it(
    hosts: tuple[Any, Any, ManualClock],
) -> None:
    a, b, clock = hosts
    # A head of one row (the budget) plus its spare rows, all another host's: its own
    # query behind them waits its turn.
    for i in range(1 + HEAD_SPARE):
        a.add(f"q:a{i}", "{}")
    clock.advance(1)
    b.add("q:own", "{}")
    assert taken(b, concurrency=1) == ["a0"]
    assert taken(a, limit=2, concurrency=8) == ["a1", "a2"]
    assert taken(b, concurrency=8) == ["own"]


def test_a_pool_batch_reading_its_head_ahead_prefers_its_own_hosts_queries(
    hosts: tuple[Any, Any, ManualClock],
) -> None:
    """A supervisor's batch reads PENDING's head with its first statements, then inserts:
    what it inserted is its own host's too."""
    a, b, clock = hosts
    a.add("q:a1", "{}")
    clock.advance(1)

    def work() -> list[str]:
        b.expect_retrieval("q", POOL, 2)
        b.add("q:b1", "{}")
        return taken(b)

    assert b.batched(work, lambda _: None, "q") == ["b1"]

    def again() -> list[str]:
        b.expect_retrieval("q", POOL, 2)
        return taken(b)

    assert b.batched(again, lambda _: None, "q") == ["a1"]
