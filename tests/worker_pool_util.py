"""What the worker pool's tests share: a supervisor with a pool of the test app, started
and stopped by pid."""

from __future__ import annotations

import os
from pathlib import Path

from tests.supervisor_util import REPO, SupervisorProcess, start_supervisor

APP = "tests.apps.pool_app:app"


def start_pool(workdir: Path, workers: int, *options: str, app: str = APP) -> SupervisorProcess:
    return start_supervisor(
        workdir / "queue.db", workdir / "s.sock", "--app", app, "--workers", str(workers), *options
    )


def pool_env(workdir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "QUERYQUEUE_SOCKET": str(workdir / "s.sock"),
        "POOL_TRACE": str(workdir / "trace"),
    }
