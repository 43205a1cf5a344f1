"""Start and stop real supervisor processes for tests, by pid, on private paths."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.waiting import wait_until_sync

REPO = Path(__file__).resolve().parents[1]


@dataclass
class SupervisorProcess:
    process: subprocess.Popen[bytes]
    db: Path
    socket_path: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> int:
        """SIGTERM, then wait for the graceful exit; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)
                raise AssertionError("supervisor ignored SIGTERM") from None
        return self.process.returncode

    def kill9(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=20)


def socket_dir() -> Path:
    # AF_UNIX paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    return Path(tempfile.mkdtemp(prefix="qq-", dir="/tmp"))


def start_supervisor(db: Path, socket_path: Path, *extra: str) -> SupervisorProcess:
    log = db.with_suffix(".log")
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "supervisor.cli",
                "supervisor",
                "--db",
                str(db),
                "--socket",
                str(socket_path),
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    supervisor = SupervisorProcess(process, db, socket_path, log)

    def accepting() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"supervisor exited with {process.returncode}: {log.read_text()}")
        if not socket_path.exists():
            return False
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(str(socket_path))
            except OSError:
                return False
        return True

    try:
        wait_until_sync(accepting, within=30, what="supervisor accepting connections")
    except BaseException:
        process.kill()
        process.wait(timeout=20)
        raise
    return supervisor
