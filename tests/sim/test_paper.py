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

pytestmark = [pytest.mark.slow, pytest.mark.long]  # ~5 min: the SIMULATED paper figures


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


@pytest.mark.xfail(strict=True, reason="simulated: nereus is 18.2% faster than fixed TP/PP + DP scaling (251.1 vs "
                   "307.1 s/step), not 27.7%, and even the oracle (best plan every step, free transitions) is only "
                   "19.7% faster (246.6): the fixed baseline re-plans dp, micro-batch and remat with the same "
                   "controller, so under this ground truth no policy can reach 27.7%")
def test_paper_drift_nereus_is_at_least_27_7pct_faster_than_fixed(drift):
    assert drift["nereus"]["mean_step_s"] <= (1 - 0.277) * drift["fixed"]["mean_step_s"]


@pytest.mark.xfail(strict=True, reason="simulated: nereus ties no_admission (251.1 s/step, the same 10 decisions): "
                   "every re-plan on this trace is a hard trigger (6 pool changes, 4 memory) and the 4 non-urgent "
                   "ones are pool growths predicted to gain 105-221 s/step for 3-13 s of transition (payback <= 0.08 "
                   "steps), so any gamma > 0.04 admits them; hard triggers every <= 4 steps reset the length "
                   "reference before it drifts 30%, so no marginal soft-trigger move exists for Eq. 2 to reject "
                   "(on paper_1024 it does: test_1024_nereus_beats_no_admission_which_admits_a_move_that_does_not_pay)")
def test_paper_drift_nereus_beats_no_admission(drift):
    assert drift["nereus"]["mean_step_s"] < drift["no_admission"]["mean_step_s"]


@pytest.fixture(scope="module")
def sim_1024():
    return Simulation(load_trace("paper_1024"))


@pytest.fixture(scope="module")
def run_1024(sim_1024):
    start = time.process_time()
    run = sim_1024.run_policy("nereus")
    return run, time.process_time() - start


def test_1000_steps_at_1024_gpus_simulate_in_under_a_minute(run_1024):
    _, cpu_s = run_1024
    assert cpu_s < 60, cpu_s


def test_1024_run_reports_the_controllers_decision_time(run_1024):
    summary = run_1024[0].summary()
    assert 0 < summary["decision_ms_mean"] <= summary["decision_ms_max"]
    assert summary["transitions"] >= 3  # the pool doubles three times
    assert summary["oom_events"] == 0


def test_1024_run_makes_no_more_transitions_than_the_papers_six(run_1024):
    """The paper's 1,000-step run made 6 transitions. One straggler step (a 1.3-2x slower device, some stage
    every few dozen steps at this scale) is not an efficiency drift and must not move the plan."""
    run, _ = run_1024
    assert run.summary()["transitions"] <= 6
    assert not [d.step for d in run.decisions if d.admitted and d.trigger == "efficiency"]


def test_1024_nereus_beats_no_admission_which_admits_a_move_that_does_not_pay(sim_1024, run_1024):
    """Where both policies stood on the same plan and no_admission took a move Eq. 2 rejected, no_admission
    spent more ground-truth time (steps + transition) until either moved again: the predicted gain was not
    real. Over the run nereus is faster."""
    nereus, other = run_1024[0], sim_1024.run_policy("no_admission")
    assert nereus.summary()["mean_step_s"] < other.summary()["mean_step_s"]
    ours = {d.step: d for d in nereus.decisions}
    moves = {s for run in (nereus, other) for s in run.summary()["transition_steps"]}
    judged = []
    for d in other.decisions:
        mine = ours.get(d.step)
        if not (d.admitted and not d.urgent and mine is not None and not mine.admitted) or \
                nereus.records[d.step - 1].plan != other.records[d.step - 1].plan:
            continue
        end = min([s for s in moves if s > d.step] + [len(nereus.records)])
        cost = [sum(r.latency_s + r.transition_s for r in run.records[d.step:end]) for run in (other, nereus)]
        judged.append((d.step, cost[0] - cost[1]))
    assert judged and any(extra > 0 for _, extra in judged), judged


def test_1024_gamma_sweep_has_the_papers_shape(sim_1024):
    """The paper's sweep, with the paper's Eq. 2 (``error_margin`` off): gamma = 0 adapts only on urgent triggers;
    a large gamma makes more transitions and a slower run (its gamma = 1: 14 transitions); gamma = 0.5 is faster
    than both ends."""
    paper = sim_1024.with_controller(error_margin=False)
    zero = paper.with_controller(gamma=0.0).run_policy("nereus")
    mid = paper.run_policy("nereus").summary()
    large = paper.with_controller(gamma=1.0).run_policy("nereus")
    assert all(d.urgent for d in zero.decisions if d.admitted)
    assert any(not d.urgent and not d.admitted for d in zero.decisions)
    s0, s1 = zero.summary(), large.summary()
    assert mid["mean_step_s"] < s0["mean_step_s"] and mid["mean_step_s"] < s1["mean_step_s"]
    assert s1["transitions"] > mid["transitions"]


def test_1024_error_margin_rejects_the_moves_a_large_gamma_loses_time_on(sim_1024, run_1024):
    """With the margin (the default), the moves predicted to gain less than the cost model's error on its earlier
    moves are turned down: gamma = 1 makes no more transitions than gamma = 0.5 and runs faster than the paper's
    Eq. 2 at gamma = 1 (and at 0.5)."""
    paper = sim_1024.with_controller(error_margin=False)
    large = sim_1024.with_controller(gamma=1.0).run_policy("nereus").summary()
    paper_large = paper.with_controller(gamma=1.0).run_policy("nereus").summary()
    ours = run_1024[0]
    assert any("within the cost model's error" in why for d in ours.decisions for _, why in d.rejected)
    assert large["transitions"] <= ours.summary()["transitions"] < paper_large["transitions"]
    assert large["mean_step_s"] < paper_large["mean_step_s"]
    assert ours.summary()["mean_step_s"] < paper.run_policy("nereus").summary()["mean_step_s"]


@pytest.mark.xfail(strict=True, reason="simulated: transitions take 0.17% of the 1,024-GPU run (4 of them, 54.4 s of "
                   "32,934 s), not <= 0.079% (the paper: 6, 49.5 s of 62,353 s): the 512 -> 1,024 move alone takes 27 "
                   "s (the paper: 31.55 s), but this trace's steps are ~33 s against the paper's ~62 s (its workload "
                   "is unpublished; ours is fixed in configs/sim/paper_1024.yaml; 54.4 s of 62,353 s would be 0.087%), "
                   "and an urgent memory move at step 10 (4.6 s) comes on top of the 3 pool changes")
def test_1024_run_spends_at_most_0_079pct_in_transitions(run_1024):
    assert run_1024[0].summary()["overhead_fraction"] <= 0.00079
