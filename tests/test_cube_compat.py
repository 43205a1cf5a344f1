"""Cube's own QueryQueue (Node, @cubejs-backend/query-orchestrator 1.7) against a supervisor.

Runs where `node` and `npm` exist; installs Cube's packages (scripts disabled) into a
per-user cache once. Cube's driver formats each QUEUE command with sqlstring and sends the
text over our socket: a plain query, two concurrent identical queries (one execution) and
a priority-10 query on the fast track.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.supervisor_util import SupervisorProcess, socket_dir, start_supervisor

CUBE_VERSION = "1.7"
SCRIPT = Path(__file__).parent / "compat" / "cube_queue.js"


def _cube_packages() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: Cube compatibility not checked here")
    cache = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "queryqueue"
        / f"cube-{CUBE_VERSION}"
    )
    modules = cache / "node_modules"
    if _loads(modules):
        return modules
    shutil.rmtree(cache, ignore_errors=True)  # absent, or a broken earlier install
    cache.mkdir(parents=True)
    (cache / "package.json").write_text('{"name": "queryqueue-cube-compat", "private": true}')
    installed = subprocess.run(
        [
            "npm",
            "install",
            "--ignore-scripts",
            "--no-audit",
            "--no-fund",
            f"@cubejs-backend/query-orchestrator@{CUBE_VERSION}",
            f"@cubejs-backend/cubestore-driver@{CUBE_VERSION}",
        ],
        cwd=cache,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if installed.returncode != 0 or not _loads(modules):
        pytest.skip(f"npm could not install Cube {CUBE_VERSION}: {installed.stderr[-500:]}")
    return modules


def _loads(modules: Path) -> bool:
    if not modules.is_dir():
        return False
    probe = subprocess.run(
        ["node", "-e", "require('@cubejs-backend/query-orchestrator'); require('sqlstring')"],
        env={**os.environ, "NODE_PATH": str(modules)},
        capture_output=True,
        timeout=60,
    )
    return probe.returncode == 0


@pytest.fixture
def supervisor() -> Iterator[SupervisorProcess]:
    directory = socket_dir()
    process = start_supervisor(directory / "queue.db", directory / "s.sock")
    try:
        yield process
    finally:
        process.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.timeout(420)  # a first run installs Cube's packages from the npm registry
def test_cubes_query_queue_runs_on_the_supervisor(supervisor: SupervisorProcess) -> None:
    modules = _cube_packages()
    ran = subprocess.run(
        ["node", str(SCRIPT), str(supervisor.socket_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NODE_PATH": str(modules), "CUBEJS_QUEUE_FAST_TRACK": "true"},
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = json.loads(ran.stdout)
    quoted = 'it\'s "quoted"\n'
    assert out["plain"] == {"n": 1, "doubled": 2, "text": quoted}
    assert out["a"] == out["b"] == {"n": 2, "doubled": 4, "text": quoted}
    assert out["fast"] == {"n": 3, "doubled": 6, "text": quoted}
    assert out["executions"] == [1, 2, 3]  # the two identical queries ran once
    assert out["fastTrackEvents"] == [False, False, True]
    assert (
        "QUEUE ADD_AND_RETRIEVE" in out["commands"] and "QUEUE RESULT_BLOCKING" in out["commands"]
    )
