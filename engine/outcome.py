"""A query's outcome as the JSON text its ACK stores, and back again (a result's own
encoding is the codec's: `engine/codec.py`, `engine/binary.py`).

Cube's shapes, `{"result": value}` and `{"error": message}`, so Cube clients read ours; an
error also carries `errorType` (the handler's exception class) and `stack` (its traceback
text), so a caller in another process raises the family the handler raised and can see
where. A cancelled query's outcome is an error of type `QueryCancelledError`; an execution
lost with its worker is a "retry" outcome, which its waiters see as `ContinueWaitError`.
"""

from __future__ import annotations

import traceback
from typing import Any

import orjson

from queryqueue.engine.binary import decode_inline
from queryqueue.engine.codec import Codecs
from queryqueue.engine.errors import (
    ContinueWaitError,
    QueryCancelledError,
    QueryError,
    QueryTimeoutError,
    WorkerLostError,
)

CANCELLED_MESSAGE = "Query was cancelled"
# The families a caller raises by name; any other handler error is a QueryError naming it.
_FAMILIES: dict[str, type[QueryError]] = {
    "QueryCancelledError": QueryCancelledError,
    "QueryTimeoutError": QueryTimeoutError,
    "WorkerLostError": WorkerLostError,
}


def encode_error(exc: BaseException) -> str:
    stack = exc.remote_traceback if isinstance(exc, QueryError) else None
    return orjson.dumps(
        {
            "error": str(exc) or type(exc).__name__,
            "errorType": _type_name(exc),
            "stack": stack or "".join(traceback.format_exception(exc)),
        }
    ).decode()


def encode_cancelled() -> str:
    return orjson.dumps(
        {"error": CANCELLED_MESSAGE, "errorType": "QueryCancelledError", "cancelled": True}
    ).decode()


def encode_retry(message: str) -> str:
    """The outcome of an execution lost on the way (its worker died): waiters are woken
    with `ContinueWaitError` and, asking again, run it afresh together."""
    return orjson.dumps(
        {"error": message, "errorType": "ContinueWaitError", "retry": True}
    ).decode()


def parse_result(result: Any, codecs: Codecs) -> Any:
    """The value of a decoded outcome, its types given back (`codecs`); an error outcome
    raises its family."""
    if isinstance(result, dict):
        if result.get("retry") is True:
            raise ContinueWaitError(str(result.get("error") or "Continue wait"))
        if "error" in result:
            error_type = result.get("errorType")
            family = (
                _FAMILIES.get(error_type, QueryError) if isinstance(error_type, str) else QueryError
            )
            stack = result.get("stack")
            raise family(
                str(result["error"]),
                error_type=error_type if isinstance(error_type, str) else None,
                remote_traceback=stack if isinstance(stack, str) else None,
            )
        if "result" in result:
            return codecs.decode(result["result"], result.get("$types"))
        if "$binary" in result:
            return decode_inline(result)
    return None


def _type_name(exc: BaseException) -> str:
    if isinstance(exc, QueryError) and exc.error_type and type(exc) is QueryError:
        return exc.error_type
    return type(exc).__name__
