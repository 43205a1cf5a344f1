"""The demo's verdict: every result checked against a direct execution, and a summary of
what the queue did (dedup, the fast track, latency by priority, the cancel, the timeout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from queryqueue.demo_plan import Outcome


@dataclass
class Report:
    text: str
    passed: bool


def summarize(
    results: list[Outcome],
    expected: dict[str, str],
    stats: dict[str, Any],
    elapsed: float,
    requests: int,
    clients: int,
    timeout: float,
) -> Report:
    from queryqueue.supervisor.tables import table

    missing = requests - len(results)
    executions = int(stats["pool"]["handed_off"]) + sum(o.kind == "stream" for o in results)
    # A result without its reference is wrong too: nothing passes unchecked.
    wrong = [o for o in results if o.status == "ok" and o.digest != expected.get(o.sql)]
    errors = [o for o in results if o.status == "error"]
    summary = [
        *_what_ran(results, executions, elapsed, clients),
        *_specials(results, expected, timeout),
        ["errors", str(len(errors) + missing)],
        ["wrong results", str(len(wrong))],
        ["supervisor", f"{stats['commands_total']} commands, mean batch {stats['mean_batch']}"],
    ]
    lines = [
        table(["", "demo summary"], summary),
        "",
        table(["priority", "queries", "p50 ms", "p99 ms", "max ms"], _latency(results)),
    ]
    for o in (errors + wrong)[:5]:
        lines.append(f"  {o.status}: {o.sql[:60]}... {o.detail[:200]}")
    passed = (
        not errors
        and not wrong
        and missing == 0
        and all(o.status == "cancelled" for o in results if o.kind == "cancel")
        and all(o.status == "timed out" for o in results if o.kind == "timeout")
        and all(o.status == "ok" for o in results if o.kind == "stream")
        and executions < len(results)
    )
    lines.append("PASSED: every result correct" if passed else "FAILED")
    return Report("\n".join(lines), passed)


def _what_ran(
    results: list[Outcome], executions: int, elapsed: float, clients: int
) -> list[list[str]]:
    """Submitted, executed (dedup's saving), the fast track's share, throughput."""
    submitted = len(results)
    urgent = [o for o in results if o.kind == "sql" and o.priority >= 10]
    fast = sum(o.fast_tracked for o in urgent)
    saved = submitted - executions
    return [
        ["queries submitted", f"{submitted} from {clients} processes"],
        ["executions", f"{executions} (dedup saved {saved}, {_share(saved, submitted)})"],
        [
            "fast track",
            f"{fast} of {len(urgent)} priority-10 queries ({_share(fast, len(urgent))})",
        ],
        ["interactive phase", _interactive(results)],
        ["throughput", f"{submitted / elapsed:.1f} queries/s over {elapsed:.1f} s"],
    ]


def _specials(results: list[Outcome], expected: dict[str, str], timeout: float) -> list[list[str]]:
    """The stream, the cancelled query and the one that ran into the timeout."""
    streamed = [o for o in results if o.kind == "stream"]
    cancelled = [o for o in results if o.kind == "cancel"]
    timed_out = [o for o in results if o.kind == "timeout"]
    return [
        ["stream", ", ".join(f"{o.rows} rows, {_verdict(o, expected)}" for o in streamed)],
        ["cancelled", ", ".join(f"{o.status} after {o.seconds:.1f} s" for o in cancelled)],
        [
            "timed out",
            ", ".join(
                f"{o.status} after {o.seconds:.1f} s (limit {timeout:.0f} s)" for o in timed_out
            ),
        ],
    ]


def _latency(results: list[Outcome]) -> list[list[str]]:
    rows = []
    for priority in sorted({o.priority for o in results if o.kind == "sql"}):
        seconds = sorted(o.seconds for o in results if o.kind == "sql" and o.priority == priority)
        rows.append(
            [
                str(priority),
                str(len(seconds)),
                f"{_quantile(seconds, 0.5) * 1000:.0f}",
                f"{_quantile(seconds, 0.99) * 1000:.0f}",
                f"{seconds[-1] * 1000:.0f}",
            ]
        )
    return rows


def _interactive(results: list[Outcome]) -> str:
    """The fast track's share of the idle-queue lookups, and its latency beside the
    queued path's."""
    phase = [o for o in results if o.kind == "interactive" and o.status == "ok"]
    fast = sorted(o.seconds for o in phase if o.priority >= 10 and o.fast_tracked)
    urgent = [o for o in phase if o.priority >= 10]
    queued = sorted(o.seconds for o in phase if o.priority < 10)
    if not urgent or not queued:
        return "not run"
    fast_p50 = f"{_quantile(fast, 0.5) * 1000:.1f} ms" if fast else "-"
    return (
        f"{len(fast)} of {len(urgent)} priority-10 lookups on the fast track"
        f" ({_share(len(fast), len(urgent))}), p50 {fast_p50};"
        f" priority 0, queued: p50 {_quantile(queued, 0.5) * 1000:.1f} ms"
    )


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _verdict(outcome: Outcome, expected: dict[str, str]) -> str:
    if outcome.status != "ok":
        return outcome.status
    return "correct" if expected.get(outcome.sql) == outcome.digest else "WRONG"


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0
