"""The peers a Python user would pick instead, each in its own virtual environment under
benchmarks/.peers (ignored by git), run through `peer_runner.py` inside that environment.

A peer is skipped, with the reason printed and recorded, when its server is absent or its
environment cannot be made. Features a peer lacks get a row saying so, never a number.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.drive import POSTGRES_URL, postgres_unavailable
from benchmarks.measure import quantiles, spread

HERE = Path(__file__).resolve().parent
PEERS_DIR = HERE / ".peers"
REDIS_URL = "redis://127.0.0.1:6379/15"  # a database of its own, flushed per repetition
MiB = 1024 * 1024


@dataclass(frozen=True)
class Peer:
    name: str
    venv: str
    requirements: tuple[str, ...]
    needs_redis: bool
    priorities: str | None  # how it does priorities, None: it has none on this broker
    throughput_cap: int | None = None  # slow peers run fewer queries (shown in the row)


PEERS = [
    Peer("huey-sqlite", "huey", ("huey==3.5.4", "redis==8.1.0"), False, "per-task priority"),
    Peer("huey-redis", "huey", ("huey==3.5.4", "redis==8.1.0"), True, "per-task priority"),
    Peer("rq", "rq", ("rq==3.0.0", "redis==8.1.0"), True, "a 'high' queue listened to first", 2000),
    Peer(
        "rq-simple", "rq", ("rq==3.0.0", "redis==8.1.0"), True, "a 'high' queue listened to first"
    ),
    Peer(
        "celery",
        "celery",
        ("celery[redis]==5.7.0",),
        True,
        "message priority (Redis emulation, priority_steps)",
    ),
    Peer("dramatiq", "dramatiq", ("dramatiq[redis]==2.2.1",), True, None),
]
# The io_bound workload's peers: many waiting tasks per worker process (io_peer_runner.py).
IO_PEERS = [
    Peer("saq", "saq", ("saq==0.26.4", "redis==8.1.0", "typing_extensions"), True, None),
    Peer("arq", "arq", ("arq==0.28.0",), True, None),
    Peer("celery-threads", "celery", ("celery[redis]==5.7.0",), True, None),
    Peer("dramatiq-threads", "dramatiq", ("dramatiq[redis]==2.2.1",), True, None),
]
# The PostgreSQL peers, on the server the PostgreSQL rows use (pg_peer_runner.py).
PG_PEERS = [
    Peer(
        "pgqueuer",
        "pgqueuer",
        ("pgqueuer==1.6.0", "asyncpg==0.32.0", "typer==0.16.0", "psycopg[binary]==3.3.9"),
        False,
        None,
    ),
    Peer(
        "procrastinate",
        "procrastinate",
        ("procrastinate==3.10.0", "psycopg[binary]==3.3.9"),
        False,
        None,
    ),
]
LABELS = {
    "pgqueuer": "pgqueuer 1.6 (PostgreSQL, asyncpg)",
    "procrastinate": "procrastinate 3.10 (PostgreSQL, psycopg)",
    "saq": "saq 0.26 (async, Redis)",
    "arq": "arq 0.28 (async, Redis)",
    "celery-threads": "Celery 5.7 (threads pool, Redis)",
    "dramatiq-threads": "Dramatiq 2.2 (threads, Redis)",
    "huey-sqlite": "Huey 3.5 (SQLite, process workers)",
    "huey-redis": "Huey 3.5 (Redis, notify_result)",
    "rq": "RQ 3.0 (forking Worker)",
    "rq-simple": "RQ 3.0 (SimpleWorker)",
    "celery": "Celery 5.7 (prefork, Redis)",
    "dramatiq": "Dramatiq 2.2 (Redis, Results)",
}


def redis_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=1) as probe:
            probe.sendall(b"PING\r\n")
            return probe.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def ensure_venv(peer: Peer) -> Path:
    """The peer's interpreter, its environment made on first use."""
    venv = PEERS_DIR / peer.venv
    python = venv / "bin" / "python"
    marker = venv / ".requirements"
    wanted = "\n".join((*peer.requirements, "psutil"))
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *peer.requirements, "psutil"],
        check=True,
        capture_output=True,
    )
    marker.write_text(wanted)
    return python


def available(
    among: list[Peer] | None = None,
) -> tuple[list[tuple[Peer, Path]], list[dict[str, Any]]]:
    """Peers ready to run, and a skip row for each that is not."""
    ready, skipped = [], []
    redis = redis_up()
    for peer in PEERS if among is None else among:
        if peer.needs_redis and not redis:
            reason = "no Redis server on 127.0.0.1:6379"
        elif peer in PG_PEERS and (down := postgres_unavailable()) is not None:
            reason = down
        else:
            try:
                ready.append((peer, ensure_venv(peer)))
                continue
            except (subprocess.CalledProcessError, OSError) as exc:
                reason = f"could not install {', '.join(peer.requirements)}: {exc}"
        print(f"skipping {peer.name}: {reason}", flush=True)
        skipped.append({"system": LABELS[peer.name], "skipped": reason})
    return ready, skipped


