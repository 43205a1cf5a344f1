"""What the store conformance suite writes its commands with."""

from __future__ import annotations

import orjson

from queryqueue.engine.responses import ListResponse

P = "q"


def path(key: str, prefix: str = P) -> str:
    return f"{prefix}:{key}"


def payload(**fields: object) -> str:
    return orjson.dumps(fields).decode()


def keys(rows: list[ListResponse]) -> list[str]:
    return [row.id for row in rows]
