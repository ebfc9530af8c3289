"""The paper-shaped experiments, end to end through ``python -m nereus_jax.simulate`` (slow: about a minute
each on 2 shared cores, almost all of it the planner).

Targets the simulator does not reach with its ground truth are strict xfails that state the measured
figure: they document the gap and fail loudly (XPASS) the day it closes.
"""

import json
import time

import pytest

from nereus_jax import simulate
from nereus_jax.sim import Simulation, load_trace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def drift():
    out = simulate.main(["paper_drift", "--json", "--no-plot"])
    json.dumps(out)  # what --json printed
    return out["policies"]


def test_paper_drift_nereus_beats_the_best_fixed_layout_and_every_3(drift):
    ours = drift["nereus"]["mean_step_s"]
    assert ours < drift["fixed_best"]["mean_step_s"]
    assert ours < drift["every_3"]["mean_step_s"]
    assert ours < drift["fixed"]["mean_step_s"]


def test_paper_drift_nereus_is_within_5pct_of_the_oracle_without_oom(drift):
    assert drift["oracle"]["mean_step_s"] <= drift["nereus"]["mean_step_s"] <= 1.05 * drift["oracle"]["mean_step_s"]
    assert drift["nereus"]["oom_events"] == 0


@pytest.mark.xfail(strict=True, reason="simulated: nereus is ~18% faster than fixed TP/PP + DP scaling, not 27.7%, "
                   "and even the oracle is only ~20% faster: the fixed baseline re-plans dp, micro-batch and remat "
                   "with the same controller, so under this ground truth no policy can reach 27.7%")
def test_paper_drift_nereus_is_at_least_27_7pct_faster_than_fixed(drift):
    assert drift["nereus"]["mean_step_s"] <= (1 - 0.277) * drift["fixed"]["mean_step_s"]


@pytest.mark.xfail(strict=True, reason="simulated: nereus ties no_admission (same decisions): transitions cost "
                   "seconds against gains of tens of seconds per step, so Eq. 2 never rejects a target here")
def test_paper_drift_nereus_beats_no_admission(drift):
    assert drift["nereus"]["mean_step_s"] < drift["no_admission"]["mean_step_s"]


@pytest.fixture(scope="module")
def run_1024():
    sim = Simulation(load_trace("paper_1024"))
    start = time.process_time()
    run = sim.run_policy("nereus")
    return run.summary(), time.process_time() - start


def test_1000_steps_at_1024_gpus_simulate_in_under_a_minute(run_1024):
    summary, cpu_s = run_1024
    assert cpu_s < 60, cpu_s


def test_1024_run_reports_the_controllers_decision_time(run_1024):
    summary, _ = run_1024
    assert 0 < summary["decision_ms_mean"] <= summary["decision_ms_max"]
    assert summary["transitions"] >= 3  # the pool doubles three times
    assert summary["oom_events"] == 0


@pytest.mark.xfail(strict=True, reason="simulated: transitions take ~0.3% of the 1,024-GPU run (12 of them, ~95 s), "
                   "not <= 0.079%: efficiency and length triggers add tp/pp moves beyond the 3 pool changes, each "
                   "paying a few seconds of setup")
def test_1024_run_spends_at_most_0_079pct_in_transitions(run_1024):
    summary, _ = run_1024
    assert summary["overhead_fraction"] <= 0.00079
