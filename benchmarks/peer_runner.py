"""Runs one workload on one peer, inside that peer's own virtual environment.

    <peer venv>/bin/python benchmarks/peer_runner.py '{"peer": "rq", "workload": ...}'

Standalone (stdlib, psutil and the peer): it starts the peer's workers (2 processes),
spawns the request processes, measures with the same `measure.py` as ours, stops every
process it started by pid, and prints one JSON object.
"""
# mypy: ignore-errors

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from measure import TreeMeter, quantiles, redis_server_pids  # noqa: E402

BIN = Path(sys.executable).parent


def _bin(name: str, arguments: str) -> list[str]:
    return [str(BIN / name), *arguments.split()]


def worker_commands(peer: str) -> tuple[list[list[str]], dict[str, str]]:
    """The commands that start 2 worker processes, and their non-default settings."""
    if peer in ("rq", "rq-simple"):
        extra = "-w rq.worker.SimpleWorker " if peer == "rq-simple" else ""
        command = _bin("rq", f"worker --url {os.environ['QQ_REDIS_URL']} -q {extra}high default")
        return [command, command], {
            "workers": "2 x rq worker"
            + (" -w SimpleWorker (no fork per job)" if extra else " (forks per job, the default)"),
            "priorities": "queues 'high' then 'default' (RQ has no per-job priority)",
        }
    celery = "-c 2 -P prefork --without-gossip --without-mingle --without-heartbeat"
    workers = {
        # Huey polls SQLite: its defaults (0.1 s, backing off to 10 s) would add up to
        # seconds of latency to an idle queue; 10 ms to 100 ms is the fair setting.
        "huey-sqlite": (
            _bin("huey_consumer", "peer_tasks.huey -k process -w 2 -d 0.01 -m 0.1 -C -q"),
            {
                "consumer": "-k process -w 2 -d 0.01 -m 0.1 (polling 10-100 ms)",
                "result wait": "get(blocking=True, max_delay=0.1)",
            },
        ),
        "huey-redis": (
            _bin("huey_consumer", "peer_tasks.huey -k process -w 2 -C -q"),
            {"consumer": "-k process -w 2"},
        ),
        "celery": (_bin("celery", f"-A peer_tasks worker {celery} -l WARNING"), {"worker": celery}),
        "dramatiq": (
            _bin("dramatiq", "peer_tasks --processes 2 --threads 1"),
            {"worker": "--processes 2 --threads 1"},
        ),
    }
    if peer not in workers:
        raise SystemExit(f"unknown peer {peer}")
    command, settings = workers[peer]
    return [command], settings


def submit(tasks, peer: str, name: str, args: tuple, priority: int):
    if peer.startswith("huey"):
        return getattr(tasks, name)(*args, priority=priority)
    if peer.startswith("rq"):
        queue = tasks.high if priority > 0 else tasks.default
        return queue.enqueue(getattr(tasks, name), *args)
    if peer == "celery":
        # Redis priorities are inverted in Celery: 0 is the most urgent.
        return getattr(tasks, name).apply_async(args, priority=0 if priority > 0 else 9)
    return getattr(tasks, name).send(*args)


def wait(handle, peer: str):
    if peer == "huey-sqlite":
        return handle.get(blocking=True, timeout=600, max_delay=0.1)
    if peer == "huey-redis":
        return handle.get(blocking=True, timeout=600)
    if peer.startswith("rq"):
        result = handle.latest_result(timeout=600)
        if result is None or result.type != result.Type.SUCCESSFUL:
            raise RuntimeError(f"job failed: {result}")
        return result.return_value
    if peer == "celery":
        return handle.get(timeout=600)
    return handle.get_result(block=True, timeout=600_000)


def producer(peer: str, jobs: list, sequential: bool, spacing: float, go, out, index: int):
    import peer_tasks as tasks

    go.wait()
    records = []
    if sequential:
        for name, args, priority in jobs:
            started = time.time()
            wait(submit(tasks, peer, name, args, priority), peer)
            records.append((started, time.time()))
    else:
        handles = []
        for name, args, priority in jobs:
            handles.append((time.time(), submit(tasks, peer, name, args, priority)))
            if spacing:
                time.sleep(spacing)
        for started, handle in handles:
            wait(handle, peer)
            records.append((started, time.time()))
    out.put((index, records))


