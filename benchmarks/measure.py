"""Measuring a process tree: CPU seconds and peak memory, across every process.

Standalone (stdlib and psutil only): the peer runner imports it inside the peers' own
virtual environments too, so every system is measured by the same code.

CPU: the sum, over the measuring process and its live descendants, of their own CPU time
plus that of the children they already reaped (a reaped child's time moves to its
parent), so processes that start and end inside the window are counted. Memory: the
largest sum of RSS over the tree (plus any `extra` processes, e.g. a Redis server) seen by
a sampler every 20 ms (the tree itself found again every 0.5 s, through its own /proc
entries on Linux); shared pages count once per process.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import psutil


def tree(root: psutil.Process) -> list[psutil.Process]:
    """`root` and its live descendants. Found through the tree's own /proc entries where
    Linux lists each thread's children; psutil's `children()` reads every process on the
    machine instead (~3 ms here, twice a second, on the two cores the run is measured on:
    it put the idle workload's slowest queries every half second)."""
    pids = descendants(root.pid)
    if pids is None:
        try:
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return [root]
    found = [root]
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:
            continue  # gone since it was listed
    return found


def lists_children() -> bool:
    """Whether this kernel lists a thread's children (/proc/PID/task/TID/children)."""
    return os.path.exists(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children")


def descendants(pid: int) -> list[int] | None:
    """The pids below `pid`, parents before their children; None where /proc does not
    list children. A process or thread that ends meanwhile is skipped with its subtree."""
    if not lists_children():
        return None
    found: list[int] = []
    parents = [pid]
    while parents:
        parent = parents.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children") as listing:
                    children = [int(child) for child in listing.read().split()]
            except OSError:
                continue
            found.extend(children)
            parents.extend(children)
    return found


def cpu_seconds(processes: Iterable[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


REFRESH_TICKS = 25


class TreeMeter:
    """`with TreeMeter() as meter: ...` then `meter.cpu_s`, `meter.peak_rss`: of this
    process's tree, or of the trees of `roots` (a server and its workers, say), or of
    `roots` alone (`children=False`). `meter.start_rss`: what they held as it began."""

    def __init__(
        self,
        extra_pids: Sequence[int] = (),
        interval: float = 0.02,
        roots: Sequence[int] = (),
        children: bool = True,
    ) -> None:
        self.roots = [psutil.Process(pid) for pid in roots or [os.getpid()]]
        self.children = children
        self.start_rss = 0
        self.extra = [psutil.Process(pid) for pid in extra_pids if psutil.pid_exists(pid)]
        self.interval = interval
        self.cpu_s = 0.0
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._start_cpu = 0.0

    def _processes(self) -> list[psutil.Process]:
        if not self.children:
            return self.roots + self.extra
        return [process for root in self.roots for process in tree(root)] + self.extra

    def _sample(self) -> None:
        # Finding the tree scans every process on the machine (~3 ms here): done on every
        # tick, the meter took ~13 % of a core from the 2-core runs it measured. The tree
        # of a run changes rarely, so it is found again twice a second.
        known, ticks = self._processes(), 0
        while not self._stop.wait(self.interval):
            ticks += 1
            if ticks % REFRESH_TICKS == 0:
                known = self._processes()
            self.peak_rss = max(self.peak_rss, rss(known))

    def __enter__(self) -> TreeMeter:
        self._start_cpu = cpu_seconds(self._processes())
        self.peak_rss = self.start_rss = rss(self._processes())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        processes = self._processes()
        self.peak_rss = max(self.peak_rss, rss(processes))
        self.cpu_s = cpu_seconds(processes) - self._start_cpu


def rss(processes: Iterable[psutil.Process]) -> int:
    total = 0
    for process in processes:
        try:
            total += int(process.memory_info().rss)
        except psutil.Error:
            continue
    return total


def redis_server_pids() -> list[int]:
    found = []
    for process in psutil.process_iter(["name"]):
        if process.info["name"] and process.info["name"].startswith("redis-server"):
            found.append(process.pid)
    return found


def quantiles(samples: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/max of latencies in seconds, as milliseconds."""
    if not samples:
        return {}
    ordered = sorted(samples)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {"p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99), "max_ms": at(1.0)}


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median and min-max of repetitions."""
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "samples": [round(v, 3) for v in values],
    }
