"""Reading the trace the test apps' handlers leave ($POOL_TRACE): one line per event,
`<event> <key> <pid> <monotonic time>`."""

from __future__ import annotations

from pathlib import Path


def read_trace(workdir: Path) -> list[list[str]]:
    path = workdir / "trace"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def max_overlap(trace: list[list[str]]) -> int:
    """The most handlers running at once (CLOCK_MONOTONIC is one clock for all processes)."""
    edges = sorted(
        (float(t[3]), 1 if t[0] == "start" else -1) for t in trace if t[0] in ("start", "end")
    )
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak
