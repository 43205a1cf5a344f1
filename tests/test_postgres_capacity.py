"""Hosts sharing a queue's budget on PostgreSQL by what each can run: a host retrieves only
what its workers can start, so every host runs queries; and a host whose supervisor died
has its workers gone before another host runs their queries again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

from queryqueue import SocketQueueDriver
from queryqueue.supervisor.launch import SupervisorProcess
from tests.pool_util import ask
from tests.postgres_util import pg_host
from tests.supervisor_util import close_all
from tests.trace import max_overlap, read_trace
from tests.waiting import wait_until

APP = "tests.apps.pool_app:six"


def _host(workdir: Path, name: str, schema: str, *options: str) -> SupervisorProcess:
    # A stall timeout of 10 s: a host paused by a loaded machine keeps its queries.
    env = {**os.environ, "POOL_HEARTBEAT": "2.5"}
    return pg_host(workdir, name, schema, "--app", APP, "--workers", "2", *options, env=env)


def _queues(hosts: list[SupervisorProcess]) -> tuple[list[SocketQueueDriver], list[Any]]:
    from tests.apps.pool_app import six

    drivers = [SocketQueueDriver(host.socket_path) for host in hosts]
    return drivers, [six.pool_queue(driver, continue_wait_timeout=1.0) for driver in drivers]


async def _workers(driver: SocketQueueDriver) -> set[int]:
    return {int(w["pid"]) for w in (await driver.stats())["pool"]["workers"]}


def _run_again_after(workdir: Path, ours: set[int]) -> list[str]:
    """The other host's one run of the query (its trace line), which started after the
    last tick of the run on `ours`: the two never overlapped."""
    trace = read_trace(workdir)
    last_alive = max(float(t[3]) for t in trace if t[0] == "tick" and int(t[2]) in ours)
    again = [t for t in trace if t[0] == "start" and int(t[2]) not in ours]
    assert len(again) == 1 and float(again[0][3]) > last_alive, trace
    return again[0]


async def test_three_hosts_share_a_budget_of_six_by_their_workers(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    hosts = [_host(workdir, name, schema) for name in ("a", "b", "c")]
    drivers, queues = _queues(hosts)
    try:
        pools = [await _workers(driver) for driver in drivers]
        # Each host's callers ask for 6 queries at once: all 18 through the budget of 6.
        asked = [
            ask(queue, "sql", f"{name}{i}", {"key": f"{name}{i}", "seconds": 0.3}, within=60)
            for name, queue in zip("abc", queues, strict=True)
            for i in range(6)
        ]
        results = await asyncio.gather(*asked)
        assert sorted(r["key"] for r in results) == sorted(
            f"{n}{i}" for n in "abc" for i in range(6)
        )
        trace = read_trace(workdir)
        ran_by = [sum(1 for t in trace if t[0] == "start" and int(t[2]) in pool) for pool in pools]
        # A host with idle workers is never left out while another holds the budget in its
        # backlog: each ran at least what its two workers could at once.
        assert sum(ran_by) == 18 and min(ran_by) >= 2, ran_by
        assert max_overlap(trace) <= 6
    finally:
        await close_all(queues, drivers, hosts)


async def test_a_dead_supervisors_workers_are_gone_before_another_host_runs_their_query(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    lease = ("--pg-host-timeout", "4")
    a, b = _host(workdir, "a", schema, *lease), _host(workdir, "b", schema, *lease)
    drivers, queues = _queues([a, b])
    first: asyncio.Future[Any] | None = None
    caller: asyncio.Future[Any] | None = None
    ours: set[int] = set()
    try:
        ours = await _workers(drivers[0])
        # Asked through a: it runs on a's worker (a's batch retrieves it for its pool).
        query = {"key": "k", "seconds": 30.0}
        first = asyncio.ensure_future(ask(queues[0], "ticking", "k", query, within=60))
        await wait_until(lambda: any(t[0] == "start" for t in read_trace(workdir)), within=30)
        (start,) = [t for t in read_trace(workdir) if t[0] == "start"]
        assert int(start[2]) in ours
        # b's caller joins it, then a's supervisor dies alone: its workers live on.
        query["seconds"] = 0.2
        caller = asyncio.ensure_future(ask(queues[1], "ticking", "k", query, within=60))
        first.cancel()
        a.kill9()
        # a's lease runs out (4 s): b reaps the query and runs it again; a's worker that
        # ran it had left by then (half the lease after its supervisor died).
        result = await asyncio.wait_for(caller, 60)
        assert result["pid"] in await _workers(drivers[1])
        _run_again_after(workdir, ours)
        assert not any(t[0] == "end" and int(t[2]) in ours for t in read_trace(workdir))
        for pid in ours:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    finally:
        for task in (first, caller):
            if task is not None:
                task.cancel()
        for pid in ours:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await close_all(queues, drivers, [b])


async def test_a_host_cut_off_stops_its_query_before_another_host_runs_it_again(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor alive but cut off from the database (its workers running) cannot renew
    its lease: half the lease later it stops the query it runs, so that when the other
    host reaps it (the lease run out) and runs it again, the two runs never overlap and it
    ends once. Back in touch, the host takes queries again."""
    from tests.postgres_util import Proxy

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    lease = ("--pg-host-timeout", "4")
    proxy = Proxy()
    env = {**os.environ, "POOL_HEARTBEAT": "2.5"}
    a = pg_host(
        workdir, "a", schema, "--app", APP, "--workers", "2", *lease, url=proxy.url, env=env
    )
    b = _host(workdir, "b", schema, *lease)
    drivers, queues = _queues([a, b])
    first: asyncio.Future[Any] | None = None
    try:
        ours = await _workers(drivers[0])

        async def sees_b() -> bool:  # as at a's last renewal: a host b may reap for
            return bool((await drivers[0].stats())["lease"]["other_hosts"] == 1)

        await wait_until(sees_b, within=30)
        query = {"key": "k", "seconds": 30.0}
        first = asyncio.ensure_future(ask(queues[0], "ticking", "k", query, within=60))
        await wait_until(lambda: any(t[0] == "start" for t in read_trace(workdir)), within=30)
        (start,) = [t for t in read_trace(workdir) if t[0] == "start"]
        assert int(start[2]) in ours  # a runs it
        # b's caller joins it; then a is cut off: its lease lapses, b reaps and runs it.
        caller = asyncio.ensure_future(ask(queues[1], "ticking", "k", {**query, "seconds": 0.2}))
        first.cancel()
        proxy.cut()
        result = await asyncio.wait_for(caller, 60)
        assert result["pid"] in await _workers(drivers[1])
        again = _run_again_after(workdir, ours)
        ends = [t[2] for t in read_trace(workdir) if t[0] == "end"]
        assert ends == [again[2]]  # it ended once
        # Back in touch: a takes queries again.
        proxy.resume()
        later = await ask(queues[0], "sql", "later", {"key": "later", "seconds": 0}, within=60)
        assert later["key"] == "later"
    finally:
        if first is not None:
            first.cancel()
        await close_all(queues, drivers, [a, b])
        proxy.close()
