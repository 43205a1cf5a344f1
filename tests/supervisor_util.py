"""Start and stop real supervisor processes for tests, by pid, on private paths."""

from __future__ import annotations

import tempfile
from pathlib import Path

from supervisor.launch import REPO, SupervisorProcess, launch

__all__ = ["REPO", "SupervisorProcess", "socket_dir", "start_supervisor"]


def socket_dir() -> Path:
    # AF_UNIX paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    return Path(tempfile.mkdtemp(prefix="qq-", dir="/tmp"))


def start_supervisor(db: Path, socket_path: Path, *extra: str) -> SupervisorProcess:
    return launch(db, socket_path, *extra)
