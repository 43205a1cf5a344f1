"""Rolling out new handler code without a stop: SIGHUP (or `queryqueue reload`) has every
worker finish what it holds and retire, replaced by one that imports the new code; a new
version that does not import is refused, and the old workers go on. Callers asking all
along see only answers, old or new, and no query runs twice."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue.supervisor.launch import SupervisorProcess, launch
from tests.trace import read_trace
from tests.waiting import wait_until

MODULE = textwrap.dedent(
    """
    import os, time
    from queryqueue import QueueApp

    app = QueueApp("reload", concurrency=2, continue_wait_timeout=1.0, heartbeat_interval=0.25)
    VERSION = {version!r}


    @app.handler("version")
    def version(query, set_cancel_handler):
        with open(os.environ["POOL_TRACE"], "a") as out:
            out.write(f"start {{query['key']}} {{os.getpid()}} {{time.monotonic()}}\\n")
        time.sleep(0.02)
        return VERSION
    """
)


def _write(workdir: Path, version: str, *, broken: bool = False) -> None:
    text = MODULE.format(version=version) + (
        "\nraise ImportError('a broken build')\n" if broken else ""
    )
    (workdir / "reload_app.py").write_text(text)


@pytest.fixture
def host(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SupervisorProcess]:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # every import reads the source
    _write(workdir, "old")
    process = launch(
        workdir / "q.db",
        workdir / "q.sock",
        "--app",
        "reload_app:app",
        "--workers",
        "2",
        cwd=workdir,
    )
    try:
        yield process
    finally:
        assert process.stop() == 0


def _callers_app(workdir: Path, host: SupervisorProcess) -> Any:
    spec = importlib.util.spec_from_file_location("reload_app_caller", workdir / "reload_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.app.socket_path = host.socket_path
    return module.app


async def test_a_reload_rolls_out_new_code_while_callers_keep_asking(
    host: SupervisorProcess, workdir: Path
) -> None:
    app = _callers_app(workdir, host)
    answers: list[str] = []
    stop = asyncio.Event()

    async def keep_asking(caller: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            key = f"c{caller}-{n}"
            answers.append(await app.run("version", {"key": key}, key=key, timeout=60))

    callers = [asyncio.ensure_future(keep_asking(i)) for i in range(4)]
    try:
        await wait_until(lambda: len(answers) >= 8, within=30, what="old answers")
        _write(workdir, "newer")
        os.kill(host.pid, signal.SIGHUP)
        await wait_until(lambda: "newer" in answers[-4:], within=60, what="new answers")
        _write(workdir, "newest", broken=True)
        await asyncio.to_thread(_reload_command, host)
        await wait_until(
            lambda: "reload refused" in host.log.read_text(), within=60, what="the refusal"
        )
        seen = len(answers)
        await wait_until(lambda: len(answers) >= seen + 8, within=30, what="answers go on")
    finally:
        stop.set()
        done = await asyncio.gather(*callers, return_exceptions=True)
        await app.aclose()
    assert [d for d in done if d is not None] == []  # no caller saw an error
    assert set(answers) == {"old", "newer"} and answers[-1] == "newer"
    starts = [t[1] for t in read_trace(workdir) if t[0] == "start"]
    assert len(starts) == len(set(starts)) == len(answers)  # each query ran once


def _reload_command(host: SupervisorProcess) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "queryqueue", "reload", "--socket", str(host.socket_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"pid {host.pid}" in done.stdout
