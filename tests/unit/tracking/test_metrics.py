"""Metric windows aggregate per DESIGN.md §7."""

import math

from grpo_core.tracking.metrics import JsonlSink, MetricWindow, aggregation, merge


def test_aggregation_rules_follow_the_last_name_part():
    assert aggregation("sample/dropped_stale_count") == "sum"
    assert aggregation("sample/staleness_max") == "max"
    assert aggregation("completions/min_length") == "min"
    assert aggregation("reward") == "mean"
    assert aggregation("max_things/reward") == "mean"  # only the last part counts


def test_window_sums_counts_keeps_extremes_and_divides_rates():
    w = MetricWindow()
    for v in (1, 2, 3):
        w.add("sample/dropped_stale_count", v)
        w.add("sample/staleness_max", v)
        w.add("reward", v)
    w.add("reward", math.nan)
    w.rate("perf/tokens_per_s", 100, 1.0)
    w.rate("perf/tokens_per_s", 300, 3.0)
    assert w.flush() == {
        "sample/dropped_stale_count": 6,
        "sample/staleness_max": 3,
        "reward": 2.0,
        "perf/tokens_per_s": 100.0,
    }
    assert w.flush() == {}
    assert merge([{"a_count": 1, "b": 1.0}, {"a_count": 2, "b": 3.0}]) == {"a_count": 3, "b": 2.0}


def test_jsonl_sink_appends(tmp_path):
    path = tmp_path / "m.jsonl"
    for step in (1, 2):
        sink = JsonlSink(path)
        sink.log(step, {"loss": 0.5 * step})
        sink.close()
    assert JsonlSink.read(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 1.0}]
