"""The README's and the documentation's Python examples pass `mypy --strict`, as a user's
project checks them: each block a module, named by its first line where it says so
(`# queries.py`) so that later blocks import it, with top-level `await` allowed (the
blocks are read as bodies of async functions), one mypy run a page. Blocks that include
a file of `examples/` are that file, checked with the project."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.mypy_util import mypy_errors

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NAMED = re.compile(r"# ([a-z_]+)\.py\n")


def _blocks(page: Path) -> list[tuple[str, str]]:
    """(module name, source) of every Python block of `page` that is not an include."""
    stem = re.sub(r"\W", "_", page.stem).lower()
    found = []
    for number, match in enumerate(BLOCK.finditer(page.read_text())):
        source = match.group(1)
        if "--8<--" in source:
            continue
        named = NAMED.match(source)
        found.append((named.group(1) if named else f"{stem}_{number}", source))
    return found


def test_the_readme_and_the_docs_have_examples_to_check() -> None:
    assert sum(len(_blocks(page)) for page in PAGES) >= 10


@pytest.mark.parametrize(
    "page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_every_python_example_passes_mypy_strict(page: Path, tmp_path: Path) -> None:
    for name, source in _blocks(page):
        (tmp_path / f"{name}.py").write_text(source)
    status, errors = mypy_errors(
        sorted(tmp_path.glob("*.py")), tmp_path, "--disable-error-code", "top-level-await"
    )
    assert status == 0, "\n".join(errors)