def run(python: Path, spec: dict[str, Any]) -> dict[str, Any]:
    runner = "io_peer_runner.py" if spec.get("workload") == "io_bound" else "peer_runner.py"
    if any(spec["peer"] == p.name for p in PG_PEERS):
        runner = "pg_peer_runner.py"
    done = subprocess.run(
        [str(python), str(HERE / runner), json.dumps(spec)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "QQ_REDIS_URL": REDIS_URL, "QQ_PG_URL": POSTGRES_URL},
        timeout=3600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{spec['peer']}: {done.stderr[-2000:]}")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def _records(run: dict[str, Any], shares: slice = slice(None)) -> list[list[float]]:
    return [r for share in run["by_share"][shares] for r in share]


def summary_row(
    workload: str,
    peer: Peer,
    n: int,
    runs: list[dict[str, Any]],
    settings: dict[str, str],
    metric: str,
    values: list[float],
    latencies: list[list[float]] | None = None,
    counted: int | None = None,
) -> dict[str, Any]:
    done = counted or n
    row: dict[str, Any] = {
        "workload": workload,
        "system": LABELS[peer.name],
        "n": n,
        "repetitions": len(runs),
        "metric": metric,
        **spread(values),
        "cpu_s_per_1000": spread([r["cpu_s"] / done * 1000 for r in runs]),
        "peak_rss_mb": round(max(r["peak_rss"] for r in runs) / MiB, 1),
        "settings": "; ".join(f"{k}: {v}" for k, v in settings.items())
        + ("; CPU and memory include redis-server" if peer.needs_redis else ""),
    }
    if latencies is not None:
        per_run = [quantiles(lat) for lat in latencies]
        row["latency_ms"] = {k: spread([q[k] for q in per_run])["median"] for k in per_run[0]}
    return row


def throughput(peer: Peer, python: Path, n: int, reps: int, producers: int) -> dict[str, Any]:
    n = min(n, peer.throughput_cap or n)
    spec = {"peer": peer.name, "workload": "throughput", "n": n, "producers": producers}
    answer = run(python, {**spec, "reps": reps})
    runs = answer["runs"]
    rates = []
    for r in runs:
        records = _records(r)
        rates.append(len(records) / (max(x[1] for x in records) - min(x[0] for x in records)))
    return summary_row("throughput", peer, n, runs, answer["settings"], "queries/s", rates)


def idle_latency(peer: Peer, python: Path, n: int, reps: int) -> list[dict[str, Any]]:
    rows = []
    for priority in (10, 0):
        spec = {"peer": peer.name, "workload": "idle_latency", "n": n, "priority": priority}
        answer = run(python, {**spec, "reps": reps})
        latencies = [[x[1] - x[0] for x in _records(r)] for r in answer["runs"]]
        row = summary_row(
            "idle_latency",
            peer,
            n,
            answer["runs"],
            answer["settings"],
            "p50 ms",
            [quantiles(lat)["p50_ms"] for lat in latencies],
            latencies,
        )
        row["system"] += f", priority {priority}" + (" (no fast track)" if priority else "")
        rows.append(row)
    return rows


def priority_burst(
    peer: Peer, python: Path, backlog: int, urgent: int, reps: int
) -> list[dict[str, Any]]:
    if peer.priorities is None:
        return [
            {
                "workload": "priority_burst",
                "system": LABELS[peer.name],
                "unsupported": "no priorities with the Redis broker",
            }
        ]
    rows = []
    for priority in (10, 0):
        spec = {
            "peer": peer.name,
            "workload": "priority_burst",
            "backlog": backlog,
            "urgent": urgent,
            "priority": priority,
        }
        answer = run(python, {**spec, "reps": reps})
        latencies = [[x[1] - x[0] for x in _records(r, slice(1, None))] for r in answer["runs"]]
        row = summary_row(
            "priority_burst",
            peer,
            urgent,
            answer["runs"],
            {**answer["settings"], "priorities": peer.priorities},
            "p50 wait ms",
            [quantiles(lat)["p50_ms"] for lat in latencies],
            latencies,
            counted=backlog + urgent,
        )
        row["system"] += f", arrivals at priority {priority}" + (
            " (control)" if priority == 0 else ""
        )
        rows.append(row)
    return rows


def lacks_dedup(peer: Peer) -> dict[str, Any]:
    return {
        "workload": "dedup_storm",
        "system": LABELS[peer.name],
        "unsupported": "no deduplication of identical in-flight tasks: each request executes",
    }
