"""`queryqueue health` and `/healthz`: a supervisor that answers with its pool whole is
healthy (exit 0, HTTP 200, no token asked, no data given); one that is not there, or
short of workers, is not (exit 1, HTTP 503), saying why."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from queryqueue.supervisor.health import problems
from tests.supervisor_util import REPO, SupervisorProcess, start_supervisor
from tests.test_observability import Site

APP = "tests.apps.pool_app:app"


@pytest.fixture
def host(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SupervisorProcess]:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    process = start_supervisor(
        workdir / "q.db",
        workdir / "q.sock",
        "--app",
        APP,
        "--workers",
        "2",
        "--http",
        "127.0.0.1:0",
    )
    try:
        yield process
    finally:
        assert process.stop() == 0


def _health(socket_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "queryqueue",
            "health",
            "--socket",
            str(socket_path),
            "--within",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_a_serving_supervisor_is_healthy_to_both_probes(host: SupervisorProcess) -> None:
    done = _health(host.socket_path)
    assert done.returncode == 0 and done.stdout.strip() == "healthy", done.stderr
    site = Site(host)
    with urllib.request.urlopen(site.base + "/healthz", timeout=20) as response:
        assert response.status == 200 and response.read() == b"ok\n"  # no token, no data
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(site.base + "/api/status", timeout=20)
    assert refused.value.code == 401  # the other routes still want the token
    refused.value.close()


def test_no_supervisor_is_unhealthy_saying_where_it_looked(workdir: Path) -> None:
    done = _health(workdir / "nobody.sock")
    assert done.returncode == 1
    assert "unhealthy" in done.stderr and "nobody.sock" in done.stderr


def test_a_pool_short_of_workers_is_unhealthy() -> None:
    assert problems({"pool": {"alive": 2, "size": 2}}) == []
    assert problems({}) == []  # no pool: nothing to be short of
    assert problems({"pool": {"alive": 1, "size": 2}}) == ["the pool has 1 of its 2 workers"]
