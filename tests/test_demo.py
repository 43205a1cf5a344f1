"""The main job: `queryqueue demo` runs its workload end to end and checks itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import psutil

from queryqueue.demo import BACKGROUND, Outcome, digest, plan, summarize
from tests.supervisor_util import REPO


def test_the_demo_runs_a_small_workload_and_passes() -> None:
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "queryqueue",
            "demo",
            "--rows",
            "20000",
            "--requests",
            "80",
            "--clients",
            "2",
            "--users",
            "6",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "PASSED: every result correct" in ran.stdout
    executions = int(re.search(r"executions\s+\| (\d+)", ran.stdout).group(1))  # type: ignore[union-attr]
    assert 0 < executions < 80  # identical in-flight queries shared an execution
    assert re.search(r"cancelled\s+\| cancelled after", ran.stdout)
    assert re.search(r"timed out\s+\| timed out after", ran.stdout)


def test_the_plan_shares_popular_queries_between_processes() -> None:
    shares = plan(200, 4)
    assert sum(len(s) for s in shares) == 200
    kinds = [r.kind for s in shares for r in s]
    assert kinds.count("cancel") == kinds.count("timeout") == kinds.count("stream") == 1
    asked_by = [
        {i for i, s in enumerate(shares) if any(r.sql == sql for r in s)} for sql in BACKGROUND
    ]
    assert len(asked_by[0]) == 4  # the most popular report comes from every process


def test_a_wrong_result_fails_the_demo() -> None:
    right = digest([[1, 2.5]])
    outcomes = [
        Outcome(0, "sql", "SELECT 1", 0, 0.1, "ok", digest=right),
        Outcome(1, "sql", "SELECT 1", 0, 0.1, "ok", digest=right),
    ]
    stats = {"pool": {"handed_off": 1}, "commands_total": 10, "mean_batch": 1.0}
    assert summarize(outcomes, {"SELECT 1": right}, stats, 1.0, 2, 1, 4.0).passed
    outcomes[1].digest = digest([[1, 2.6]])
    report = summarize(outcomes, {"SELECT 1": right}, stats, 1.0, 2, 1, 4.0)
    assert not report.passed and "wrong results     | 1" in report.text


def test_a_demo_stopped_by_sigterm_stops_its_supervisor_and_workers() -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "queryqueue", "demo", "--rows", "20000", "--requests", "4000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    started: list[psutil.Process] = []
    try:
        assert demo.stdout is not None
        line = ""
        while "supervisor pid" not in line:
            line = demo.stdout.readline()
            assert line, "the demo ended before it started its supervisor"
        supervisor = psutil.Process(int(line.split("supervisor pid ")[1].split()[0]))
        started = [supervisor, *supervisor.children()]
        demo.send_signal(signal.SIGTERM)
        demo.communicate(timeout=60)
        assert demo.returncode != 0
        for process in started:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                process.wait(timeout=30)  # raises if it outlives the deadline
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate(timeout=20)
        for process in started:  # whatever the demo failed to stop, this test stops
            if process.is_running():
                process.kill()
