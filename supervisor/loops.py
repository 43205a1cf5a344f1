"""The event loop the supervisor and its workers run on.

uvloop where it is installed (a dependency on Linux and macOS): the supervisor's and the
workers' time is mostly the loop's own (socket reads and writes, wake-ups, callbacks),
and uvloop's C loop does that for less. `asyncio` (or an interpreter without uvloop)
runs the standard loop; the behaviour is the same, only the cost differs.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")
LoopChoice = Literal["auto", "uvloop", "asyncio"]
CHOICES: tuple[LoopChoice, ...] = ("auto", "uvloop", "asyncio")


class LoopUnavailableError(RuntimeError):
    """`--loop uvloop` where uvloop cannot be imported."""


def loop_factory(choice: LoopChoice = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for `asyncio.Runner` (None: the standard loop)."""
    if choice not in CHOICES:
        raise ValueError(f"the event loop is one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise LoopUnavailableError(f"the uvloop event loop is not installed: {exc}") from None
        return None
    return uvloop.new_event_loop


# Young objects between two collections of the youngest generation (the interpreter's
# default is 700). Under load the supervisor allocated past 700 eleven times a second
# and more: its collections were ~2 % of its time, a few us a query; at this figure a
# collection comes every several seconds and lasts a few ms.
YOUNG_OBJECTS = 10_000


def settle_collector() -> None:
    """For a process of our own (the supervisor, a worker) once it has started: what it
    holds by now (modules, its app, ~100k objects) lives as long as it does, so the
    collector's full passes need not walk it again (`gc.freeze`), and the youngest
    generation is collected less often. Not for a process that embeds queryqueue: its
    collector is its own."""
    gc.freeze()
    gc.set_threshold(YOUNG_OBJECTS, *gc.get_threshold()[1:])


def collector_state() -> dict[str, Any]:
    """The cyclic collector as `stats` shows it: what `settle_collector` froze, how often
    the youngest generation is collected, collections so far by generation."""
    return {
        "frozen_objects": gc.get_freeze_count(),
        "young_objects": gc.get_threshold()[0],
        "collections": [generation["collections"] for generation in gc.get_stats()],
    }


class Polling:
    """The loop polls its sockets rather than sleep, until `until` (a callback always
    ready: the loop's iterations wait for nothing), which `extend` moves later and `stop`
    ends. Each pass yields the CPU to a process waiting for it, which would not preempt
    this one (the pool's workers are SCHED_BATCH). On a VM whose idle vCPU halts, a sleep
    costs a wake-up of tens of microseconds: a message due sooner is worth polling for."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop  # the running loop's, at the first `extend`
        self.until = 0.0
        self.on = False

    def extend(self, until: float) -> None:
        self.until = max(self.until, until)
        if not self.on:
            self.on = True
            if self._loop is None:
                # Kept: on 3.11 each get_running_loop() is a getpid() system call.
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._pass)

    def stop(self) -> None:
        self.until = 0.0

    def _pass(self) -> None:
        if time.monotonic() < self.until:
            os.sched_yield()
            assert self._loop is not None
            self._loop.call_soon(self._pass)
        else:
            self.on = False


def running_name() -> str:
    """The running loop, as `stats` shows it: "uvloop.Loop", "asyncio._UnixSelectorEventLoop"."""
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__.partition('.')[0]}.{type(loop).__name__}"


def run(main: Coroutine[Any, Any, T], choice: LoopChoice = "auto") -> T:
    """`asyncio.run`, on the chosen loop."""
    try:
        factory = loop_factory(choice)
    except BaseException:
        main.close()  # never awaited, and not to be warned about
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