def start_workers(peer: str, env: dict) -> list[subprocess.Popen]:
    commands, _ = worker_commands(peer)
    return [
        subprocess.Popen(
            command,
            cwd=HERE,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for command in commands
    ]


def stop_workers(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
    for worker in workers:
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=20)


def fresh_store(peer: str) -> None:
    """Empty the peer's store between repetitions. Huey on SQLite is emptied through its
    own API: the file stays, so connections opened earlier keep meeting the workers."""
    if peer == "huey-sqlite":
        import peer_tasks

        peer_tasks.huey.flush()
    else:
        from redis import Redis

        Redis.from_url(os.environ["QQ_REDIS_URL"]).flushdb()


def run_once(spec: dict, workdir: Path) -> dict:
    peer = spec["peer"]
    env = {**os.environ, "QQ_PEER": peer, "QQ_PEER_DIR": str(workdir), "PYTHONPATH": str(HERE)}
    os.environ.update({k: env[k] for k in ("QQ_PEER", "QQ_PEER_DIR")})
    fresh_store(peer)
    context = multiprocessing.get_context("spawn")
    workers = start_workers(peer, env)
    processes: list = []
    try:
        import peer_tasks as tasks

        deadline = time.monotonic() + 60
        for _ in range(50):  # ready, and warm
            wait(submit(tasks, peer, "noop", (), 0), peer)
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not start")
        shares, sequential, spacing, offsets = plan(spec)
        go = [context.Event() for _ in shares]
        out = context.Queue()
        processes = [
            context.Process(
                target=producer, args=(peer, jobs, sequential, spacing[i], go[i], out, i)
            )
            for i, jobs in enumerate(shares)
        ]
        for process in processes:
            process.start()
        time.sleep(1.0)  # imported and waiting
        with TreeMeter(extra_pids=[] if peer == "huey-sqlite" else redis_server_pids()) as meter:
            by_share = go_and_collect(go, offsets, out, processes)
    finally:
        end(processes, workers)
    return {"by_share": by_share, "cpu_s": meter.cpu_s, "peak_rss": meter.peak_rss}


def go_and_collect(go: list, offsets: list[float], out, processes: list) -> list:
    """Tell each request process to go, `offsets` seconds after the first, then each
    one's records, in the order of the processes."""
    began = time.monotonic()
    for event, offset in sorted(zip(go, offsets, strict=True), key=lambda g: g[1]):
        time.sleep(max(0.0, began + offset - time.monotonic()))
        event.set()
    by_share = [[] for _ in processes]
    for index, records in collect(out, processes):
        by_share[index] = records
    return by_share


def end(processes: list, workers: list[subprocess.Popen]) -> None:
    """The request processes joined, and the peer's workers stopped. A failed run leaves
    request processes behind, one perhaps blocked handing its records to a queue nobody
    reads now: this process's exit would wait for it, so it is terminated."""
    for process in processes:
        process.join(30)
        if process.is_alive():
            process.terminate()
            process.join(10)
    stop_workers(workers)


def collect(out, processes: list, limit_s: float = 3600.0):
    """Each request process's records as it reports them. One that died without
    reporting (an exception in the peer's client) fails the run at once, naming its exit
    code, instead of holding up the suite for the whole limit."""
    deadline = time.monotonic() + limit_s
    reported, quiet_since = 0, None
    while reported < len(processes):
        try:
            yield out.get(timeout=1.0)
            reported += 1
            quiet_since = None
            continue
        except queue.Empty:
            pass
        codes = [p.exitcode for p in processes]
        if any(code not in (None, 0) for code in codes):
            raise RuntimeError(f"a request process died without its records: exit codes {codes}")
        if all(code == 0 for code in codes):  # all gone: what they sent is in by now
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 10:
                raise RuntimeError("the request processes ended without all their records")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no records after {limit_s:.0f} s")


def warm(context, target, *args) -> None:
    """`target(*args, go, out, 0)` in a process of its own, `go` already set, waited for
    until it reports (60 s at most): the peer's workers up and warm."""
    out = context.Queue()
    process = context.Process(target=target, args=(*args, AlreadySet(), out, 0))
    process.start()
    try:
        out.get(timeout=60)
    finally:
        process.join(10)
        if process.is_alive():
            process.terminate()


class AlreadySet:
    """An event already set."""

    def wait(self) -> bool:
        return True


def plan(spec: dict):
    """Per request process: jobs (task, args, priority), sequential?, spacing, start offset."""
    workload = spec["workload"]
    if workload == "throughput":
        per = spec["n"] // spec["producers"]
        shares = [[("noop", (), 0)] * per for _ in range(spec["producers"])]
        return shares, False, [0.0] * len(shares), [0.0] * len(shares)
    if workload == "idle_latency":
        return [[("noop", (), spec["priority"])] * spec["n"]], True, [0.0], [0.0]
    if workload == "priority_burst":
        background = [("sleep", (0.02,), 0)] * spec["backlog"]
        arrivals = [("noop", (), spec["priority"])] * spec["urgent"]
        return [background, arrivals], False, [0.0, 0.05], [0.0, 0.5]
    raise SystemExit(f"unknown workload {workload}")


def main() -> None:
    spec = json.loads(sys.argv[1])
    _, settings = worker_commands(spec["peer"])
    workdir = Path(tempfile.mkdtemp(prefix="qq-peer-"))
    try:
        runs = [run_once(spec, workdir) for _ in range(spec["reps"])]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    import peer_tasks

    print(
        json.dumps(
            {
                "runs": runs,
                "settings": {**settings, **peer_tasks.SETTINGS},
                "quantiles_check": quantiles([0.001]),
            }
        )
    )


if __name__ == "__main__":
    main()
