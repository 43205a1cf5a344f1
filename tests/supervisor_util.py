"""Start and stop real supervisor processes for tests, by pid, on private paths."""

from __future__ import annotations

import tempfile
from pathlib import Path

from queryqueue.supervisor.launch import SupervisorProcess, launch

# The checkout: supervisors start here, so `--app tests.apps...` resolves as a user's would.
REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "SupervisorProcess", "socket_dir", "start_supervisor"]


def socket_dir() -> Path:
    # AF_UNIX paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    return Path(tempfile.mkdtemp(prefix="qq-", dir="/tmp"))


def start_supervisor(db: Path, socket_path: Path, *extra: str) -> SupervisorProcess:
    return launch(db, socket_path, *extra, cwd=REPO)
