"""`python -m benchmarks.ab`: two or more builds of queryqueue under the throughput load,
in alternation, with what the supervisor did for each query.

    git worktree add /tmp/before <revision>
    python -m benchmarks.ab --variant before=/tmp/before --variant now=. --rounds 4

Each round runs every variant once, in turn, so that a machine whose speed drifts over
the hour (a VM's neighbours) moves every variant alike: the same workload as the suite's
throughput row (4 request processes x 64 in flight, 2 workers, SQLite NORMAL), each run on
a fresh store after a warm-up. A variant is `name=tree`, the checkout whose `queryqueue`
(and `benchmarks`) its run imports, or `name=tree:options`, with supervisor options
added (`now=.:--synchronous FULL`). A timing of the supervisor's (its `Settings`) is judged
with a worktree whose default differs. Per run: queries/s, the supervisor's CPU microseconds a
query, its batches and commands a query, its share of the time on a CPU and waiting in
the run queue (`/proc/<pid>/schedstat`), and its voluntary context switches a query (how
often its loop slept). Medians per variant at the end; every run in
`benchmarks/last-run/ab.json` (or `--out`). Nothing here is a committed figure: it
compares builds, alternating, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS = ("qps", "supervisor_us", "batches", "commands", "on_cpu", "run_queue", "sleeps")


@dataclass(frozen=True)
class Variant:
    name: str
    tree: Path
    options: tuple[str, ...] = ()


def parse_variant(text: str) -> Variant:
    """`name=tree` or `name=tree:supervisor options`."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"a variant is name=tree[:options], got {text!r}")
    tree, _, options = rest.partition(":")
    path = Path(tree).expanduser().resolve()
    if not (path / "queryqueue").is_dir() or not (path / "benchmarks").is_dir():
        raise ValueError(f"variant {name!r}: {path} is not a queryqueue checkout")
    return Variant(name, path, tuple(shlex.split(options)))


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each variant's median of every metric, in the order the variants first ran."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_name.setdefault(run["variant"], []).append(run)
    return {
        name: {m: round(statistics.median(r[m] for r in its), 4) for m in METRICS}
        for name, its in by_name.items()
    }


def _schedstat(pid: int) -> tuple[float, float]:
    """Seconds on a CPU and waiting in the run queue so far (Linux)."""
    fields = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(fields[0]) / 1e9, int(fields[1]) / 1e9


def one_run(queries: int, options: list[str]) -> dict[str, Any]:
    """One run in this process's tree (`--one`): its figures."""
    import psutil

    import queryqueue

    try:
        from benchmarks import drive

        shares = drive.noop_shares(queries, 4, "ab")
    except ImportError:  # an older tree: the driver and its workloads in one module
        from benchmarks import ours as drive  # type: ignore[no-redef]

        shares = drive._noop_shares(queries, 4, "ab")  # type: ignore[attr-defined]
    with drive.supervisor_for("--synchronous", "NORMAL", *options) as supervisor:
        process = psutil.Process(supervisor.pid)
        sched, switches = _schedstat(supervisor.pid), process.num_ctx_switches()
        began = time.monotonic()
        run = drive.drive(supervisor, shares, in_flight=64)
        elapsed = time.monotonic() - began
        sched_after, switches_after = _schedstat(supervisor.pid), process.num_ctx_switches()
    assert run.cpu_by_role is not None  # drive() reads it: the supervisor's CPU, timed
    return {
        "qps": round(queries / run.wall, 1),
        "supervisor_us": round(run.cpu_by_role["supervisor"] / queries * 1e6, 1),
        "batches": round(run.batches / queries, 3),
        "commands": round(run.commands / queries, 3),
        # Over the whole drive (its request processes starting included): compare, do not
        # read as the busy share of the measured window alone.
        "on_cpu": round((sched_after[0] - sched[0]) / elapsed, 3),
        "run_queue": round((sched_after[1] - sched[1]) / elapsed, 3),
        "sleeps": round((switches_after.voluntary - switches.voluntary) / queries, 3),
        "errors": run.errors,
        "build": str(Path(queryqueue.__file__).resolve().parent.parent),  # the tree that ran
    }


def _run_variant(variant: Variant, queries: int) -> dict[str, Any]:
    # This file by its path, the tree's packages by PYTHONPATH: a tree from before this
    # tool measures as well (it needs `benchmarks.ours`' supervisor_for, and drive with
    # its CPU by role).
    env = {**os.environ, "PYTHONPATH": str(variant.tree)}
    command = [sys.executable, __file__, "--one", "--queries", str(queries), "--"]
    done = subprocess.run(
        [*command, *variant.options],
        cwd=variant.tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"variant {variant.name!r} failed:\n{done.stderr[-3000:]}")
    return {"variant": variant.name, **json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", action="append", default=[], help="name=tree[:options]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queries", type=int, default=30_000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks", "last-run", "ab.json"))
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("options", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.queries, args.options)))
        return 0
    try:
        variants = [parse_variant(text) for text in args.variant]
    except ValueError as exc:
        parser.error(str(exc))
    if len(variants) < 2 or len({v.name for v in variants}) < len(variants):
        parser.error("give at least two --variant, each with a name of its own")
    if args.rounds < 1 or args.queries < 1000:
        parser.error("--rounds must be at least 1 and --queries at least 1,000")
    runs: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for variant in variants:
            runs.append(_run_variant(variant, args.queries))
            shown = " ".join(f"{m} {runs[-1][m]}" for m in METRICS)
            print(f"round {round_} {variant.name}: {shown}", flush=True)
    medians = summary(runs)
    for name, figures in medians.items():
        print(f"median {name}: " + " ".join(f"{m} {figures[m]}" for m in METRICS))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
