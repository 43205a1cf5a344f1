"""A handler takes `(query)` or `(query, set_cancel_handler)`, sync or async: any other
shape is refused where it is registered, by the app and by mypy, not at its first query."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from queryqueue import MemoryQueueStore, QueryQueue, QueueApp
from tests.mypy_util import mypy_errors


def test_a_handler_of_another_shape_is_refused_where_it_is_registered() -> None:
    app = QueueApp("shapes")
    with pytest.raises(TypeError, match=r"handler 'bad': .*bad\(a: .* must take \(query\) or"):

        @app.handler("bad")  # type: ignore[arg-type]  # the shape mypy refuses too
        def bad(a: Any, b: Any, c: Any) -> None: ...

    with pytest.raises(TypeError, match="handler 'none'"):
        app.handler("none")(lambda: None)  # type: ignore[arg-type, misc]
    assert "bad" not in app.query_handlers and "none" not in app.query_handlers


async def test_a_handler_may_leave_out_set_cancel_handler() -> None:
    def sync_one(query: Any) -> Any:
        return {"sync": query}

    async def async_one(query: Any) -> Any:
        return {"async": query}

    def both(query: Any, set_cancel_handler: Any) -> Any:
        set_cancel_handler({"kill": query})
        return {"both": query}

    queue = QueryQueue(
        "shapes",
        query_handlers={"sync": sync_one, "async": async_one, "both": both},
        driver=MemoryQueueStore(),
    )
    try:
        assert await queue.run("sync", "a", 1) == {"sync": 1}
        assert await queue.run("async", "b", 2) == {"async": 2}
        assert await queue.run("both", "c", 3) == {"both": 3}
    finally:
        await queue.close(grace=0)


def test_mypy_rejects_a_mistyped_option_handler_query_or_result(tmp_path: Path) -> None:
    source = tmp_path / "handlers.py"
    source.write_text(
        textwrap.dedent(
            """
            from typing import Any

            from queryqueue import QueueApp, SetCancelHandler

            app = QueueApp("typed", concurrency=4, execution_timeout=30.0)
            typo = QueueApp("typo", concurency=4)


            @app.handler("one")
            def one(query: dict[str, Any]) -> int:
                return 1


            @app.handler("two", max_age=60)
            async def two(query: str, set_cancel_handler: SetCancelHandler) -> str:
                return "two"


            async def ask() -> None:
                counted: int = await one.run({"a": 1}, priority=5)
                named: str = await two.run("q", max_age=1.5)
                blocking: int = one.run_sync({"a": 1})
                here: int = one({"a": 1})
                wrong: str = await one.run({"a": 1})
                await two.run(3)


            @app.handler("bad")
            def bad(query: Any, scale: int, unit: str) -> int:
                return 3
            """
        )
    )
    _, errors = mypy_errors([source], tmp_path)
    lines = source.read_text().splitlines()

    def line_of(text: str) -> str:
        return f"handlers.py:{lines.index(text) + 1}"

    assert [e.split(": error:")[0] for e in errors] == [
        line_of('typo = QueueApp("typo", concurency=4)'),
        line_of('    wrong: str = await one.run({"a": 1})'),
        line_of("    await two.run(3)"),
        line_of('@app.handler("bad")'),
    ], errors
    assert '"concurency"' in errors[0]
    assert 'expression has type "int", variable has type "str"' in errors[1]
    assert 'Argument 1 to "run" of "QueryHandle" has incompatible type "int"' in errors[2]
    assert '"Registration"' in errors[3]
