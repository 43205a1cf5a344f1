"""`queryqueue demo`: a real workload on the embedded SQLite queue.

Generates a small sales dataset in SQLite, submits a mix of analytical queries (many of
them identical, some interactive at priority 10) through the queue store, runs them at
the queue's concurrency in priority order, and checks every result against a direct
execution of the same SQL.
"""

from __future__ import annotations

import hashlib
import random
import sqlite3
import tempfile
import time
from pathlib import Path

import orjson

from driver_sqlite.store import SqliteQueueStore
from engine.hashing import hash_query_key

PREFIX = "demo#sql"
QUERIES = [
    "SELECT region, count(*), round(sum(amount), 2) FROM sales GROUP BY region ORDER BY region",
    "SELECT product, round(avg(amount), 2) FROM sales GROUP BY product ORDER BY product",
    "SELECT day % 7 AS weekday, count(*) FROM sales GROUP BY weekday ORDER BY weekday",
    "SELECT region, product, max(amount) FROM sales GROUP BY region, product ORDER BY 1, 2",
    "SELECT count(DISTINCT customer) FROM sales WHERE amount > 50",
]


def _make_dataset(path: Path, rows: int) -> None:
    rng = random.Random(7)
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE sales (day INT, region TEXT, product TEXT, customer INT, amount REAL)"
    )
    conn.executemany(
        "INSERT INTO sales VALUES (?, ?, ?, ?, ?)",
        (
            (
                rng.randrange(365),
                rng.choice(["north", "south", "east", "west"]),
                rng.choice(["tea", "coffee", "cocoa", "juice", "water"]),
                rng.randrange(5_000),
                round(rng.uniform(1, 100), 2),
            )
            for _ in range(rows)
        ),
    )
    conn.commit()
    conn.close()


def run_demo(*, requests: int, concurrency: int, db: str | None, rows: int = 200_000) -> int:
    with tempfile.TemporaryDirectory(prefix="queryqueue-demo-") as tmp:
        data = Path(tmp) / "sales.db"
        _make_dataset(data, rows)
        store = SqliteQueueStore(db or Path(tmp) / "queue.db")
        warehouse = sqlite3.connect(data)
        rng = random.Random(1)
        started = time.perf_counter()
        submitted: dict[str, str] = {}
        added = 0
        for i in range(requests):
            sql = rng.choice(QUERIES)
            priority = 10 if i % 5 == 0 else 0
            key = hash_query_key([sql, []])
            response = store.add(
                f"{PREFIX}:{key}",
                orjson.dumps({"queryHandler": "sql", "query": sql, "priority": priority}).decode(),
                priority=priority,
            )
            added += response.added
            submitted[key] = sql
        executions = 0
        while pending := store.pending(PREFIX, limit=concurrency):
            for row in pending:
                got = store.retrieve(f"{PREFIX}:{row.id}", concurrency=concurrency)
                if got is None or got.payload is None:
                    continue
                query = orjson.loads(got.payload)["query"]
                rows_out = warehouse.execute(query).fetchall()
                executions += 1
                store.ack(row.queue_id, orjson.dumps({"result": rows_out}).decode())
        wrong = 0
        for key, sql in submitted.items():
            result = store.result(f"{PREFIX}:{key}")
            expected = [list(r) for r in warehouse.execute(sql).fetchall()]
            if (
                result is None
                or result.payload is None
                or orjson.loads(result.payload)["result"] != expected
            ):
                wrong += 1
        elapsed = time.perf_counter() - started
        warehouse.close()
        store.close()
    digest = hashlib.md5(str(sorted(submitted)).encode()).hexdigest()[:8]
    print(f"queries submitted   {requests}")
    print(f"distinct queries    {len(submitted)} (set {digest})")
    print(f"executions          {executions} (dedup saved {requests - executions})")
    print(f"wrong results       {wrong}")
    print(f"elapsed             {elapsed:.2f} s")
    return 0 if wrong == 0 and executions == added else 1
