"""Logging of the supervisor and its workers: one stream (the supervisor's stderr), as text
or as one JSON object per line with the event's fields.

The level and format are set once, by the CLI, and handed to the workers through their
environment (`QUERYQUEUE_LOG_LEVEL`, `QUERYQUEUE_LOG_FORMAT`): a worker inherits the
supervisor's stderr, so its records land in the same stream, each with its pid.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]
LEVELS = ("debug", "info", "warning", "error")
LEVEL_ENV = "QUERYQUEUE_LOG_LEVEL"
FORMAT_ENV = "QUERYQUEUE_LOG_FORMAT"

# What every LogRecord has: anything else on a record came through `extra`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON: time, level, logger, pid, message, and for a queue
    event its name (`event`) and fields (Cube's names: queueId, queryKey, ...)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
        }
        event = getattr(record, "queue_event", None)
        if event is not None:
            line["event"] = event
            line.update(getattr(record, "queue_fields", None) or {})
        else:
            line["message"] = record.getMessage()
        for name, value in vars(record).items():
            if name not in _STANDARD and name not in ("queue_event", "queue_fields"):
                line.setdefault(name, value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=repr).decode()


def configure(level: str | None = None, fmt: str | None = None, *, role: str = "") -> None:
    """Send `queryqueue.*` records at `level` and above to stderr in `fmt`. Without
    arguments, the environment's settings (a worker's, from its supervisor)."""
    level = (level or os.environ.get(LEVEL_ENV) or "warning").lower()
    fmt = (fmt or os.environ.get(FORMAT_ENV) or "text").lower()
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    os.environ[LEVEL_ENV], os.environ[FORMAT_ENV] = level, fmt  # for the workers spawned
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        who = f"{role} %(process)d" if role else "%(process)d"
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {who} %(levelname)s %(name)s: %(message)s")
        )
    root = logging.getLogger("queryqueue")
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
