"""Start a supervisor as a child process and stop it by its pid: for the demo, the
benchmarks and the tests, which all need a real one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


class LaunchError(RuntimeError):
    pass


@dataclass
class SupervisorProcess:
    process: subprocess.Popen[bytes]
    db: Path
    socket_path: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for the graceful exit; returns the exit code. A supervisor
        that ignores SIGTERM is killed and LaunchError raised."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)
                raise LaunchError("the supervisor ignored SIGTERM") from None
        return self.process.returncode

    def kill9(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=20)


def launch(
    db: Path,
    socket_path: Path,
    *options: str,
    env: dict[str, str] | None = None,
    ready_within: float = 30.0,
    store: str | None = None,
    cwd: Path | None = None,
) -> SupervisorProcess:
    """`queryqueue supervisor --db DB --socket SOCKET OPTIONS...` (`--store STORE` instead
    of `--db` when given), once it accepts connections. Its output goes to DB with the
    suffix .log. It runs in `cwd` (this process's by default), where `--app` resolves."""
    log = db.with_suffix(".log")
    environment = {**(env if env is not None else os.environ)}
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "queryqueue",
                "supervisor",
                *(("--store", store) if store else ("--db", str(db))),
                "--socket",
                str(socket_path),
                *options,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=environment,
        )
    supervisor = SupervisorProcess(process, db, socket_path, log)
    deadline = time.monotonic() + ready_within
    try:
        while not _accepting(socket_path):
            if process.poll() is not None:
                raise LaunchError(
                    f"the supervisor exited with {process.returncode}: {log.read_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise LaunchError(f"the supervisor did not accept connections in {ready_within} s")
            time.sleep(0.02)
    except BaseException:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=20)
        raise
    return supervisor


def _accepting(socket_path: Path) -> bool:
    if not socket_path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(socket_path))
        except OSError:
            return False
    return True
