"""The examples in examples/ run against a real supervisor and pool, as their docstrings
say to run them (from that directory, `--app queries:app`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue.supervisor.launch import launch
from tests.supervisor_util import REPO, SupervisorProcess, socket_dir

EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module")
def supervisor() -> Iterator[SupervisorProcess]:
    directory = socket_dir()
    process = launch(
        directory / "queue.db",
        directory / "s.sock",
        "--app",
        "queries:app",
        "--workers",
        "2",
        cwd=EXAMPLES,
    )
    try:
        yield process
    finally:
        assert process.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def examples(supervisor: SupervisorProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The examples' shared QueueApp, imported as the examples import it."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import queries

    queries.app.socket_path = supervisor.socket_path
    yield queries.app
    queries.app.close()


def test_the_fastapi_endpoint_awaits_the_pools_result(examples: Any) -> None:
    from fastapi.testclient import TestClient
    from fastapi_app import api

    with TestClient(api) as client:
        answer = client.get("/squares/4")
    assert answer.status_code == 200
    assert answer.json() == {"n": 4, "rows": [[1, 1], [2, 4], [3, 9], [4, 16]]}


def test_the_django_view_waits_with_run_sync(examples: Any) -> None:
    import django
    from django.conf import settings
    from django.test import RequestFactory

    if not settings.configured:
        settings.configure(ALLOWED_HOSTS=["testserver"], DEFAULT_CHARSET="utf-8")
        django.setup()
    from django_view import total

    response = total(RequestFactory().get("/total", {"values": "1,2,39"}))
    assert response.status_code == 200
    assert response.content == b'{"sum": 42, "count": 3}'


def _run_example(socket_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """An example script as a user runs it: from examples/, beside that supervisor."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["QUERYQUEUE_SOCKET"] = str(socket_path)
    return subprocess.run(
        [sys.executable, *argv], cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_script_prints_the_rows(supervisor: SupervisorProcess) -> None:
    ran = _run_example(supervisor.socket_path, "script.py", "SELECT 6 * 7, 'answer'")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout == "42\tanswer\n"
    failed = _run_example(supervisor.socket_path, "script.py", "SELECT nonsense FROM nowhere")
    assert failed.returncode == 1 and "no such table: nowhere" in failed.stderr


def test_the_duckdb_example_answers_arrow_that_becomes_pandas_and_polars() -> None:
    directory = socket_dir()
    process = launch(
        directory / "duck.db",
        directory / "s.sock",
        "--app",
        "duckdb_app:app",
        cwd=EXAMPLES,
    )
    try:
        ran = _run_example(process.socket_path, "duckdb_caller.py", "300000")
    finally:
        assert process.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)
    assert ran.returncode == 0, ran.stderr[-3000:]
    total = sum(i * 0.5 for i in range(300_000))
    assert ran.stdout.splitlines() == [
        f"pandas 300000 {total}",
        "polars 300000 299999",
        "typed price=Decimal:12.50 day=date:2026-12-01 at=datetime:2026-12-01 09:30:00+00:00",
    ]
