"""The scale workload's PostgreSQL peers (benchmarks/scale_peers.py): each queryqueue row
set against the best peer's, above 1 where queryqueue is ahead."""

from __future__ import annotations

from typing import Any

from benchmarks.scale_peers import against_best_peer

PEERS = {"pgqueuer 1.6", "procrastinate 3.10"}


def _row(workload: str, system: str, median: float) -> dict[str, Any]:
    return {"workload": workload, "system": system, "median": median, "settings": "s"}


def test_throughput_is_set_against_the_fastest_peer_and_latency_against_the_quickest() -> None:
    rows = [
        _row("throughput", "queryqueue (PostgreSQL, 1 supervisor)", 828.0),
        _row("throughput", "pgqueuer 1.6 (PostgreSQL, asyncpg)", 690.0),
        _row("throughput", "procrastinate 3.10 (PostgreSQL, psycopg)", 345.0),
        _row("idle_latency", "queryqueue (PostgreSQL, 1 supervisor), fast track", 4.0),
        _row("idle_latency", "pgqueuer 1.6 (PostgreSQL, asyncpg), priority 0", 92.0),
        _row("idle_latency", "procrastinate 3.10 (PostgreSQL, psycopg), priority 0", 8.0),
    ]
    against_best_peer(rows, PEERS)
    assert rows[0]["of_best_peer"] == 1.2
    assert rows[3]["of_best_peer"] == 2.0
    assert rows[0]["settings"].startswith("1.2x the best peer's")
    assert all("of_best_peer" not in row for row in rows if not row["system"].startswith("q"))


def test_with_no_peer_measured_nothing_is_compared() -> None:
    rows = [
        _row("throughput", "queryqueue (PostgreSQL, 1 supervisor)", 828.0),
        {"workload": "throughput", "system": "pgqueuer 1.6", "failed": "RuntimeError: down"},
    ]
    against_best_peer(rows, PEERS)
    assert "of_best_peer" not in rows[0]
