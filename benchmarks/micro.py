"""What the micro-benchmarks (`store_bench`, `socket_bench`, `executor_bench`) share: their
command line and where their JSON goes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
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


def sized_main(
    argv: list[str] | None,
    doc: str | None,
    name: str,
    run: Callable[[int, int], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    *,
    n_help: str,
) -> int:
    """A benchmark of `n` calls a repetition (`-n`): 300 x 2 with --quick, 5,000 x 5 else."""
    made = parser(doc, name)
    made.add_argument("-n", type=int, default=None, help=n_help)
    args = made.parse_args(argv)
    report = run(
        args.n or (300 if args.quick else 5_000), args.repetitions or (2 if args.quick else 5)
    )
    print(table(report))
    print(f"written to {write_report(report, name, quick=args.quick, out=args.out)}")
    return 0
