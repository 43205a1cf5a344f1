"""The scale workload's PostgreSQL peers: queryqueue's PostgreSQL store beside pgqueuer and
procrastinate on the same server, throughput and idle latency, in rounds (each round one
repetition of every system). Each queryqueue row gives its result against the best peer's
(`of_best_peer`: queries/s over the peer's, or the peer's p50 over ours; above 1 is ahead).
The peers' own settings are in their rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import ours, peers
from benchmarks.rounds import merged

PRODUCERS = 4  # the throughput workload's request processes, for every system


def rows(
    ready: list[tuple[peers.Peer, Path]], throughput_n: int, latency_n: int, reps: int
) -> list[dict[str, Any]]:
    rounds = []
    for _ in range(reps):
        made = _measured("queryqueue on PostgreSQL", ours.postgres_throughput, throughput_n, 1)
        for peer, python in ready:
            made += _measured(peer.name, _throughput, peer, python, throughput_n)
        made += _measured("queryqueue on PostgreSQL", ours.postgres_idle_latency, latency_n, 1)
        for peer, python in ready:
            made += _measured(peer.name, peers.idle_latency, peer, python, latency_n, 1)
        rounds.append(made)
    found = merged(rounds)
    against_best_peer(found, {peers.LABELS[p.name] for p, _ in ready})
    for row in found:
        row["scale_of"] = row.get("workload")
        row["workload"] = "scale"
    return found


def _throughput(peer: peers.Peer, python: Path, n: int) -> list[dict[str, Any]]:
    return [peers.throughput(peer, python, n, 1, PRODUCERS)]


def _measured(
    name: str, make: Callable[..., list[dict[str, Any]]], *args: Any
) -> list[dict[str, Any]]:
    """One system's rows; a system that fails gives a row saying so, not the others' loss."""
    try:
        return make(*args)
    except Exception as exc:
        return [{"system": name, "failed": f"{type(exc).__name__}: {exc}"}]


def against_best_peer(found: list[dict[str, Any]], peer_labels: set[str]) -> None:
    """`of_best_peer` on each queryqueue row: throughput over the best peer's, or the
    best peer's idle p50 over ours."""
    for workload, higher_is_better in (("throughput", True), ("idle_latency", False)):
        measured = [r for r in found if r.get("workload") == workload and "median" in r]
        theirs = [
            r["median"] for r in measured if any(r["system"].startswith(p) for p in peer_labels)
        ]
        if not theirs:
            continue
        best = max(theirs) if higher_is_better else min(theirs)
        for row in measured:
            if row["system"].startswith("queryqueue") and row["median"]:
                ratio = row["median"] / best if higher_is_better else best / row["median"]
                row["of_best_peer"] = round(ratio, 2)
                row["settings"] = f"{row['of_best_peer']}x the best peer's; {row['settings']}"
