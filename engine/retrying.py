"""A handler's own bounds: its execution timeout, and running it again after a transient
failure (`HandlerPolicy`).

A warehouse that drops a connection or answers "try again" fails a query no caller should
see fail. A handler registered with `retries=N` runs again, up to N more times, when it
raises one of its `retry_on` exceptions: after `backoff` seconds, doubled each time and
spread by jitter (half to one and a half of it), so that a source that failed many
queries at once is not asked again by all of them at the same moment. All its attempts
share the query's execution timeout: a retry starts only with time left, and runs with
what is left. A cancelled or timed-out query is never run again. A handler's own
`execution_timeout` shortens the queue's for its queries (never lengthens it: the
supervisor holds its workers to the queue's).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from queryqueue.engine.clock import Clock
from queryqueue.engine.errors import QueryCancelledError, QueryTimeoutError
from queryqueue.engine.events import RETRYING_QUERY, Events

MAX_DELAY_S = 30.0  # the longest wait between two attempts, however many came before
T = TypeVar("T")


@dataclass(frozen=True)
class HandlerPolicy:
    """How a handler's failures are retried: `retries` more attempts at most, for the
    exceptions of `retry_on`, `backoff` seconds before the first retry (doubled after);
    how long its queries may run, attempts included (None: the queue's timeout); and how
    old a stored result may be that answers its calls instead of a run (`max_age`
    seconds; None: only one nobody has read yet)."""

    retries: int = 0
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    backoff: float = 0.5
    execution_timeout: float | None = None
    max_age: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be a whole number, 0 or more, not {self.retries!r}")
        if not self.backoff >= 0:
            raise ValueError(f"backoff must be 0 or more seconds, not {self.backoff!r}")
        for kind in self.retry_on:
            if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                raise TypeError(f"retry_on takes exception classes, not {kind!r}")
        if self.execution_timeout is not None and not self.execution_timeout > 0:
            raise ValueError(
                f"execution_timeout must be positive seconds, not {self.execution_timeout!r}"
            )
        if self.max_age is not None and not self.max_age > 0:
            raise ValueError(f"max_age must be positive seconds, not {self.max_age!r}")

    def applies(self) -> bool:
        """Whether it differs from the default (a handler without one has none kept)."""
        return self != DEFAULT_POLICY

    def budget(self, queue_timeout: float, query_def: Mapping[str, Any] | None = None) -> float:
        """Seconds a query has, all attempts: the handler's own timeout within the queue's,
        and the call's (its definition's `executionTimeout`, where it is positive seconds)
        within that."""
        own = self.execution_timeout
        seconds = queue_timeout if own is None else min(own, queue_timeout)
        call = (query_def or {}).get("executionTimeout")
        if isinstance(call, int | float) and not isinstance(call, bool) and call > 0:
            seconds = min(seconds, float(call))
        return seconds

    def retries_after(self, error: BaseException, attempt: int) -> bool:
        """Whether attempt `attempt` (1 for the first) failing with `error` is run again."""
        if isinstance(error, QueryCancelledError | QueryTimeoutError):
            return False
        return attempt <= self.retries and isinstance(error, self.retry_on)

    def delay(self, attempt: int, jitter: Callable[[], float] = random.random) -> float:
        """Seconds to wait after failed attempt `attempt` before the next."""
        return float(min(self.backoff * 2 ** (attempt - 1) * (0.5 + jitter()), MAX_DELAY_S))


DEFAULT_POLICY = HandlerPolicy()


def reporting(
    events: Events, context: dict[str, Any], record: Callable[[dict[str, Any]], None]
) -> Callable[[int, BaseException, float], None]:
    """What tells of a retry of the execution whose event fields are `context`: `events`,
    and its item (`record` merges the next attempt's number into its extra, where
    `queryqueue status` and the supervisor's metrics see it)."""

    def retrying(attempt: int, error: BaseException, delay: float) -> None:
        fields = {"attempt": attempt, "error": repr(error), "retryIn": round(delay, 3)}
        events.emit(RETRYING_QUERY, {**context, **fields})
        record({"attempt": attempt + 1})

    return retrying


async def attempts(
    run: Callable[[float], Awaitable[T]],
    policy: HandlerPolicy,
    budget: float,
    clock: Clock,
    retrying: Callable[[int, BaseException, float], None],
) -> T:
    """`run(seconds left)` until it succeeds, or fails past the policy or the `budget` of
    seconds all attempts share; `retrying(attempt, error, delay)` is told of each retry."""
    started, attempt = clock.now_ms(), 1
    while True:
        try:
            return await run(budget - (clock.now_ms() - started) / 1000)
        except Exception as exc:
            if not policy.retries_after(exc, attempt):
                raise
            delay = policy.delay(attempt)
            if (clock.now_ms() - started) / 1000 + delay >= budget:
                raise
            retrying(attempt, exc, delay)
            await clock.sleep(delay)
            attempt += 1
