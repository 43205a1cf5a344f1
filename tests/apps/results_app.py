"""A QueueApp whose handlers return what users' queries return: typed values, Arrow
tables, bytes, DataFrames and numpy arrays; each run leaves a line in $POOL_TRACE."""

from __future__ import annotations

import datetime as dt
import os
import time
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from queryqueue import QueueApp

app = QueueApp("results", concurrency=2, continue_wait_timeout=1.0, heartbeat_interval=0.25)


@dataclass(frozen=True)
class Money:
    amount: Decimal
    currency: str


class Opaque:
    """A type no codec knows."""


app.codec(Money)


def _trace(name: str) -> None:
    with open(os.environ["POOL_TRACE"], "a") as out:
        out.write(f"start {name} {os.getpid()} {time.monotonic()}\n")


def typed_rows() -> dict[str, Any]:
    tz = dt.timezone(dt.timedelta(hours=5, minutes=30))
    return {
        "rows": [
            {
                "id": i,
                "price": Decimal("12.50") if i % 2 else None,
                "day": dt.date(2026, 12, 1 + i),
                "at": dt.datetime(2026, 12, 1, 9, 30, i, 123456, tzinfo=tz),
                "uuid": uuid.UUID(int=i + 1),
            }
            for i in range(4)
        ],
        "matrix": np.arange(12, dtype="float32").reshape(3, 4),
        "total": Money(Decimal("50.00"), "EUR"),
    }


def arrow_table(rows: int) -> pa.Table:
    ids = np.arange(rows, dtype="int64")
    return pa.table({"id": ids, "value": ids * 0.5, "name": [f"row {i}" for i in range(rows)]})


@app.handler("typed")
def typed(query: Any, set_cancel_handler: Any) -> Any:
    _trace("typed")
    return typed_rows()


def many_rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "price": Decimal(i) / 100, "text": "x" * 100} for i in range(n)]


@app.handler("many")
def many(query: Any, set_cancel_handler: Any) -> Any:
    return many_rows(query["n"])  # megabytes of JSON: through shared memory


@app.handler("opaque")
def opaque(query: Any, set_cancel_handler: Any) -> Any:
    return {"fine": 1, "rows": [{"bad": Opaque()}]}


@app.handler("arrow")
def arrow(query: Any, set_cancel_handler: Any) -> pa.Table:
    _trace(f"arrow-{query['key']}")
    gate = query.get("gate")  # a file the test creates when its readers are in place
    deadline = time.monotonic() + 60
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    return arrow_table(query["rows"])


@app.handler("bytes")
def raw(query: Any, set_cancel_handler: Any) -> bytes:
    return bytes(range(256)) * (int(query["size"]) // 256)


@app.handler("array")
def array(query: Any, set_cancel_handler: Any) -> Any:
    return np.arange(query["n"], dtype="int32").reshape(-1, 4)


def frame(rows: int) -> pd.DataFrame:
    return pd.DataFrame(
        {"id": np.arange(rows), "price": [Decimal(i) / 100 for i in range(rows)]},
        index=pd.Index([f"r{i}" for i in range(rows)], name="row"),
    )


@app.handler("frame")
def dataframe(query: Any, set_cancel_handler: Any) -> pd.DataFrame:
    return frame(query["rows"])


@app.handler("object_array")
def object_array(query: Any, set_cancel_handler: Any) -> Any:
    return {"cells": np.array([Opaque()], dtype=object)}
