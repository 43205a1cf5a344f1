"""Hosts sharing a queue on PostgreSQL: each host's lease on the items it runs
(driver_postgres/hosts.py), stepped with an injected clock: a dead host's items are reaped
by another within the lease, never by their owner, and a host back from an outage
refreshes only its own."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queryqueue.engine.clock import ManualClock
from tests.postgres_util import (
    URL,
    break_store_connections,
    drop_schema,
    fresh_schema,
    require_postgres,
)

LEASE_S = 5.0
HEARTBEAT_TIMEOUT_MS = 120_000  # the items' own: minutes, as a 30 s heartbeat makes it


@pytest.fixture
def hosts() -> Iterator[tuple[Any, Any, ManualClock]]:
    """Two hosts' stores on one schema, leased, on one clock."""
    require_postgres()
    from queryqueue.driver_postgres.store import PostgresQueueStore

    schema, clock = fresh_schema(), ManualClock()
    a = PostgresQueueStore(URL, schema=schema, clock=clock, host_timeout=LEASE_S)
    b = PostgresQueueStore(URL, schema=schema, clock=clock, host_timeout=LEASE_S)
    try:
        yield a, b, clock
    finally:
        a.close()
        b.close()
        drop_schema(schema)


def _running(store: Any, key: str) -> int:
    queue_id = int(store.add(f"p:{key}", "{}").id)
    assert store.retrieve(queue_id, concurrency=10).id == queue_id
    return queue_id


def _stalled(store: Any) -> list[int]:
    return sorted(row.queue_id for row in store.stalled(HEARTBEAT_TIMEOUT_MS, "p"))


def test_a_dead_hosts_items_are_reaped_by_another_once_its_lease_runs_out(
    hosts: tuple[Any, Any, ManualClock],
) -> None:
    a, b, clock = hosts
    a.beat_host()
    b.beat_host()
    of_a, of_b = _running(a, "a"), _running(b, "b")
    clock.advance(4_000)  # within the lease: nobody's items are stalled
    b.beat_host()
    assert _stalled(a) == [] and _stalled(b) == []
    clock.advance(2_000)  # a beat nothing since 6 s: past its lease; b beat 2 s ago
    b.beat_host()
    assert _stalled(b) == [of_a]  # seconds, not the items' heartbeat timeout
    assert _stalled(a) == []  # a host never reaps its own for its lease
    assert of_b not in _stalled(b)


def test_a_host_back_from_an_outage_refreshes_only_its_own_items(
    hosts: tuple[Any, Any, ManualClock],
) -> None:
    a, b, clock = hosts
    of_a, of_b = _running(a, "a"), _running(b, "b")
    clock.advance(HEARTBEAT_TIMEOUT_MS + 1)
    a.beat_host()
    b.beat_host()
    assert _stalled(a) == [of_a, of_b]  # nobody beat either item
    # a's connection breaks and comes back: its first command refreshes what it runs.
    break_store_connections(a.schema)
    assert _stalled(a) == [of_b]  # b's is still b's to beat, or to lose
    assert a.reconnects >= 1


def test_an_item_given_back_is_no_hosts_and_a_closed_host_leaves(
    hosts: tuple[Any, Any, ManualClock],
) -> None:
    a, b, clock = hosts
    a.beat_host()
    b.beat_host()
    queue_id = _running(a, "a")
    assert a.requeue(queue_id)  # pending again: whoever retrieves it next owns it
    assert b.retrieve(queue_id, concurrency=10).id == queue_id
    clock.advance(10_000)
    b.beat_host()
    assert _stalled(b) == []  # b's own now, whatever became of a
    a.close()
    with psycopg.connect(URL, autocommit=True) as admin:
        rows = admin.execute(f'SELECT count(*) FROM "{b.schema}".hosts').fetchone()
    assert rows is not None and rows[0] == 1  # a's row went with it


def test_a_beat_whose_connection_broke_is_a_store_error_and_the_next_renews(
    hosts: tuple[Any, Any, ManualClock],
) -> None:
    from queryqueue import StoreError

    a, _, clock = hosts
    a.beat_host()
    break_store_connections(a.schema)
    clock.advance(1_000)
    try:
        a.beat_host()  # the broken connection's beat fails as a StoreError, if it notices
    except StoreError as exc:
        assert "the queue database failed" in str(exc)
    a.beat_host()  # the next one reconnects
    with psycopg.connect(URL, autocommit=True) as admin:
        rows = admin.execute(f'SELECT seen FROM "{a.schema}".hosts').fetchall()
    assert [clock.now_ms()] in [list(row) for row in rows]


@pytest.mark.parametrize("bad", ["0", "-1", "soon"])
def test_a_host_timeout_that_is_not_positive_seconds_is_refused_by_name(
    bad: str, tmp_path: Path
) -> None:
    command = [
        sys.executable, "-m", "queryqueue", "supervisor", "--store", URL,
        "--socket", str(tmp_path / "s.sock"), "--pg-host-timeout", bad,
    ]  # fmt: skip
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "argument --pg-host-timeout:" in refused.stderr
