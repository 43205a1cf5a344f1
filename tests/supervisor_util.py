"""Start and stop real supervisor processes for tests, by pid, on private paths."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.supervisor.launch import SupervisorProcess, launch

# The checkout: supervisors start here, so `--app tests.apps...` resolves as a user's would.
REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "SupervisorProcess", "close_all", "socket_dir", "start_supervisor", "stats_of"]


def socket_dir() -> Path:
    # AF_UNIX paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    return Path(tempfile.mkdtemp(prefix="qq-", dir="/tmp"))


def start_supervisor(db: Path, socket_path: Path, *extra: str) -> SupervisorProcess:
    return launch(db, socket_path, *extra, cwd=REPO)


async def stats_of(socket_path: Path) -> dict[str, Any]:
    """The supervisor's `stats`, on a connection of its own."""
    driver = SocketQueueDriver(socket_path)
    try:
        return await driver.stats()
    finally:
        await driver.close()


async def close_all(
    queues: Sequence[Any], drivers: Sequence[SocketQueueDriver], hosts: Sequence[SupervisorProcess]
) -> None:
    """Each queue shut down and its driver closed, then each supervisor stopped by pid."""
    for queue, driver in zip(queues, drivers, strict=True):
        await queue.shutdown(grace=0)
        await driver.close()
    for host in hosts:
        assert host.stop() == 0
