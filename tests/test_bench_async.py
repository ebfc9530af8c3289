"""tools/bench_async.py's arithmetic: the overlap limits from stage times, and the JSON it prints from the
runs' figures (medians, speedup, accuracies, the simulator field). No job runs here: the end-to-end run is
the tool itself (minutes)."""

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_async.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_async", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ideal_overlap_is_the_stage_sum_over_the_stage_max(bench):
    assert bench.ideal_speedup([1.0, 1.0], [1.0, 1.0]) == 2.0  # equal stages: overlap halves the time
    assert bench.ideal_speedup([3.0], [1.0]) == pytest.approx(4 / 3)  # generation dominates: little to gain


def test_one_step_off_overlaps_the_next_generation_with_this_steps_training(bench):
    gen, rest = [0.0, 2.0], [2.0, 0.0]  # within a step nothing overlaps; across steps everything does
    assert bench.ideal_speedup(gen, rest) == 1.0
    assert bench.ideal_pipelined(gen, rest) == 2.0


def _run(mode, seconds, accuracy):
    return {"mode": mode, "rl_seconds": seconds, "accuracy_before": 0.2, "accuracy_after": accuracy,
            "gen_s": [0.5, 0.5], "rest_s": [0.5, 0.5], "interval_s": [seconds / 2] * 2, "gen_work_s": 1.0,
            "gen_wait_s": seconds - 1.0, "learner_work_s": 1.0, "learner_wait_s": seconds - 1.0,
            "step_s_median": seconds / 2, "cpu_s": 1.0, "cores_used": 1.0 / seconds, "python_s": seconds * 0.8,
            "python_fraction": 0.8}


def test_the_json_reports_medians_speedup_accuracies_and_the_ideal(bench):
    sync = [_run("sync", s, a) for s, a in ((10.0, 0.5), (12.0, 0.6), (30.0, 0.7))]
    asyn = [_run("async", s, a) for s, a in ((8.0, 0.6), (6.0, 0.5), (9.0, 0.6))]
    args = SimpleNamespace(steps=2, runs=3, config="async_tiny", overrides=[])
    out = bench.summarize(sync, asyn, [1.0, 1.2, 1.1, 1.3, 1.0, 1.0], args, [0.9, 1.0, 1.4, 0.8, 1.1, 1.0])
    assert (out["sync_s"], out["async_s"], out["speedup"]) == (12.0, 8.0, 1.5)  # medians, not means
    # accuracies: the mean over the paired seeds (one seed repeated is bit-identical), not a median
    assert out["accuracy_sync"] == pytest.approx(0.6) and out["accuracy_async"] == pytest.approx(1.7 / 3)
    assert out["accuracy_gap"] == pytest.approx(0.0333, abs=1e-4)
    assert out["ideal_speedup"] == 2.0 and out["gain_fraction_of_ideal"] == 0.5
    assert out["speedup_steady"] == 1.5 and out["steady_from_step"] == 0  # 2 steps: no start-up to leave out
    assert [r["mode"] for r in out["per_run"]] == ["sync", "async"] * 3  # in the order they ran
    assert out["profile"]["async"]["gen_wait_s"] == 7.0
    assert "simulator_async" in out and (out["simulator_async"] is not None or out["simulator_note"])
    assert out["machine_overlap"] == 1.05 and out["dispatch_overlap"] == 1.0  # medians of the probes before each run
    # sync's Python + dispatch seconds (12 x 0.8) serialise on the GIL in async too: at most 12 / 9.6 faster
    assert out["gil_bound_speedup"] == 1.25
    # sync's runs keep 1/10, 1/12, 1/30 of a core busy: the cores bound async at cpu_count / (1/12)
    assert out["core_bound_speedup"] == pytest.approx(round(os.cpu_count() * 12.0, 4))
    assert "--xla_force_host_platform_device_count=8" in out["xla_flags"]
