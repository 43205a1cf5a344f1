"""The demo's queue: analytical SQL against a SQLite "warehouse" file.

The supervisor's workers import this module (`--app queryqueue.demo_app:app`), and so do
the demo's request processes. Each query names the warehouse file it runs against, so the
module holds no configuration.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import uuid
from typing import Any

from queryqueue.app import QueueApp
from queryqueue.engine.stream import QueryStream

# Executions time out after this many seconds (the demo submits one query that does).
EXECUTION_TIMEOUT = float(os.environ.get("QUERYQUEUE_DEMO_TIMEOUT", "4"))

app = QueueApp(
    "demo",
    concurrency=int(os.environ.get("QUERYQUEUE_DEMO_CONCURRENCY", "2")),
    execution_timeout=EXECUTION_TIMEOUT,
    continue_wait_timeout=2.0,
    heartbeat_interval=1.0,
    orphaned_timeout=30.0,
)

# Connections of the queries running in this process, by cancel token: a cancellation
# interrupts the SQLite statement where it runs.
_running: dict[str, sqlite3.Connection] = {}
_lock = threading.Lock()


def connect(warehouse: str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{warehouse}?mode=ro", uri=True, check_same_thread=False)


def run_sql(warehouse: str, sql: str) -> list[list[Any]]:
    conn = connect(warehouse)
    try:
        return [list(row) for row in conn.execute(sql)]
    finally:
        conn.close()


@app.handler("sql")
def execute(query: dict[str, Any], set_cancel_handler: Any) -> list[list[Any]]:
    token = uuid.uuid4().hex
    conn = connect(query["warehouse"])
    with _lock:
        _running[token] = conn
    set_cancel_handler(token)
    try:
        return [list(row) for row in conn.execute(query["sql"])]
    finally:
        with _lock:
            _running.pop(token, None)
        conn.close()


@app.cancel_handler("sql")
def cancel(definition: dict[str, Any]) -> None:
    with _lock:
        conn = _running.get(str(definition.get("cancelHandler")))
    if conn is not None:
        conn.interrupt()  # the statement fails with "interrupted"; the worker is free again


@app.stream
async def stream(query: dict[str, Any], rows: QueryStream) -> None:
    conn = connect(query["warehouse"])
    try:
        for row in conn.execute(query["sql"]):
            await rows.write(list(row))
    finally:
        conn.close()
