"""The package a user installs: one import name, every public name importable from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import queryqueue

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_is_importable_from_queryqueue() -> None:
    for name in queryqueue.__all__:
        assert getattr(queryqueue, name) is not None, name
    for name in (
        "QueryQueue",
        "SyncQueryQueue",
        "QueueApp",
        "RetrievedQuery",
        "ContinueWaitError",
        "QueryError",
        "QueryCancelledError",
        "QueryTimeoutError",
        "QueueError",
        "LocalQueueDriver",
        "SqliteQueueStore",
        "SocketQueueDriver",
        "hash_query_key",
        "PostgresQueueStore",
    ):
        assert name in queryqueue.__all__, name
    assert issubclass(queryqueue.QueryCancelledError, queryqueue.QueryError)
    assert issubclass(queryqueue.QueryTimeoutError, TimeoutError)
    assert queryqueue.__version__[0].isdigit()


def test_the_postgres_store_imports_without_psycopg_and_says_what_to_install() -> None:
    ran = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['psycopg'] = None\n"
            "from queryqueue import PostgresQueueStore\n"
            "try:\n"
            "    PostgresQueueStore('postgresql://nowhere/db')\n"
            "except ImportError as exc:\n"
            "    print(exc)\n",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert "pip install 'queryqueue[postgres]'" in ran.stdout


def test_an_install_adds_exactly_one_top_level_package(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(
        ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "build",
            "dist",
            "*.egg-info",
            ".peers",
            "node_modules",
            "__pycache__",
            ".*_cache",
            ".hypothesis",
            "results",
        ),
    )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("queryqueue-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert top_level == {"queryqueue"}
    for expected in (
        "queryqueue/__init__.py",
        "queryqueue/py.typed",
        "queryqueue/engine/queue.py",
        "queryqueue/driver_sqlite/store.py",
        "queryqueue/driver_postgres/store.py",
        "queryqueue/driver_socket/client.py",
        "queryqueue/app.py",
        "queryqueue/cli.py",
        "queryqueue/supervisor/status.html",  # the --http page, package data
    ):
        assert expected in names, expected
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "queryqueue = queryqueue.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_classes_a_user_calls_say_what_each_public_method_does() -> None:
    import inspect

    from queryqueue import (
        Client,
        Codecs,
        QueryHandle,
        QueryQueue,
        QueryStream,
        QueueApp,
        ResultView,
        SocketQueueDriver,
        SyncQueryQueue,
    )

    undocumented = [
        cls.__name__ for cls in (SocketQueueDriver,) if not (inspect.getdoc(cls) or "").strip()
    ]
    classes = (QueueApp, QueryHandle, Client, QueryQueue, SyncQueryQueue, QueryStream, ResultView)
    for cls in (*classes, Codecs):
        members = [("", cls)] + [
            (name, getattr(cls, name)) for name in vars(cls) if not name.startswith("_")
        ]
        undocumented += [
            f"{cls.__name__}.{name}"
            for name, member in members
            if callable(member) and not (inspect.getdoc(member) or "").strip()
        ]
    assert undocumented == []
