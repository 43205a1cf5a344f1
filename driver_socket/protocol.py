"""The supervisor's wire protocol: length-prefixed orjson frames.

A frame is a 4-byte big-endian unsigned length followed by that many bytes of UTF-8 JSON.

Request:  {"id": 7, "cmd": "add", "args": ["p:k", "{}"], "kwargs": {"priority": 10}}
          {"id": 8, "sql": "QUEUE LIST 'p'"}
Reply:    {"id": 7, "ok": {"id": 1, "added": true, "pending": 1}}
          {"id": 8, "rows": [{"id": "k", "queue_id": "1", "status": "pending", "extra": null}]}
          {"id": 9, "error": {"type": "InvalidCommandError", "message": "priority should be ..."}}

Requests may be pipelined and are answered in any order (match replies by `id`). An ADD
may carry the long poll that follows it, answered under its own id once the result is in:
          {"id": 10, "cmd": "add", "args": ["p:k", "{}"], "kwargs": {"then_wait": [11, 5000]}}
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

import orjson

from queryqueue.engine import errors
from queryqueue.engine.commands import Command, served
from queryqueue.engine.responses import (
    ResultResponse,
    ResultStatus,
)
from queryqueue.engine.retrieved import RetrievedQuery

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 256 * 1024 * 1024


class FrameError(errors.InvalidCommandError):
    """The byte stream is not a sequence of frames: the connection cannot be resynchronized."""


def over_limit(size: int, max_size: int) -> FrameError:
    return FrameError(f"frame of {size} bytes is over the limit of {max_size} bytes")


def cut_short(leftover: bytes | bytearray) -> FrameError:
    """The stream ended inside a frame: `leftover` is what came of it, header first."""
    if len(leftover) < HEADER.size:
        return FrameError(f"truncated frame header ({len(leftover)} of {HEADER.size} bytes)")
    (size,) = HEADER.unpack_from(leftover)
    return FrameError(f"truncated frame: {len(leftover) - HEADER.size} of {size} bytes")


async def read_frame(reader: asyncio.StreamReader, max_size: int) -> bytes | None:
    """One frame's body, or None at a clean end of stream (a client reading with
    StreamReader; the supervisor and the driver cut frames with frames.FrameReader)."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise cut_short(exc.partial) from None
    (size,) = HEADER.unpack(header)
    if size > max_size:
        raise over_limit(size, max_size)
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise cut_short(header + exc.partial) from None


def encode_frame(message: Any) -> bytes:
    body = orjson.dumps(message, default=_default)
    return HEADER.pack(len(body)) + body


def encode_body(value: Any) -> bytes:
    """`value` as JSON, as `encode_frame` encodes it inside a message."""
    return orjson.dumps(value, default=_default)


def answer_frame(request_id: Any, encoded: bytes) -> bytes:
    """The frame of `{"id": request_id, "ok": ...}` around an answer already encoded (one
    encoding for many requests answered alike)."""
    body = b"".join((b'{"id":', orjson.dumps(request_id), b',"ok":', encoded, b"}"))
    return HEADER.pack(len(body)) + body


def _default(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"cannot encode {type(value).__name__}")


def encode_retrieved(retrieved: RetrievedQuery) -> bytes:
    """A hand-off to a worker, as JSON: plain data both ways, so nothing a worker is sent
    can make it run code of the sender's choosing (no pickle)."""
    return orjson.dumps(
        [
            retrieved.query_key_hash,
            retrieved.queue_id,
            retrieved.processing_id,
            retrieved.queue_size,
            retrieved.query,
            retrieved.started_ms,
        ]
    )


def decode_retrieved(blob: bytes) -> RetrievedQuery:
    query_key_hash, queue_id, processing_id, queue_size, query, started_ms = orjson.loads(blob)
    return RetrievedQuery(query_key_hash, queue_id, processing_id, queue_size, query, started_ms)


def error_payload(exc: BaseException) -> dict[str, Any]:
    """An error as the wire carries it: its class, and the public families it belongs to
    (nearest first), so a client raises the same family even for a class it lacks."""
    family = [
        cls.__name__
        for cls in type(exc).__mro__
        if getattr(errors, cls.__name__, None) is cls and issubclass(cls, errors.QueueError)
    ]
    return {"type": type(exc).__name__, "message": str(exc), "family": family}


# -- replies back into response types ------------------------------------------------------


def _one(cls: type[Any]) -> Any:
    return lambda data: None if data is None else cls(**data)


def _many(cls: type[Any]) -> Any:
    return lambda data: [cls(**row) for row in data]


def _result(data: Any) -> ResultResponse | None:
    if data is None:
        return None
    return ResultResponse(
        payload=data["payload"],
        type=ResultStatus(data["type"]),
        id=data["id"],
        external_id=data["external_id"],
    )


def _decoder(command: Command) -> Any:
    if command.response is ResultResponse:
        return _result
    if command.response is None:
        return lambda data: data
    return _many(command.response) if command.many else _one(command.response)


# Each command's answer back into its response type, as the store declares it.
DECODERS: dict[str, Any] = {name: _decoder(c) for name, c in served().items()}


def raise_error(payload: dict[str, Any]) -> None:
    """Re-raise an error reply as the same exception family on this side."""
    kind = payload.get("type", "")
    message = payload.get("message", "")
    family = payload.get("family")
    names = [kind, *(family if isinstance(family, list) else [])]
    for name in names:
        cls = getattr(errors, name, None) if isinstance(name, str) else None
        if (
            isinstance(cls, type)
            and issubclass(cls, errors.QueueError)
            and cls is not errors.QueueError
        ):
            raise cls(message if name == kind else f"{kind}: {message}")
    raise errors.CommandRejectedError(f"{kind}: {message}")
