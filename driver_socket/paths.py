"""Where the supervisor's socket is: one lookup for the CLI and the client driver."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SOCKET_ENV = "QUERYQUEUE_SOCKET"


def default_socket_path(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """`$QUERYQUEUE_SOCKET`, else `$XDG_RUNTIME_DIR/queryqueue/supervisor.sock`, else
    `/tmp/queryqueue-<uid>/supervisor.sock`."""
    env = os.environ if env is None else env
    if env.get(SOCKET_ENV):
        return Path(env[SOCKET_ENV])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "queryqueue" / "supervisor.sock"
    return Path("/tmp") / f"queryqueue-{os.getuid() if uid is None else uid}" / "supervisor.sock"


def socket_source(env: Mapping[str, str] | None = None) -> str:
    """Where `default_socket_path` found its answer, for an error that names the path."""
    env = os.environ if env is None else env
    if env.get(SOCKET_ENV):
        return f"${SOCKET_ENV}"
    if env.get("XDG_RUNTIME_DIR"):
        return "the default under $XDG_RUNTIME_DIR"
    return f"the default (no ${SOCKET_ENV} set)"
