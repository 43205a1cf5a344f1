"""What a run prints and writes: the tables, the README's summary, the charts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

WORKLOADS = [
    "throughput",
    "idle_latency",
    "dedup_storm",
    "priority_burst",
    "large_results",
    "soak",
    "io_bound",
    "hosts",
    "scale",
]


def _fmt(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours first, then the references and peers, each in the order measured."""
    return sorted(rows, key=lambda r: not str(r.get("system", "")).startswith("queryqueue"))


def tables(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cpus']} CPUs, {m['memory_gb']} GB, "
        f"Python {m['python']}, {m['platform']}",
        "",
    ]
    for workload in WORKLOADS:
        rows = _ordered([r for r in report["rows"] if r.get("workload") == workload])
        if not rows:
            continue
        lines += [
            f"### {workload}",
            "",
            "| system | n | result (median, min-max) | latency p50 / p99 ms "
            "| CPU s / 1000 | peak RSS MB | settings |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if "unsupported" in r or "failed" in r or "skipped" in r:
                note = r.get("unsupported") or r.get("skipped") or f"failed: {r['failed']}"
                lines.append(f"| {r['system']} | | {note} | | | | |")
                continue
            result = f"{_fmt(r['median'])} {r['metric']} ({_fmt(r['min'])}-{_fmt(r['max'])})"
            latency = r.get("latency_ms")
            lat = f"{_fmt(latency['p50_ms'])} / {_fmt(latency['p99_ms'])}" if latency else ""
            cpu = r.get("cpu_s_per_1000")
            extra = _notes(r, workload)
            lines.append(
                f"| {r['system']} | {r['n']:,} | {result} | {lat} "
                f"| {_fmt(cpu['median']) if cpu else ''} | {r.get('peak_rss_mb', '')} "
                f"| {extra}{r.get('settings', '')} |"
            )
        lines.append("")
    for s in report["skipped"]:
        lines.append(f"- skipped {s['system']}: {s['skipped']}")
    return "\n".join(lines)


def _notes(r: dict[str, Any], workload: str) -> str:
    """What a row says besides its result, before its settings."""
    extra = ""
    if "executions" in r and workload == "dedup_storm":
        extra = f"executions: {r['executions']:.0f}; "
    if "supervisor_rss_mb" in r:
        rss = r["supervisor_rss_mb"]
        extra = (
            f"supervisor RSS {rss['start']} / {rss['middle']} / {rss['end']} MB; "
            f"db {r['db_mb']} MB, WAL {r['wal_mb']} MB; "
        )
    if "of_first" in r and workload == "scale":
        extra += f"{r['of_first']}x the curve's first point; "
    if "supervisor_bytes_per_call" in r:
        extra += f"supervisor {r['supervisor_bytes_per_call']:,} bytes per call waiting; "
    if "of_ideal" in r:
        extra += (
            f"{r['of_ideal']:.0%} of the ideal {r['ideal']['queries_per_s']:g} q/s, p99 "
            f"{r['p99_of_ideal']:.2f}x the ideal's {r['ideal']['p99_ms']:g} ms; "
        )
    if r.get("commands_per_query"):
        extra += f"{r['commands_per_query']} supervisor commands per query"
        batches = r.get("batches_per_query")
        extra += f" in {batches} batches; " if batches else "; "
    if r.get("cpu_ms_per_query"):
        by_role = r["cpu_ms_per_query"]
        extra += (
            f"CPU ms a query: supervisor {_fmt(by_role['supervisor'])}, workers "
            f"{_fmt(by_role['workers'])}, callers {_fmt(by_role['callers'])}; "
        )
    return extra


def summary(report: dict[str, Any]) -> str:
    """The short table for the README: one line per system and workload, medians."""
    m = report["machine"]
    lines = [
        f"Measured on {m['cpu']}, {m['cpus']} CPUs, {m['memory_gb']} GB, Python {m['python']}"
        " (medians; min-max, CPU and memory in `benchmarks/results/benchmarks.md`).",
        "",
        "| workload | system | result |",
        "|---|---|---|",
    ]
    for workload in WORKLOADS:
        for r in _ordered([r for r in report["rows"] if r.get("workload") == workload]):
            if "median" not in r:
                note = r.get("unsupported") or r.get("skipped") or r.get("failed", "")
                lines.append(f"| {workload} | {r['system']} | {note} |")
                continue
            result = f"{_fmt(r['median'])} {r['metric']}"
            latency = r.get("latency_ms")
            if latency and r["metric"] != "executions":
                result += f" (p99 {_fmt(latency['p99_ms'])} ms)"
            if workload == "dedup_storm" and latency:
                result += f", time to result p50 {_fmt(latency['p50_ms'])} / p99 {_fmt(latency['p99_ms'])} ms"
            if "supervisor_rss_mb" in r:
                rss = r["supervisor_rss_mb"]
                result += (
                    f"; supervisor RSS {rss['start']} / {rss['middle']} / {rss['end']} MB"
                    f" (start / middle / end); db {r['db_mb']} MB, WAL {r['wal_mb']} MB"
                )
            lines.append(f"| {workload} | {r['system']} | {result} |")
    return "\n".join(lines)


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


NO_MATPLOTLIB = "matplotlib is not installed (pip install -e '.[bench]')"


def chart(report: dict[str, Any], path: Path) -> str:
    plt = _pyplot()
    if plt is None:
        return f"no chart: {NO_MATPLOTLIB}"
    panels = [
        ("throughput", "queries/s (higher is better)"),
        ("idle_latency", "p50 ms, enqueue to result (lower is better)"),
        ("priority_burst", "p50 wait of urgent arrivals, ms (lower is better)"),
        ("large_results", "GB/s to the caller (higher is better)"),
    ]
    present = [
        (w, t)
        for w, t in panels
        if any(r.get("workload") == w and "median" in r for r in report["rows"])
    ]
    if not present:
        return "no chart: nothing to plot"
    figure, axes = plt.subplots(len(present), 1, figsize=(10, 3.2 * len(present)))
    axes = [axes] if len(present) == 1 else list(axes)
    for axis, (workload, title) in zip(axes, present, strict=True):
        rows = _ordered(
            [r for r in report["rows"] if r.get("workload") == workload and "median" in r]
        )
        names = [r["system"] for r in rows]
        medians = [r["median"] for r in rows]
        errors = [
            [r["median"] - r["min"] for r in rows],
            [r["max"] - r["median"] for r in rows],
        ]
        colors = ["#1f77b4" if n.startswith("queryqueue") else "#999999" for n in names]
        axis.barh(names, medians, xerr=errors, color=colors)
        axis.set_title(title, fontsize=10)
        axis.invert_yaxis()
        axis.tick_params(axis="y", labelsize=7)
        if workload in ("idle_latency", "priority_burst", "throughput"):
            axis.set_xscale("log")
    m = report["machine"]
    figure.suptitle(f"queryqueue benchmarks - {m['cpus']} CPUs, Python {m['python']}", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"chart written to {path}"


def scale_chart(report: dict[str, Any], path: Path) -> str:
    """The scale workload's curves: each point's result against its curve's first."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in report["rows"]:
        if r.get("workload") == "scale" and r.get("of_first") is not None:
            curves.setdefault(r["curve"], []).append((max(1, r["point"]), r["of_first"]))
    if not curves:
        return "no scale chart: no curve measured"
    plt = _pyplot()
    if plt is None:
        return f"no scale chart: {NO_MATPLOTLIB}"
    figure, axis = plt.subplots(figsize=(10, 5))
    for name, points in curves.items():
        xs, ys = zip(*sorted(points), strict=True)
        axis.plot(xs, ys, marker="o", label=name)
    axis.axhline(1.0, color="#999999", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_xlabel("point (calls in flight, items pending, prefixes, supervisors)")
    axis.set_ylabel("result / the curve's first point")
    axis.legend(fontsize=7)
    axis.set_title("queryqueue scale curves (time: lower is better; queries/s: higher)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"scale chart written to {path}"
