"""Results as a Cube client reads them: JSON text, whatever the worker wrote.

The SQL-text interface (Cube's own clients) answers RESULT with the outcome's JSON text.
A result in shared memory, or a binary one (bytes, Arrow) stored inline, is something a
Cube client cannot follow, so it is materialised here: JSON as it is, bytes as base64, an
Arrow table or a DataFrame as its rows, an array as nested lists, all through the result
codec (dates as ISO text, decimals as strings). A result whose JSON would pass `limit`
bytes is refused with an error naming the limit, never cut.
"""

from __future__ import annotations

import orjson

from queryqueue.engine.binary import INLINE_MARK, parse_inline, read_arrow, read_binary
from queryqueue.engine.codec import Codecs
from queryqueue.engine.errors import ResultTooLargeError
from queryqueue.engine.result_rules import SHARED_REFERENCE_MARK

DEFAULT_SQL_RESULT_LIMIT = 64 * 1024 * 1024


def needs_materialising(payload: str | None) -> bool:
    return payload is not None and (
        payload.startswith(SHARED_REFERENCE_MARK) or payload.startswith(INLINE_MARK)
    )


def too_large(size: int, limit: int) -> ResultTooLargeError:
    return ResultTooLargeError(
        f"this result is {size} bytes, over the SQL-text interface's limit of {limit} bytes "
        "(--sql-result-limit): read it with a Python client, which takes it through "
        "shared memory"
    )


def as_json(form: str, data: bytes, limit: int) -> str:
    """The outcome text of a result of `form` ("json", or a binary form) held in `data`."""
    if len(data) > limit:
        raise too_large(len(data), limit)
    if form == "json":
        return str(data, "utf-8")
    if form in ("arrow", "pandas"):
        value = read_arrow(memoryview(data)).to_pylist()
    else:
        value = read_binary(form, memoryview(data))
    text = Codecs().encode_result(value)
    if len(text) > limit:
        raise too_large(len(text), limit)
    return text


def inline_as_json(payload: str, limit: int) -> str:
    """`{"$binary": form, "data": base64}` as a Cube client reads it."""
    return as_json(*parse_inline(orjson.loads(payload)), limit)
