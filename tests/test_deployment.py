"""The deployment files the documentation gives run as written: the systemd unit's
`ExecStart` (with systemd's `%S` and `%t`) and the container image's entry point and
health check (with its paths), each in a temporary directory: the supervisor starts,
answers its health check, and stops gracefully on SIGTERM. Only the application module is
the test's own, as the files leave it to the user."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from tests.supervisor_util import REPO
from tests.waiting import wait_until_sync

DEPLOYMENT = REPO / "docs" / "deployment"
APP = "tests.apps.pool_app:app"
BIN = Path(sys.executable).parent  # where this installation's `queryqueue` is


def _unit(text: str) -> tuple[dict[str, str], list[str]]:
    """The unit's environment and its ExecStart's arguments."""
    env: dict[str, str] = {}
    command: list[str] = []
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "Environment":
            name, _, setting = value.partition("=")
            env[name] = setting
        elif key == "ExecStart":
            command = shlex.split(value)
    return env, command


def _image(text: str) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """The image's environment, entry point, health check command and the `mkdir` that
    makes its volumes' directories."""
    env: dict[str, str] = {}
    entry: list[str] = []
    check: list[str] = []
    mkdir: list[str] = []
    for line in text.splitlines():
        if line.startswith("RUN mkdir "):
            mkdir = shlex.split(line[len("RUN ") :])
        elif line.startswith("ENV "):
            name, _, value = line[4:].partition("=")
            env[name] = value
        elif line.startswith("ENTRYPOINT "):
            entry = json.loads(line[len("ENTRYPOINT ") :])
        elif line.startswith("HEALTHCHECK "):
            check = json.loads(line[line.index("CMD ") + 4 :])
    return env, entry, check, mkdir


def _serves_then_stops(
    command: list[str], env: dict[str, str], check: list[str], log: Path
) -> None:
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=out)
    try:

        def healthy() -> bool:
            done = subprocess.run(check, env=env, cwd=REPO, capture_output=True, timeout=60)
            assert process.poll() is None, log.read_text()
            return done.returncode == 0

        wait_until_sync(healthy, within=60, what="the supervisor healthy")
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    assert code == 0


def test_the_systemd_units_exec_start_serves_and_stops_gracefully(workdir: Path) -> None:
    unit_env, command = _unit((DEPLOYMENT / "queryqueue.service").read_text())
    assert unit_env["QUERYQUEUE_APP"] == "queries:app" and command[1] == "supervisor"
    state, runtime = workdir / "state", workdir / "run"
    for made in (state / "queryqueue", runtime / "queryqueue"):  # as systemd makes them
        made.mkdir(mode=0o700, parents=True)
    args = [a.replace("%S", str(state)).replace("%t", str(runtime)) for a in command[1:]]
    env = {**os.environ, **unit_env, "QUERYQUEUE_APP": APP}
    socket_path = runtime / "queryqueue" / "supervisor.sock"
    check = [str(BIN / "queryqueue"), "health", "--socket", str(socket_path), "--within", "2"]
    program = str(BIN / Path(command[0]).name)
    _serves_then_stops([program, *args], env, check, workdir / "unit.log")


def test_the_images_entry_point_and_health_check_run_as_written(workdir: Path) -> None:
    image_env, entry, check, mkdir = _image((DEPLOYMENT / "Dockerfile").read_text())
    assert image_env["QUERYQUEUE_APP"] == "queries:app" and entry[:2] == [
        "queryqueue",
        "supervisor",
    ]
    moved = {
        name: str(workdir) + value if value.startswith("/") else value
        for name, value in image_env.items()
    }
    env = {**os.environ, **moved, "QUERYQUEUE_APP": APP}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # `queryqueue` as in the image
    made = [str(workdir) + arg if arg.startswith("/") else arg for arg in mkdir]
    subprocess.run(made, check=True, timeout=60)  # the image's directories, as its RUN makes them
    _serves_then_stops(entry, env, check, workdir / "image.log")
