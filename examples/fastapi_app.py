"""An async endpoint: `await run_sql.run(...)` waits for the pool's result.

uvicorn fastapi_app:api     (with the supervisor of queries.py running)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from queries import app, run_sql

from queryqueue import QueryError, QueryTimeoutError


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    yield
    await app.aclose()  # this loop's connection to the supervisor


api = FastAPI(lifespan=lifespan)


@api.get("/squares/{n}")
async def squares(n: int) -> dict[str, Any]:
    sql = (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < ?) "
        "SELECT x, x * x FROM c"
    )
    try:
        # Identical requests in flight share one execution; priority 10 is the fast track.
        rows = await run_sql.run({"sql": sql, "params": [n]}, priority=10, timeout=30)
    except QueryTimeoutError:
        raise HTTPException(status_code=504, detail="the query took too long") from None
    except QueryError as exc:
        raise HTTPException(status_code=500, detail=str(exc)) from None
    return {"n": n, "rows": rows}
