"""The demo's workload: a generated sales warehouse, the queries asked of it, and who
asks which (popular reports by many processes at once, lookups at priority 10, one stream,
one query cancelled and one that runs into the execution timeout)."""

from __future__ import annotations

import hashlib
import random
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

REGIONS = [f"region-{i}" for i in range(8)]
PRODUCTS = [f"product-{i:02d}" for i in range(50)]

# Background reports (priority 0): full scans, a few hundred ms each on a million rows.
BACKGROUND = [
    "SELECT region, count(*), round(sum(amount), 2) FROM sales GROUP BY region ORDER BY region",
    "SELECT region, product, max(amount) FROM sales GROUP BY region, product ORDER BY 1, 2",
    "SELECT count(DISTINCT customer) FROM sales WHERE amount > 500",
    *(
        f"SELECT product, round(avg(amount), 2), sum(quantity) FROM sales "
        f"WHERE region = '{r}' GROUP BY product ORDER BY product"
        for r in REGIONS[:4]
    ),
    *(
        f"SELECT day / 30 AS month, round(sum(amount * quantity), 2) FROM sales "
        f"WHERE product = '{p}' GROUP BY month ORDER BY month"
        for p in PRODUCTS[:4]
    ),
    *(
        f"SELECT quantity, count(*) FROM sales WHERE day BETWEEN {d} AND {d + 29} "
        f"GROUP BY quantity ORDER BY quantity"
        for d in (0, 90, 180)
    ),
]
# Interactive lookups (priority 10): one customer, through an index.
INTERACTIVE = [
    f"SELECT customer, count(*), round(sum(amount), 2), max(day) FROM sales "
    f"WHERE customer = {c} GROUP BY customer"
    for c in range(0, 100_000, 2_500)
]
STREAM_SQL = "SELECT id, region, product, amount FROM sales WHERE customer < 40 ORDER BY id"
# Never ends by itself: one is cancelled, the other runs into the execution timeout.
ENDLESS = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
    "SELECT count(*) FROM (SELECT x FROM c LIMIT 100000000000) /* {tag} */"
)
CANCEL_SQL = ENDLESS.format(tag="cancelled by the demo")
TIMEOUT_SQL = ENDLESS.format(tag="runs into the execution timeout")


@dataclass(frozen=True)
class Request:
    index: int
    kind: str  # sql | stream | cancel | timeout
    sql: str
    priority: int


@dataclass
class Outcome:
    index: int
    kind: str
    sql: str
    priority: int
    seconds: float
    status: str  # ok | cancelled | timed out | error
    digest: str | None = None
    detail: str = ""
    fast_tracked: bool = False
    rows: int = 0


def make_warehouse(path: Path, rows: int) -> None:
    """`rows` pseudo-random sales, generated inside SQLite (seconds for millions)."""
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        PRAGMA journal_mode = OFF;
        PRAGMA synchronous = OFF;
        CREATE TABLE sales (
            id INTEGER PRIMARY KEY, day INT, region TEXT, product TEXT,
            customer INT, quantity INT, amount REAL
        );
        """
    )
    conn.execute(
        """
        INSERT INTO sales (day, region, product, customer, quantity, amount)
        WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < ?)
        SELECT (i * 7919) % 365,
               'region-' || ((i * 31) % 8),
               'product-' || substr('0' || ((i * 131) % 50), -2),
               (i * 2654435761) % 100000,
               1 + (i * 17) % 9,
               ((i * 48271) % 100000) / 100.0
        FROM seq
        """,
        (rows,),
    )
    conn.execute("CREATE INDEX sales_customer ON sales (customer)")
    conn.commit()
    conn.close()


def plan(requests: int, clients: int, seed: int = 7) -> list[list[Request]]:
    """Each client's requests. Popular reports are asked far more often than others, so
    identical queries are in flight in several processes at once."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(BACKGROUND))]
    specials = [
        Request(0, "cancel", CANCEL_SQL, 10),
        Request(1, "timeout", TIMEOUT_SQL, 10),
        Request(2, "stream", STREAM_SQL, 0),
    ]
    made: list[Request] = []
    for index in range(len(specials), max(requests, len(specials))):
        if rng.random() < 0.2:
            made.append(Request(index, "sql", rng.choice(INTERACTIVE), 10))
        else:
            made.append(Request(index, "sql", rng.choices(BACKGROUND, weights)[0], 0))
    shares: list[list[Request]] = [[] for _ in range(clients)]
    for n, special in enumerate(specials):
        shares[n % clients].append(special)
    for n, request in enumerate(made):
        shares[n % clients].append(request)
    return shares


INTERACTIVE_PER_CLIENT = 8  # the interactive phase: one user per process, one at a time
THINK_TIME = 0.05  # seconds between one user's lookups


def interactive_plan(clients: int, per_client: int = INTERACTIVE_PER_CLIENT) -> list[list[Request]]:
    """The interactive phase, once the background load has drained: each process asks
    lookups of its own one at a time, alternately at priority 10 and 0, so the fast track
    (room in the budget) is seen beside the queued path on the same queue."""
    return [
        [
            Request(
                100_000 + client * per_client + n,
                "interactive",
                INTERACTIVE[(client * per_client + n) % len(INTERACTIVE)],
                10 if n % 2 == 0 else 0,
            )
            for n in range(per_client)
        ]
        for client in range(clients)
    ]


def digest(rows: Any) -> str:
    return hashlib.sha1(orjson.dumps(rows)).hexdigest()
