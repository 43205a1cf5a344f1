"""What the micro-benchmarks (`store_bench`, `socket_bench`, `executor_bench`) share: their
command line and where their JSON goes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """`--quick`, `--repetitions` and `--out`; a benchmark adds its own sizes."""
    made = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    made.add_argument("--quick", action="store_true", help="small sizes, for CI")
    made.add_argument("--repetitions", type=int, default=None)
    made.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"default: benchmarks/results/{name}.json (the committed figures) for a full "
        f"run, benchmarks/last-run/{name}.json for --quick",
    )
    return made


def write_report(report: dict[str, Any], name: str, *, quick: bool, out: Path | None) -> Path:
    """The report as JSON, where `--out` says; --quick never overwrites the committed
    full-run figures."""
    out = out or Path("benchmarks", "last-run" if quick else "results", f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out
