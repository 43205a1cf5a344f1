"""queryqueue as a user meets it: `queryqueue supervisor --app mymod:app` started in the
directory that holds `mymod.py` (no PYTHONPATH), callers using `app.run_sync`, `queryqueue
cancel`, and errors that arrive with their cause."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from queryqueue import InvalidCommandError, QueueApp, SocketQueueDriver
from tests.waiting import wait_until_sync

MYMOD = textwrap.dedent(
    """
    import os, threading, time
    from queryqueue import QueueApp

    # A long heartbeat: a cancel that reaches the worker in about a second did not come
    # through the heartbeat.
    app = QueueApp("mymod", concurrency=2, heartbeat_interval=30.0, continue_wait_timeout=1.0)
    stop = threading.Event()

    def trace(*fields):
        with open(os.environ["MYMOD_TRACE"], "a") as out:
            out.write(" ".join(str(f) for f in fields) + "\\n")

    @app.handler("echo")
    def echo(query, set_cancel_handler):
        return {"query": query, "pid": os.getpid()}

    @app.handler("divide")
    def divide(query, set_cancel_handler):
        return query["a"] / query["b"]

    @app.handler("slow")
    def slow(query, set_cancel_handler):
        stop.clear()
        trace("start", query["key"], os.getpid(), time.monotonic())
        stop.wait(60)
        return "finished"

    @app.cancel_handler("slow")
    def cancel_slow(definition):
        trace("cancel", definition["query"]["key"], os.getpid(), time.monotonic())
        stop.set()
    """
)

CALLER = textwrap.dedent(
    """
    import json, os, sys, threading
    from queryqueue import QueryError
    from mymod import app, echo

    def outcome(call):
        try:
            return {"ok": call()}
        except QueryError as exc:
            return {"error": type(exc).__name__, "type": exc.error_type,
                    "message": str(exc), "traceback": exc.remote_traceback}

    mode = sys.argv[1]
    if mode == "echo":
        print(json.dumps({
            "pid": os.getpid(),
            "low": outcome(lambda: echo.run_sync({"x": 1})),  # the handler's handle
            "urgent": outcome(lambda: app.run_sync("echo", {"x": 2}, priority=10)),
        }))
    elif mode == "hand-built":
        from queryqueue import SocketQueueDriver, SyncQueryQueue
        with SyncQueryQueue("mymod", query_handlers=app.query_handlers,
                            driver=SocketQueueDriver()) as queue:
            print(json.dumps({
                "pid": os.getpid(),
                "urgent": outcome(lambda: queue.run("echo", "k3", {"x": 3}, priority=10)),
            }))
    elif mode == "divide":
        print(json.dumps(outcome(lambda: app.run_sync("divide", {"a": 1, "b": 0}))))
    elif mode == "slow":
        key = sys.argv[2]
        outcomes = []
        def wait():
            outcomes.append(outcome(lambda: app.run_sync("slow", {"key": key})))
        threads = [threading.Thread(target=wait) for _ in range(3)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(json.dumps(outcomes))
    app.close()
    """
)


@dataclass
class Project:
    """A user's directory: mymod.py, a caller script, a running supervisor."""

    root: Path
    socket_path: Path
    process: subprocess.Popen[bytes]
    log: Path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["QUERYQUEUE_SOCKET"] = str(self.socket_path)
        env["MYMOD_TRACE"] = str(self.root / "trace")
        return env

    def call(self, mode: str) -> object:
        ran = subprocess.run(
            [sys.executable, "caller.py", mode],
            cwd=self.root,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 0, ran.stderr[-3000:]
        return orjson.loads(ran.stdout)

    def slow_caller(self, key: str) -> subprocess.Popen[str]:
        """Three threads of one process waiting for the slow query `key`, once it runs."""
        caller = subprocess.Popen(
            [sys.executable, "caller.py", "slow", key],
            cwd=self.root,
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until_sync(
                lambda: ["start", key] in [t[:2] for t in self.trace()], within=30, what="started"
            )
        except BaseException:
            caller.kill()
            caller.communicate(timeout=20)
            raise
        return caller

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The `queryqueue` command, as a user runs it against this supervisor."""
        return subprocess.run(
            [_console_script(), *args], env=self.env(), capture_output=True, text=True, timeout=30
        )

    def trace(self) -> list[list[str]]:
        path = self.root / "trace"
        return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _console_script() -> str:
    script = Path(sys.executable).with_name("queryqueue")
    assert script.exists(), f"the queryqueue command is not installed beside {sys.executable}"
    return str(script)


@pytest.fixture(scope="module")
def project() -> Iterator[Project]:
    from tests.supervisor_util import socket_dir

    root = socket_dir()
    (root / "mymod.py").write_text(MYMOD)
    (root / "caller.py").write_text(CALLER)
    socket_path = root / "s.sock"
    log = root / "supervisor.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MYMOD_TRACE"] = str(root / "trace")
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                _console_script(),
                "supervisor",
                "--db",
                "queue.db",
                "--socket",
                str(socket_path),
                "--app",
                "mymod:app",
                "--workers",
                "2",
            ],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until_sync(
            lambda: socket_path.exists() or process.poll() is not None, within=30, what="socket"
        )
        assert process.poll() is None, log.read_text()
        yield Project(root, socket_path, process, log)
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
        output = log.read_text()[-3000:]
        shutil.rmtree(root, ignore_errors=True)
        assert code == 0, output


def test_the_app_resolves_from_the_working_directory_and_run_sync_uses_the_pool(
    project: Project,
) -> None:
    answer = project.call("echo")
    assert isinstance(answer, dict)
    low, urgent = answer["low"]["ok"], answer["urgent"]["ok"]
    assert low["query"] == {"x": 1} and urgent["query"] == {"x": 2}
    # Nothing runs in the calling process, whatever the priority (10 is the fast track).
    assert low["pid"] != answer["pid"] and urgent["pid"] != answer["pid"]


def test_a_hand_built_sync_queue_on_the_socket_hands_urgent_work_to_the_pool(
    project: Project,
) -> None:
    answer = project.call("hand-built")
    assert isinstance(answer, dict)
    urgent = answer["urgent"]["ok"]
    assert urgent["query"] == {"x": 3}
    assert urgent["pid"] != answer["pid"]  # the fast track retrieved it here; the pool ran it


def test_a_handler_error_arrives_with_its_type_and_traceback_and_is_logged_once(
    project: Project,
) -> None:
    answer = project.call("divide")
    assert isinstance(answer, dict)
    assert (answer["error"], answer["type"]) == ("QueryError", "ZeroDivisionError")
    assert answer["message"] == "division by zero"
    assert "in divide" in answer["traceback"]
    assert "ZeroDivisionError: division by zero" in answer["traceback"]
    wait_until_sync(lambda: "ZeroDivisionError" in project.log.read_text(), within=10)
    logged = project.log.read_text()
    assert logged.count("ZeroDivisionError: division by zero") == 1


def test_cancel_from_the_command_line_reaches_every_waiter_and_the_worker_at_once(
    project: Project,
) -> None:
    caller = project.slow_caller("s")
    try:
        started = time.monotonic()
        cancelled = project.cli("cancel", "--prefix", "mymod", '{"key": "s"}')
        assert cancelled.returncode == 0, cancelled.stderr
        assert cancelled.stdout.startswith("cancelled mymod:")
        wait_until_sync(
            lambda: ["cancel", "s"] in [t[:2] for t in project.trace()], within=10, what="cancel"
        )
        # The worker's cancel handler ran within about a second, with a 30 s heartbeat.
        cancel_at = float(next(t for t in project.trace() if t[:2] == ["cancel", "s"])[3])
        assert cancel_at - started < 2.0
        out, err = caller.communicate(timeout=30)
        assert caller.returncode == 0, err[-3000:]
        outcomes = orjson.loads(out)
        assert [o["error"] for o in outcomes] == ["QueryCancelledError"] * 3
        assert sum(t[:2] == ["start", "s"] for t in project.trace()) == 1  # it ran once
        again = project.cli("cancel", "--prefix", "mymod", '{"key": "s"}')
        assert again.returncode == 1 and "nothing queued or running" in again.stderr
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.communicate(timeout=20)


def test_dispatch_takes_only_an_active_items_name_never_a_pickle(project: Project) -> None:
    async def attempt() -> list[str]:
        driver = SocketQueueDriver(project.socket_path)
        refused = []
        try:
            for args in (
                ("mymod:0123456789abcdef0123456789abcdef", 999_999),  # no such active item
                (1, "gASVAAAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOUjAJpZJSFlFKULg=="),  # a pickle
            ):
                with pytest.raises(InvalidCommandError) as raised:
                    await driver.call("dispatch", *args)
                refused.append(str(raised.value))
        finally:
            await driver.close()
        return refused

    refused = asyncio.run(attempt())
    assert "is not an active item" in refused[0]
    assert "takes an item's path and its queue id" in refused[1]


def test_status_shows_the_workers_and_what_they_run(project: Project) -> None:
    caller = project.slow_caller("watched")
    try:
        ran = project.cli("status", "--json")
        assert ran.returncode == 0, ran.stderr
        stats = orjson.loads(ran.stdout)
        workers = stats["pool"]["workers"]
        worker_pid = int(next(t for t in project.trace() if t[:2] == ["start", "watched"])[2])
        assert worker_pid in [w["pid"] for w in workers]
        busy = next(w for w in workers if w["pid"] == worker_pid)
        assert busy["state"] == "busy" and busy["rss"] > 0
        assert busy["running"]["path"].startswith("mymod:")
        assert busy["running"]["running_s"] >= 0
        # The same for a person, twice (--watch), then it stops by itself.
        watched = project.cli("status", "--watch", "0.05", "--count", "2")
        assert watched.returncode == 0, watched.stderr
        assert watched.stdout.count("pool: 2 of 2 workers") == 2
        assert str(worker_pid) in watched.stdout and "busy" in watched.stdout
        assert project.cli("cancel", "--prefix", "mymod", '{"key": "watched"}').returncode == 0
        caller.communicate(timeout=30)
        assert caller.returncode == 0
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.communicate(timeout=20)


def test_an_option_queryqueue_does_not_take_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match=r"'concurency': did you mean 'concurrency'\?"):
        QueueApp("typo", concurency=4)  # type: ignore[arg-type]  # mypy refuses it too
    assert QueueApp("fine", concurrency=4, execution_timeout=30.0).queue_options == {
        "concurrency": 4,
        "execution_timeout": 30.0,
    }


def test_an_app_reference_that_names_no_queueapp_says_what_the_module_has() -> None:
    from queryqueue.app import AppNotFoundError, load_app

    with pytest.raises(AppNotFoundError, match=r"'aap' is not in tests\.apps\.pool_app, .*"
                       r"did you mean tests\.apps\.pool_app:app\?"):  # fmt: skip
        load_app("tests.apps.pool_app:aap")
    with pytest.raises(AppNotFoundError, match=r"'run' is a QueryHandle, not a QueueApp \(its "
                       r"QueueApps: app, one, short, single, six, three\)"):  # fmt: skip
        load_app("tests.apps.pool_app:run")
    with pytest.raises(AppNotFoundError, match=r"tests\.waiting defines no QueueApp"):
        load_app("tests.waiting:app")
    with pytest.raises(AppNotFoundError, match=r"looks like pkg\.module:app"):
        load_app("tests.apps.pool_app")
