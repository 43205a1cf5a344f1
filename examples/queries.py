"""The queue every example shares: defined once, imported by the supervisor's workers
and by every process that asks for results.

    cd examples
    queryqueue supervisor --db queue.db --app queries:app --workers 2
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

from queryqueue import QueueApp, SetCancelHandler

app = QueueApp("examples", concurrency=2)

# The connections running right now, so a cancel can interrupt the right statement.
_running: dict[str, sqlite3.Connection] = {}
_lock = threading.Lock()


@app.handler("sql")
def run_sql(query: dict[str, Any], set_cancel_handler: SetCancelHandler) -> list[list[Any]]:
    """Runs `query["sql"]` with `query["params"]` (in a worker of the pool)."""
    connection = sqlite3.connect(":memory:")
    token = f"{threading.get_ident()}-{id(connection)}"
    with _lock:
        _running[token] = connection
    set_cancel_handler(token)  # what the cancel handler below receives
    try:
        rows = connection.execute(query["sql"], query.get("params", [])).fetchall()
        return [list(row) for row in rows]
    finally:
        with _lock:
            _running.pop(token, None)
        connection.close()


@app.cancel_handler("sql")
def cancel_sql(definition: dict[str, Any]) -> None:
    with _lock:
        connection = _running.get(str(definition.get("cancelHandler")))
    if connection is not None:
        connection.interrupt()
