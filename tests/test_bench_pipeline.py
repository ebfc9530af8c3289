"""tools/bench_pipeline.py: its bubble arithmetic gives each schedule's formula on uniform stage work, and its
--smoke run reports the rows it promises (schedule, source, peak_activation_bytes, the job's own train step)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nereus_jax.sharding.pipeline import bubble_fraction, gpipe_schedule, one_f_one_b_schedule

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "tools" / "bench_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 8), (4, 4), (4, 8)])
def test_measured_bubble_of_uniform_work_is_the_formula(pp, m):
    """With no head on the last stage, any forward and backward times give (pp - 1) / (m + pp - 1) for both
    schedules (1F1B: warm-up ticks cost a forward, cool-down ticks a backward, the rest both); the head adds
    to the last stage's ticks only, so it idles the others once they overlap (m > 1)."""
    bench = _bench()
    phases = {"forward": 1.0, "backward": 2.0, "recompute_backward": 3.0, "head": 0.0}
    for schedule, table in (("gpipe", gpipe_schedule(pp, m)), ("1f1b", one_f_one_b_schedule(pp, m))):
        work = bench.tick_work(schedule, table, phases)
        assert bench.measured_bubble(work) == pytest.approx(bubble_fraction(pp, m))
    heavy = bench.tick_work("1f1b", one_f_one_b_schedule(pp, m), {**phases, "head": 0.5})
    assert bench.measured_bubble(heavy) > bubble_fraction(pp, m) or m == 1


@pytest.mark.long  # ~3 min on 2 cores
def test_bench_pipeline_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_pipeline.py"), "--smoke"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=1200)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = result["rows"]
    for row in rows:
        for key in ("pp", "microbatches", "step_s", "bubble_measured", "bubble_formula", "schedule", "source",
                    "peak_activation_bytes"):
            assert key in row, key
        assert abs(row["bubble_measured"] - row["bubble_formula"]) <= 0.05
    pairs = {(source, schedule) for source in ("kernel", "job") for schedule in ("gpipe", "1f1b")}
    assert {(r["source"], r["schedule"]) for r in rows} == pairs
    jobs = {r["schedule"]: r for r in rows if r["source"] == "job"}
    assert all(r["program_loops_over_ticks"] and r["collective_permutes"] > 0 for r in jobs.values())
    assert jobs["1f1b"]["microbatches"] == 8 and jobs["1f1b"]["peak_activation_bytes"] < jobs["gpipe"][
        "peak_activation_bytes"]
    assert result["job_1f1b_peak_below_gpipe_at_m8"]
    assert np.isfinite(result["max_bubble_error"])
