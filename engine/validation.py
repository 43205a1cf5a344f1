"""Argument checks shared by every store. Each raises InvalidCommandError naming the argument."""

from __future__ import annotations

import math
from typing import Any

import orjson

from queryqueue.engine.errors import InvalidCommandError
from queryqueue.engine.responses import QueueKey

MIN_PRIORITY = -10_000
MAX_PRIORITY = 10_000
MAX_PATH_LENGTH = 512
MAX_PREFIX_LENGTH = 255
MAX_EXTERNAL_ID_LENGTH = 48  # Cube Store's limit
MAX_PROCESS_ID_LENGTH = 96  # Cube Store's limit
# Numbers every store can hold (a 64-bit integer, also after adding a clock reading).
MAX_QUEUE_ID = 2**63 - 1
MAX_MS = 100 * 365 * 24 * 3600 * 1000  # a hundred years
MAX_CONCURRENCY = 1_000_000


def _no_nul(name: str, text: str) -> str:
    # PostgreSQL's text cannot hold NUL; refused everywhere, so every store agrees.
    if "\x00" in text:
        raise InvalidCommandError(f"{name} must not contain a NUL character")
    return text


def check_priority(priority: Any) -> int:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidCommandError(f"priority must be an integer, got {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidCommandError(
            f"priority should be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority}"
        )
    return priority


def check_prefix(prefix: Any) -> str:
    if not isinstance(prefix, str):
        raise InvalidCommandError(f"prefix must be a string, got {type(prefix).__name__}")
    if len(prefix) > MAX_PREFIX_LENGTH:
        raise InvalidCommandError(
            f"prefix is {len(prefix)} characters, the limit is {MAX_PREFIX_LENGTH}"
        )
    return _no_nul("prefix", prefix)


def split_path(path: Any) -> tuple[str, str]:
    """`prefix:key`, split at the last colon as Cube Store does."""
    if not isinstance(path, str):
        raise InvalidCommandError(f"path must be a string, got {type(path).__name__}")
    if not path:
        raise InvalidCommandError("path is empty")
    if len(path) > MAX_PATH_LENGTH:
        raise InvalidCommandError(f"path is {len(path)} characters, the limit is {MAX_PATH_LENGTH}")
    prefix, sep, key = path.rpartition(":")
    if not sep:
        raise InvalidCommandError(f"path {path!r} has no ':' between prefix and key")
    if not key:
        raise InvalidCommandError(f"path {path!r} has an empty key after the last ':'")
    check_prefix(prefix)
    _no_nul("path", key)
    return prefix, key


def check_key(key: Any) -> QueueKey:
    """A queue key is a path string or a positive integer queue id."""
    if isinstance(key, bool):
        raise InvalidCommandError("queue key must be a path or an integer id, got bool")
    if isinstance(key, int):
        if not 1 <= key <= MAX_QUEUE_ID:
            raise InvalidCommandError(f"queue id must be between 1 and {MAX_QUEUE_ID}, got {key}")
        return key
    split_path(key)
    return key  # type: ignore[no-any-return]


def check_json(name: str, text: Any, *, nullable: bool = False) -> str | None:
    if text is None:
        if nullable:
            return None
        raise InvalidCommandError(f"{name} is missing")
    if not isinstance(text, str):
        raise InvalidCommandError(f"{name} must be JSON text, got {type(text).__name__}")
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidCommandError(f"{name} is not valid JSON: {exc}") from None
    return text


def check_external_id(external_id: Any) -> str | None:
    if external_id is None:
        return None
    if not isinstance(external_id, str):
        raise InvalidCommandError(f"external id must be a string, got {type(external_id).__name__}")
    if not external_id:
        raise InvalidCommandError("external id is empty")
    if len(external_id) > MAX_EXTERNAL_ID_LENGTH:
        raise InvalidCommandError(
            f"external id is {len(external_id)} characters, the limit is {MAX_EXTERNAL_ID_LENGTH}"
        )
    return _no_nul("external id", external_id)


def check_process_id(process_id: Any) -> str | None:
    if process_id is None:
        return None
    if not isinstance(process_id, str) or not process_id:
        raise InvalidCommandError("process id must be a non-empty string")
    if len(process_id) > MAX_PROCESS_ID_LENGTH:
        raise InvalidCommandError(
            f"process id is {len(process_id)} characters, the limit is {MAX_PROCESS_ID_LENGTH}"
        )
    return _no_nul("process id", process_id)


def check_non_negative_ms(name: str, value: Any, *, nullable: bool = False) -> int | None:
    if value is None:
        if nullable:
            return None
        raise InvalidCommandError(f"{name} is missing")
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidCommandError(f"{name} must be an integer number of milliseconds")
    if not 0 <= value <= MAX_MS:
        raise InvalidCommandError(f"{name} must be between 0 and {MAX_MS} ms, got {value}")
    return value


def check_orphaned_seconds(value: Any) -> int | None:
    """ORPHANED is given in seconds (fractions allowed); returns milliseconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidCommandError("orphaned timeout must be a number of seconds")
    if not math.isfinite(value) or not 0 <= value <= MAX_MS / 1000:
        raise InvalidCommandError(
            f"orphaned timeout must be between 0 and {MAX_MS // 1000} seconds, got {value}"
        )
    return round(value * 1000)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidCommandError(f"{name} must be true or false")
    return value


def check_count(name: str, value: Any) -> int:
    """A count of items: an integer, 0 or more."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidCommandError(f"{name} must be an integer, 0 or more, got {value!r}")
    return value


def check_concurrency(concurrency: Any) -> int:
    if not isinstance(concurrency, int) or isinstance(concurrency, bool):
        raise InvalidCommandError("concurrency must be an integer")
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise InvalidCommandError(
            f"concurrency must be between 1 and {MAX_CONCURRENCY}, got {concurrency}"
        )
    return concurrency


def check_queue_options(*, concurrency: Any, **timeouts: float) -> None:
    """QueryQueue's settings: positive timeouts, a positive integer concurrency."""
    for name, value in timeouts.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
