"""The supervisor's settings in one place: what its command line sets, and the timings its
core was tuned with (imported by `queryqueue --help` without loading the server)."""

from __future__ import annotations

from dataclasses import dataclass

from queryqueue.driver_socket.protocol import DEFAULT_MAX_FRAME

# How long a stopping supervisor lets running queries finish before it ends their workers
# and gives their items back (pending again): under Docker's 10 s and Kubernetes' 30 s.
DEFAULT_STOP_GRACE = 5.0


@dataclass(frozen=True)
class Settings:
    """How the supervisor batches and paces its work. Its timings are here, none of them
    a command-line flag: each is kept for a gain `python -m benchmarks.ab` shows."""

    max_frame: int = DEFAULT_MAX_FRAME  # bytes of one request or answer frame
    max_batch: int = 512  # commands in one transaction
    # A batch on the event loop (SQLite's) holds the loop while it runs: a worker's ACK
    # that arrives meanwhile waits for all of it, and the worker's next query with it. A
    # burst of ADDs (thousands of callers at once) runs in batches this small, so a busy
    # queue's workers are not left waiting for it. A lane's batch (PostgreSQL's) holds no
    # loop and keeps `max_batch`: one commit and one round trip for more of it.
    loop_batch: int = 64
    purge_interval: float = 10.0  # seconds between purges of an idle queue's expired results
    # When the pool's queries usually come back within this long of their hand-off, the
    # loop polls for their ACKs rather than sleep (core/linger.py `ack_due`), and for
    # callers' next commands when those usually follow their answers as soon (`Gap`):
    # about what a sleep and a wake-up cost on a VM whose idle vCPU halts, so that a
    # longer wait is never polled for. 0: never polls.
    poll_s: float = 0.0003
    # A worker polls for its next query when that usually comes within this long of its
    # last ACK: the supervisor's answer, its caller's next command and its ADD lie between.
    worker_poll_s: float = 0.001

    def __post_init__(self) -> None:
        for name in (
            "purge_interval",
            "poll_s",
            "worker_poll_s",
        ):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be 0 (off) or more, not {value!r}")
        for name in ("max_batch", "loop_batch", "max_frame"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be 1 or more, not {value!r}")
