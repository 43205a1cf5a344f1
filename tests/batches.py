"""Running a batch's commands in a test as the supervisor does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from queryqueue import QueueError


def answers_or_errors(*commands: Callable[[], Any]) -> list[Any]:
    """Each command's answer, or the QueueError it raised: one failing command of a batch
    does not stop the others."""
    answers: list[Any] = []
    for command in commands:
        try:
            answers.append(command())
        except QueueError as exc:
            answers.append(exc)
    return answers
