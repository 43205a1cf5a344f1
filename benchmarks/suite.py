"""The benchmark suite: every workload, ours beside the references and the peers, in one run.

    python -m benchmarks                     # full run (see README for how long)
    python -m benchmarks --quick             # every workload, CI-sized
    python -m benchmarks --only throughput,idle_latency --no-peers

Workloads (a fresh store for each repetition, a warm-up first, median and min-max):
1. throughput: no-op queries from 4 request processes, 2 workers, SQLite NORMAL and FULL;
2. idle_latency: one caller, sequential, enqueue to result, priority 10 (fast track) and 0
   alternating query by query in the same runs;
3. dedup_storm: identical concurrent requests from 8 processes against a 200 ms query;
4. priority_burst: a backlog of priority-0 work, then priority-10 arrivals: their wait;
5. large_results: 1, 10, 100 MiB results to the caller, against a raw shared-memory copy;
6. soak: 1,000,000 no-op queries: supervisor RSS at start, middle, end; database and WAL;
7. io_bound: 2,000 queries waiting 100 ms of I/O each at a budget of 64, workers running
   many at once, against the ideal schedule and the peers that do the same (io_bound.py);
8. hosts: one queue on PostgreSQL through 1, 2 and 3 supervisors of 2 workers at a budget
   of 6, no-op and 20 ms queries, each against one host's throughput (hosts.py);
9. scale: curves, each point against the first: calls in flight in one process, backlog
   depth, prefixes, supervisors on PostgreSQL (scale.py).

Writes `<out>/benchmarks.json`, `<out>/benchmarks.md` (the tables) and, with matplotlib,
`<out>/benchmarks.png`. Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from benchmarks import hosts, io_bound, ours, peers, reference, scale
from benchmarks.report import WORKLOADS, chart, scale_chart, summary, tables
from benchmarks.rounds import merged


@dataclass(frozen=True)
class Sizes:
    reps: int
    throughput: int
    latency: int
    storm: int
    storm_processes: int
    backlog: int
    urgent: int
    sizes_mib: list[int]
    soak: int
    postgres: int  # throughput queries on PostgreSQL (a network store: fewer)
    io_bound: int  # queries that wait 100 ms each
    hosts: int  # no-op queries through 1, 2 and 3 hosts on PostgreSQL (half as many of 20 ms)
    scale: scale.Points


# The workloads that set systems side by side run in rounds, one repetition of every
# system a round: on a machine whose speed drifts within the hour (2-3x here, see the
# README), each system then meets every hour of the run, not the one its turn fell in.
COMPARED = ("throughput", "idle_latency", "dedup_storm", "priority_burst")

FULL = Sizes(
    5, 20_000, 500, 1_000, 8, 400, 20, [1, 10, 100], 1_000_000, 5_000, 2_000, 3_000, scale.FULL
)
QUICK = Sizes(1, 1_000, 50, 200, 4, 60, 5, [1, 10], 3_000, 500, 640, 300, scale.QUICK)


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu": _cpu_model(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _listed(make: Callable[..., dict[str, Any]], *args: Any) -> list[dict[str, Any]]:
    return [make(*args)]


def run(
    sizes: Sizes,
    only: list[str],
    with_peers: bool,
    steps: list[str] | None = None,
    partial_path: Path | None = None,
) -> dict[str, Any]:
    skipped: list[dict[str, Any]] = []
    ready: list[tuple[peers.Peer, Path]] = []
    wanted: list[peers.Peer] = []
    if any(w in only for w in ("throughput", "idle_latency", "priority_burst")):
        wanted = peers.PEERS + peers.PG_PEERS
    elif "scale" in only:
        wanted = peers.PG_PEERS
    if with_peers and wanted:
        ready, skipped = peers.available(wanted)
    done: list[dict[str, Any]] = []  # rows so far, kept if a long run is interrupted

    def measured(rows: list[dict[str, Any]]) -> None:
        done.extend(rows)
        if partial_path is not None:
            partial_path.write_text(json.dumps({"rows": done, "skipped": skipped}, indent=2) + "\n")

    compared = [w for w in only if w in COMPARED]
    rounds: list[list[dict[str, Any]]] = []
    once = Sizes(**{**sizes.__dict__, "reps": 1})
    for number in range(sizes.reps if compared else 0):
        if sizes.reps > 1:
            print(f"round {number + 1} of {sizes.reps}", flush=True)
        rounds.append(_workloads(once, compared, ready, steps, measured, with_peers))
    rows = merged(rounds)
    rest = [w for w in only if w not in COMPARED]
    rows += _workloads(sizes, rest, ready, steps, measured, with_peers)
    return {
        "benchmark": "queryqueue suite",
        "machine": machine(),
        "sizes": asdict(sizes),
        "rows": rows,
        "skipped": skipped,
    }


def _workloads(
    s: Sizes,
    only: list[str],
    ready: list[tuple[peers.Peer, Path]],
    steps: list[str] | None,
    measured: Callable[[list[dict[str, Any]]], None],
    with_peers: bool = True,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def step(name: str, make: Callable[[], list[dict[str, Any]]]) -> None:
        if steps and not any(wanted in name for wanted in steps):
            return
        started = time.monotonic()
        print(f"  {name} ...", flush=True, end="")
        try:
            made = make()
        except Exception as exc:  # one failing system must not lose the others' figures
            made = [{"system": name, "failed": f"{type(exc).__name__}: {exc}"}]
        rows.extend(made)
        print(f" {time.monotonic() - started:.0f} s", flush=True)
        measured(made)

    for workload, planned in _plan(s, ready, with_peers).items():
        if workload in only:
            print(workload.replace("_", " "), flush=True)
            for name, make in planned:
                step(name, make)
    if "dedup_storm" in only:
        rows.extend(peers.lacks_dedup(p) for p in peers.PEERS)
    return rows


Maker = Callable[[], list[dict[str, Any]]]


def _plan(
    s: Sizes, ready: list[tuple[peers.Peer, Path]], with_peers: bool
) -> dict[str, list[tuple[str, Maker]]]:
    """Each workload's steps, in order: the system measured, and what measures it."""
    return {
        "throughput": [
            ("queryqueue", lambda: ours.throughput(s.throughput, s.reps)),
            ("queryqueue on PostgreSQL", lambda: ours.postgres_throughput(s.postgres, s.reps)),
            ("ProcessPoolExecutor", lambda: [reference.pool_throughput(s.throughput, s.reps)]),
            ("raw socket", lambda: reference.raw_socket(s.throughput, s.reps, 4, 64)[:1]),
            *(
                (p.name, partial(_listed, peers.throughput, p, py, s.throughput, s.reps, 4))
                for p, py in ready
            ),
        ],
        "idle_latency": [
            ("queryqueue", lambda: ours.idle_latency(s.latency, s.reps)),
            ("queryqueue on PostgreSQL", lambda: ours.postgres_idle_latency(s.latency, s.reps)),
            ("ProcessPoolExecutor", lambda: [reference.pool_latency(s.latency, s.reps)]),
            ("raw socket", lambda: reference.raw_socket(s.latency, s.reps, 4, 64)[1:]),
            *((p.name, partial(peers.idle_latency, p, py, s.latency, s.reps)) for p, py in ready),
        ],
        "dedup_storm": [
            ("queryqueue", lambda: ours.dedup_storm(s.storm, s.reps, s.storm_processes)),
        ],
        "priority_burst": [
            ("queryqueue", lambda: ours.priority_burst(s.backlog, s.urgent, s.reps)),
            *(
                (p.name, partial(peers.priority_burst, p, py, s.backlog, s.urgent, s.reps))
                for p, py in ready
                if p in peers.PEERS
            ),
        ],
        "large_results": [
            ("queryqueue", lambda: ours.large_results(s.sizes_mib, s.reps)),
            ("raw shared memory", lambda: reference.raw_shm_copy(s.sizes_mib, max(3, s.reps))),
        ],
        "soak": [("queryqueue", lambda: ours.soak(s.soak))],
        "io_bound": [
            ("queryqueue", lambda: io_bound.ours(s.io_bound, s.reps)),
            ("queryqueue on PostgreSQL", lambda: io_bound.postgres_example(s.io_bound, s.reps)),
            *([("peers", lambda: io_bound.peer_rows(s.io_bound, s.reps))] if with_peers else []),
        ],
        "hosts": [("queryqueue on PostgreSQL", lambda: hosts.rows(s.hosts, min(s.reps, 3)))],
        "scale": scale.steps(
            s.scale,
            min(s.reps, 3),
            s.hosts,
            [(p, py) for p, py in ready if p in peers.PG_PEERS],
            s.postgres,
            s.latency,
        ),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="every workload, CI-sized")
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads")
    parser.add_argument("--no-peers", action="store_true", help="ours and the references only")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 5; 1 quick)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the tables go (default: benchmarks/results for a full run of every"
        " workload with every peer, the committed figures; benchmarks/last-run otherwise)",
    )
    parser.add_argument(
        "--steps", default="", help="run only the systems whose name contains one of these"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        action="append",
        default=[],
        help="add the rows of an earlier benchmarks.json (e.g. a separate soak run)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    only = [w.strip() for w in args.only.split(",") if w.strip() and w.strip() != "none"]
    unknown = set(only) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))} (known: {WORKLOADS})")
    sizes = QUICK if args.quick else FULL
    if args.out is None:
        # A quick, partial or peerless run never overwrites the committed full-run figures.
        full = not args.quick and set(only) == set(WORKLOADS) and not args.no_peers
        full = full and not args.steps
        args.out = Path("benchmarks/results" if full else "benchmarks/last-run")
    if args.reps:
        sizes = Sizes(**{**sizes.__dict__, "reps": args.reps})
    started = time.monotonic()
    steps = [w.strip() for w in args.steps.split(",") if w.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    partial_path = args.out / "benchmarks.partial.json"
    report = (
        run(sizes, only, not args.no_peers, steps, partial_path)
        if only
        else {"rows": [], "skipped": []}
    )
    partial_path.unlink(missing_ok=True)
    report.setdefault("machine", machine())
    report["seconds"] = round(time.monotonic() - started, 1)
    for earlier in args.merge:
        merged = json.loads(earlier.read_text())
        report["rows"] += merged["rows"]
        report["skipped"] += merged.get("skipped", [])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmarks.json").write_text(json.dumps(report, indent=2) + "\n")
    text = tables(report)
    (args.out / "benchmarks.md").write_text(text + "\n")
    (args.out / "summary.md").write_text(summary(report) + "\n")
    print(text)
    print(chart(report, args.out / "benchmarks.png"))
    print(scale_chart(report, args.out / "scale.png"))
    print(f"written to {args.out} in {report['seconds']} s")
    return 0
