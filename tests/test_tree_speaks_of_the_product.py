"""What the repository says speaks of the product: no line in its code, comments, tests,
documentation or benchmark output narrates how it was developed (numbered work sessions,
issue numbers, commits cited as history) or points at documents outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".toml", ".html", ".yml", ".yaml", ".json", ".js", ".txt", ".cfg"}
SKIPPED = {".git", ".venv", ".peers", "last-run", "site", "build", "node_modules", "__pycache__"}
HISTORY = re.compile(
    r"\bsessions? \d+|\bissues? #?\d+|queue-design\.txt|cube-queue-spec|\.\./shared",
    re.IGNORECASE,
)
COMMIT = re.compile(r"`[0-9a-f]{7,40}`")


def _files() -> list[Path]:
    found = []
    for path in ROOT.rglob("*"):
        parts = set(path.relative_to(ROOT).parts)
        if parts & SKIPPED or any(p.endswith(".egg-info") for p in parts):
            continue
        if path == Path(__file__).resolve():
            continue  # its own patterns and examples
        if path.is_file() and not path.is_symlink() and path.suffix in SUFFIXES:
            found.append(path)
    return [*found, ROOT / ".ci" / "run"]


def test_no_line_narrates_the_work_or_points_outside_the_repository() -> None:
    offenders = []
    for path in _files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line) or (path.suffix == ".md" and COMMIT.search(line)):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert offenders == []


def test_the_check_finds_what_it_looks_for() -> None:
    # Built here, so that no line of this file is an example of what it looks for.
    session, issue, outside = "session" + " 12", "issue" + " #7", ".." + "/shared/x"
    for line in (f"as measured in {session}", f"see {issue}", "`9c0ce39` took it", outside):
        assert HISTORY.search(line) or COMMIT.search(line), line
    for line in ("each session sets statement_timeout", "a PostgreSQL session's lock"):
        assert not HISTORY.search(line), line
