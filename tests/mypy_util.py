"""mypy --strict on files a test writes, as the project's own configuration checks them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mypy_errors(files: list[Path], cwd: Path, *options: str) -> tuple[int, list[str]]:
    """mypy's exit status and its error lines on `files` (`options` added)."""
    checked = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--strict", "--no-incremental",
            "--config-file", str(ROOT / "pyproject.toml"), *options, *map(str, files),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        # The checkout's queryqueue/ (its subpackages linked in), as the project's own mypy
        # run sees it: an editable install is found through a hook mypy does not follow.
        # And `cwd`, where the files are, so they import each other.
        env={**os.environ, "MYPYPATH": f"{ROOT}{os.pathsep}{cwd}"},
    )  # fmt: skip
    assert checked.returncode in (0, 1), checked.stdout + checked.stderr
    return checked.returncode, [line for line in checked.stdout.splitlines() if ": error:" in line]
