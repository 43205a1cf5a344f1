"""`python -m benchmarks.ab`'s own parts: what a variant names, and the medians it reports
(its runs themselves are the throughput workload, run by hand, never by the suite)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.ab import METRICS, parse_variant, summary

REPO = Path(__file__).resolve().parent.parent


def test_a_variant_names_a_checkout_and_the_supervisor_options_it_adds() -> None:
    plain = parse_variant(f"now={REPO}")
    assert (plain.name, plain.tree, plain.options) == ("now", REPO, ())
    tuned = parse_variant(f"nohold={REPO}:--hold-adds-s 0 --workers 2")
    assert tuned.options == ("--hold-adds-s", "0", "--workers", "2")


@pytest.mark.parametrize("text", ["now", "=.", "now=", f"now={REPO / 'tests'}"])
def test_a_variant_that_names_no_checkout_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="variant"):
        parse_variant(text)


def test_the_medians_are_each_variants_own_in_the_order_they_ran() -> None:
    def run(variant: str, qps: float) -> dict[str, float | str]:
        return {"variant": variant, **{m: qps / 1000 for m in METRICS}, "qps": qps}

    runs = [run("b", 3000), run("a", 10), run("b", 3300), run("a", 30), run("b", 3100)]
    medians = summary(runs)
    assert list(medians) == ["b", "a"]
    assert medians["b"]["qps"] == 3100 and medians["a"]["qps"] == 20
    assert medians["b"]["supervisor_us"] == 3.1
