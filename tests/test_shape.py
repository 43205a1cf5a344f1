"""The engine stays small enough to hold in one's head: modules of at most 500 lines,
functions of at most 60 (issue: "a shape a maintainer can read")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[1] / "engine"
MODULES = sorted(ENGINE.glob("*.py"))


@pytest.mark.parametrize("module", MODULES, ids=lambda p: p.name)
def test_engine_modules_and_functions_stay_short(module: Path) -> None:
    text = module.read_text()
    assert len(text.splitlines()) <= 500, f"{module.name} has {len(text.splitlines())} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == [], f"{module.name}: {long}"
