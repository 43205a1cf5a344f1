"""The QUEUE commands, declared once.

Each command of `QueueStore` carries its declaration (`@queue_command(...)`), and every
layer reads this table instead of keeping a list of its own:

* the store runs each command through `QueueStore._run_command`, the one hook a store
  may override (PostgreSQL re-runs a command whose connection broke before COMMIT);
* the supervisor serves the `served` ones, gives those that `take_process_id` the
  connection's process id, and wakes its pool after one that `frees_slot` or `adds`;
* the client decodes each answer into its `response` type and re-sends after a lost
  answer only what `resend` allows.

Adding a command is writing its method in the store with its declaration.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# After a lost answer, is sending the command again safe? "always": it has the same
# effect twice; "by_id": when it names its item by queue id (or, for RESULT, reads by
# external id or with a consumer token); "never": it might act twice.
Resend = Literal["always", "by_id", "never"]


@dataclass(frozen=True)
class Command:
    name: str
    response: type | None = None  # what the answer decodes into (None: a plain value)
    many: bool = False  # a list of `response`
    take_process_id: bool = False  # the caller's process id decides what it sees
    resend: Resend = "never"
    adds: bool = False  # it may queue an item: a pool with room may retrieve
    frees_slot: bool = False  # it may end an item: a pool may retrieve
    served: bool = True  # a supervisor serves it to clients


COMMANDS: dict[str, Command] = {}


def queue_command(**declaration: Any) -> Callable[[F], F]:
    """Declare a store method a command, and run it through the store's `_run_command`."""

    def declare(method: F) -> F:
        COMMANDS[method.__name__] = Command(method.__name__, **declaration)
        if inspect.iscoroutinefunction(method):
            return method  # RESULT_BLOCKING: it waits, and each of its steps is atomic

        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._run_command(lambda: method(self, *args, **kwargs))

        return run  # type: ignore[return-value]

    return declare


def table() -> dict[str, Command]:
    """Every command, by method name (declared where the store defines them)."""
    from queryqueue.engine import store  # noqa: F401 - its methods carry the declarations

    return COMMANDS


def served() -> dict[str, Command]:
    """The commands a supervisor serves to its clients."""
    return {name: c for name, c in table().items() if c.served}
