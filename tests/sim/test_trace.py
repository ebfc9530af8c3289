"""Drift traces: the shipped files have the shapes the paper describes; bad files are rejected by key."""

import pytest

from nereus_jax.sim import TraceError, build_trace, load_trace


def _mean(values):
    return sum(values) / len(values)


def test_paper_drift_trace_has_the_papers_lengths_and_pool():
    t = load_trace("paper_drift")
    means = [w.response_length.mean for w in t.workloads]
    p95s = [w.response_length.p95 for w in t.workloads]
    assert t.hardware == "a100" and t.steps == 26
    # mean 1,147.5 over steps 0-3 -> 3,722 over steps 20-25 (p95 1,339 -> 4,072); a 3% seeded jitter
    assert _mean(means[:4]) == pytest.approx(1147.5, rel=0.03)
    assert _mean(means[20:]) == pytest.approx(3722, rel=0.03)
    assert _mean(p95s[:4]) == pytest.approx(1339, rel=0.03)
    assert _mean(p95s[20:]) == pytest.approx(4072, rel=0.03)
    assert min(t.pools) == 8 and max(t.pools) == 32


def test_paper_1024_trace_grows_to_1024_devices_over_1000_steps():
    t = load_trace("paper_1024")
    assert t.steps == 1000 and t.pools[0] < t.pools[-1] == 1024
    assert list(t.pools) == sorted(t.pools)


def test_llama_growth_trace_grows_500_to_8000_tokens():
    t = load_trace("llama_growth")
    first, last = t.workloads[0].response_length.mean, t.workloads[-1].response_length.mean
    assert t.steps == 1000
    assert first == pytest.approx(500, rel=0.1) and last == pytest.approx(8000, rel=0.1)


def test_preemptible_trace_changes_its_pool_more_than_10_times():
    t = load_trace("preemptible")
    assert t.pool_changes() > 10


def test_unknown_keys_are_rejected_with_their_name(small_data):
    small_data["workload"]["prompt_lenght"] = {}
    with pytest.raises(TraceError, match="prompt_lenght"):
        build_trace(small_data)
    with pytest.raises(TraceError, match="controller.gamam"):
        load_trace("paper_drift", {"controller.gamam": 1})


def test_overrides_reach_the_trace():
    t = load_trace("paper_drift", {"controller.gamma": 0.25, "seed": 3, "steps": 5})
    assert t.controller["gamma"] == 0.25 and t.seed == 3 and t.steps == 5


def test_jitter_is_seeded(small_data):
    a, b = build_trace(small_data), build_trace(small_data)
    small_data["seed"] = 1
    c = build_trace(small_data)
    assert a.workloads == b.workloads != c.workloads
