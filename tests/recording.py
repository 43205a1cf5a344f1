"""Record what a test's code calls, without changing what the call does."""

from __future__ import annotations

from typing import Any

import pytest


def record_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[tuple[Any, ...]]:
    """The positional arguments of every call of `owner.name` from now on (a loop's
    `call_soon_threadsafe`: each is a wake-up of that loop); the call itself runs as
    before. `monkeypatch` puts the original back."""
    calls: list[tuple[Any, ...]] = []
    real = getattr(owner, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return calls


def record_returns(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[Any]:
    """What every call of `owner.name` from now on returned, once it has returned (a call
    still running is not in it yet); the call itself runs as before."""
    returned: list[Any] = []
    real = getattr(owner, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        value = real(*args, **kwargs)
        returned.append(value)
        return value

    monkeypatch.setattr(owner, name, recorded)
    return returned
