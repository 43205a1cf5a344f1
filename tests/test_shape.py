"""Every package stays small enough to hold in one's head, its tests and benchmarks too:
modules of at most 500 lines, classes of at most 400, functions of at most 60."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [
    "engine",
    "driver_sqlite",
    "driver_postgres",
    "driver_socket",
    "supervisor",
    "queryqueue",
    "tests",
    "benchmarks",
    "examples",
]
CAPS = {"module": 500, "class": 400, "function": 60}


def _modules() -> list[Path]:
    # queryqueue/ links to the other folders: only its own files are its own; the peers'
    # environments under benchmarks/ are not ours.
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if not any(part.is_symlink() for part in [path, *path.parents])
        and ".peers" not in path.parts
    )


def _sizes(module: Path) -> dict[str, int]:
    """Every module, class and function of `module` with its length in lines."""
    relative = module.relative_to(ROOT).as_posix()
    text = module.read_text()
    sizes = {f"module {relative}": len(text.splitlines())}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            assert node.end_lineno is not None
            size = node.end_lineno - node.lineno + 1
            name = f"{kind} {relative}:{node.name}"
            sizes[name] = max(size, sizes.get(name, 0))
    return sizes


@pytest.mark.parametrize("module", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_modules_classes_and_functions_stay_within_their_caps(module: Path) -> None:
    over = [
        f"{name} has {size} lines (cap {CAPS[name.split(' ')[0]]})"
        for name, size in _sizes(module).items()
        if size > CAPS[name.split(" ")[0]]
    ]
    assert over == []
