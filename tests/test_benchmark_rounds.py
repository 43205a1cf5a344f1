"""The benchmark suite's rounds (benchmarks/rounds.py): each round runs one repetition of
every system, and a system's rounds become one row, as its repetitions in a row would."""

from __future__ import annotations

from typing import Any

from benchmarks.measure import spread
from benchmarks.rounds import merged


def _row(system: str, rate: float, cpu: float, **extra: Any) -> dict[str, Any]:
    return {
        "workload": "throughput",
        "system": system,
        "n": 100,
        "repetitions": 1,
        "metric": "queries/s",
        **spread([rate]),
        "cpu_s_per_1000": spread([cpu]),
        "peak_rss_mb": 10.0 + rate / 1000,
        **extra,
    }


def test_a_systems_rounds_become_one_row_of_all_its_repetitions() -> None:
    rounds = [
        [
            _row("ours", 1000, 0.5, commands_per_query=3.0, latency_ms={"p50_ms": 1.0}),
            _row("peer", 900, 0.9),
        ],
        [
            _row("ours", 3000, 0.7, commands_per_query=2.0, latency_ms={"p50_ms": 3.0}),
            _row("peer", 2000, 1.1),
        ],
        [
            _row("ours", 2000, 0.6, commands_per_query=3.0, latency_ms={"p50_ms": 2.0}),
            _row("peer", 1000, 1.0),
        ],
    ]
    ours, peer = merged(rounds)
    assert (ours["system"], peer["system"]) == ("ours", "peer")  # the first round's order
    assert ours["repetitions"] == 3
    assert (ours["median"], ours["min"], ours["max"]) == (2000, 1000, 3000)
    assert ours["samples"] == [1000, 3000, 2000]  # in the order the rounds ran
    assert ours["cpu_s_per_1000"]["median"] == 0.6
    assert ours["peak_rss_mb"] == 13.0
    assert ours["commands_per_query"] == 2.67
    assert ours["latency_ms"] == {"p50_ms": 2.0}
    assert peer["median"] == 1000 and peer["cpu_s_per_1000"]["samples"] == [0.9, 1.1, 1.0]


def test_a_skip_or_a_failure_in_any_round_is_kept_as_it_came() -> None:
    skipped = {"workload": "throughput", "system": "peer", "skipped": "no Redis"}
    failed = {"workload": "throughput", "system": "ours", "failed": "RuntimeError: boom"}
    rounds = [
        [_row("ours", 1000, 0.5), skipped],
        [failed, skipped],
    ]
    ours, peer = merged(rounds)
    assert ours == failed
    assert peer == skipped


def test_one_round_is_left_as_it_is() -> None:
    rows = [_row("ours", 1000, 0.5), _row("peer", 900, 0.9)]
    assert merged([rows]) == rows


def test_the_idle_rows_are_the_two_paths_of_the_same_runs() -> None:
    """idle_latency runs the fast track and the queued path alternating, query by query,
    in one run: each row reads its own path's queries (every other record), so a slower
    supervisor slows both rows alike."""
    from benchmarks.drive import Run
    from benchmarks.ours import IDLE_PATHS, latencies_of_path

    assert [priority for priority, _ in IDLE_PATHS] == [10, 0]
    records = [(float(i), float(i) + (0.5 if i % 2 == 0 else 0.75), True) for i in range(6)]
    run = Run([records], cpu_s=0.0, peak_rss=0, stats_before={}, stats_after={})
    assert latencies_of_path(0, run) == [0.5, 0.5, 0.5]
    assert latencies_of_path(1, run) == [0.75, 0.75, 0.75]
