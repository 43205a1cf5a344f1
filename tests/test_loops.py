"""The supervisor's and workers' event loop: uvloop where installed, the standard loop on
request (`--loop asyncio`) or where uvloop is missing; `--loop uvloop` without it is refused."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from queryqueue import SocketQueueDriver
from queryqueue.supervisor import loops
from tests.supervisor_util import REPO, start_supervisor

APP = "tests.apps.pool_app:app"


async def _running_loop() -> str:
    return type(asyncio.get_running_loop()).__module__.partition(".")[0]


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_the_standard_loop() -> None:
    pytest.importorskip("uvloop")
    assert loops.run(_running_loop()) == "uvloop"
    assert loops.run(_running_loop(), "uvloop") == "uvloop"
    assert loops.run(_running_loop(), "asyncio") == "asyncio"
    assert loops.loop_factory("auto") is not None and loops.loop_factory("asyncio") is None


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert loops.run(_running_loop()) == "asyncio"
    with pytest.raises(loops.LoopUnavailableError, match="uvloop"):
        loops.run(_running_loop(), "uvloop")


def test_an_unknown_loop_is_refused_by_name() -> None:
    main = _running_loop()
    with pytest.raises(ValueError, match="'tornado'"):
        loops.run(main, "tornado")  # type: ignore[arg-type]
    assert inspect.getcoroutinestate(main) == "CORO_CLOSED"  # not left to warn, unawaited


@pytest.mark.parametrize("choice", ["auto", "asyncio"])
async def test_the_supervisor_and_its_workers_run_on_the_chosen_loop(
    workdir: Path, choice: str
) -> None:
    pytest.importorskip("uvloop")
    from tests.apps.pool_app import app

    expected = "uvloop" if choice == "auto" else "asyncio"
    supervisor = start_supervisor(
        workdir / "queue.db", workdir / "s.sock", "--app", APP, "--loop", choice
    )
    driver = SocketQueueDriver(supervisor.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=10.0)
    try:
        stats = await driver.stats()
        assert stats["event_loop"].startswith(f"{expected}.")
        # The supervisor's startup objects are out of the collector's way, and its
        # youngest generation is collected less often than the interpreter's default.
        assert stats["collector"]["frozen_objects"] > 10_000
        assert stats["collector"]["young_objects"] == loops.YOUNG_OBJECTS
        in_worker = await queue.execute_in_queue("loop", "which", {})
        assert in_worker.startswith(f"{expected}.")
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
        assert supervisor.stop() == 0


def test_the_cli_refuses_uvloop_where_it_is_not_installed(workdir: Path) -> None:
    # A sitecustomize-free way to hide uvloop from the child: a module that fails to import.
    hide = workdir / "hide"
    hide.mkdir()
    (hide / "uvloop.py").write_text("raise ImportError('hidden for this test')\n")
    where = ["--db", str(workdir / "q.db"), "--socket", str(workdir / "s.sock")]
    done = subprocess.run(
        [sys.executable, "-m", "queryqueue", "supervisor", *where, "--loop", "uvloop"],
        cwd=REPO,
        env={"PYTHONPATH": f"{hide}:{REPO}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "uvloop event loop is not installed" in done.stderr
