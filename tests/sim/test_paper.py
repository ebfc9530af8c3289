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


def test_paper_drift_nereus_beats_the_best_fixed_layout(drift):
    ours = drift["nereus"]["mean_step_s"]
    assert ours < drift["fixed_best"]["mean_step_s"]
    assert ours < drift["fixed"]["mean_step_s"]


def test_paper_drift_nereus_beats_every_3(drift):
    """Simulated: nereus 253.65 vs every_3 253.72 s/step (a strict xfail until the memory model counted the
    engine's weight copy: every_3 was 0.14% faster, its extra moves paying)."""
    assert drift["nereus"]["mean_step_s"] < drift["every_3"]["mean_step_s"]


def test_paper_drift_nereus_is_within_5pct_of_the_oracle_without_oom(drift):
    assert drift["oracle"]["mean_step_s"] <= drift["nereus"]["mean_step_s"] <= 1.05 * drift["oracle"]["mean_step_s"]
    assert drift["nereus"]["oom_events"] == 0


@pytest.mark.xfail(strict=True, reason="simulated: nereus is 11.1% faster than fixed TP/PP + DP scaling (253.7 vs "
                   "285.4 s/step), not 27.7%, and even the oracle (best plan every step, free transitions) is only "
                   "11.6% faster (252.4): the fixed baseline re-plans dp, micro-batch and remat with the same "
                   "controller and runs its stages on the job's shared topology, so under this ground truth no "
                   "policy can reach 27.7%")
def test_paper_drift_nereus_is_at_least_27_7pct_faster_than_fixed(drift):
    assert drift["nereus"]["mean_step_s"] <= (1 - 0.277) * drift["fixed"]["mean_step_s"]


@pytest.mark.xfail(strict=True, reason="simulated: nereus ties no_admission (253.7 s/step, the same 7 decisions): "
                   "every re-plan on this trace is a hard trigger (6 pool changes, 1 memory) and the 4 non-urgent "
                   "ones are pool growths predicted to gain 94-229 s/step for 4-17 s of transition (payback <= 0.12 "
                   "steps), so any gamma > 0.12 admits them; hard triggers every <= 4 steps reset the length "
                   "reference before it drifts 30%, so no marginal soft-trigger move exists for Eq. 2 to reject "
                   "(on paper_1024 it does: test_1024_no_admission_admits_a_move_eq2_rejects_that_does_not_pay)")
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


@pytest.fixture(scope="module")
def no_admission_1024(sim_1024):
    return sim_1024.run_policy("no_admission")


def test_1024_no_admission_admits_a_move_eq2_rejects_that_does_not_pay(run_1024, no_admission_1024):
    """Where both policies stood on the same plan and no_admission took a move Eq. 2 rejected, no_admission
    spent more ground-truth time (steps + transition) until either moved again: the predicted gain was not
    real (the step-77 length move: +16.8 s by step 100)."""
    nereus, other = run_1024[0], no_admission_1024
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


@pytest.mark.xfail(strict=True, reason="simulated: no_admission is 0.85% faster than nereus on paper_1024 (32.32 vs "
                   "32.60 s/step, 7 transitions against 4): besides the step-77 move that does not pay, it admits "
                   "the step-100 pool growth (predicted 18.4 s/step for a 25.7 s transition) that Eq. 2 rejects "
                   "with H = 1 at the pool signal's first crossing, and that move pays (gamma 2 admits it too: "
                   "32.29 s/step)")
def test_1024_nereus_beats_no_admission(run_1024, no_admission_1024):
    assert run_1024[0].summary()["mean_step_s"] < no_admission_1024.summary()["mean_step_s"]


def test_1024_gamma_sweep_has_the_papers_shape(sim_1024, run_1024):
    """The paper's sweep: gamma = 0 adapts only on urgent triggers; a large gamma makes more transitions and a
    slower run (its gamma = 1: 14 transitions); gamma = 0.5 is faster than both ends. With the shipped controller
    (Eq. 2 and the gain-uncertainty margin)."""
    zero = sim_1024.with_controller(gamma=0.0).run_policy("nereus")
    mid = run_1024[0].summary()
    large = sim_1024.with_controller(gamma=1.0).run_policy("nereus").summary()
    assert all(d.urgent for d in zero.decisions if d.admitted)
    assert any(not d.urgent and not d.admitted for d in zero.decisions)
    s0 = zero.summary()
    assert mid["mean_step_s"] < s0["mean_step_s"] and mid["mean_step_s"] < large["mean_step_s"]
    assert large["transitions"] > mid["transitions"]


def test_1024_gamma_sweep_has_the_papers_shape_under_the_papers_eq2_alone(sim_1024):
    """The same shape with the paper's Eq. 2 alone (no margin): gamma 0.5 faster than gamma 1, which makes more
    transitions (it admits the step-100 pool growth, 18.4 s/step for a 25.7 s transition with H = 1 at a
    signal's first crossing, that gamma 0.5 rejects)."""
    paper = sim_1024.with_controller(error_margin=False)
    mid = paper.run_policy("nereus").summary()
    large = paper.with_controller(gamma=1.0).run_policy("nereus").summary()
    assert mid["mean_step_s"] < large["mean_step_s"] and large["transitions"] > mid["transitions"]


def test_1024_error_margin_rejects_the_moves_the_papers_eq2_loses_time_on(sim_1024):
    """With the margin (the default), a move whose predicted gain is within the cost model's uncertainty about
    it is turned down. At gamma 0.5 both controllers make the same 4 moves here; at gamma 2 the paper's Eq. 2
    alone also takes efficiency-triggered moves late in the run that do not pay: the margin makes fewer
    transitions and a faster run."""
    ours = sim_1024.with_controller(gamma=2.0).run_policy("nereus")
    paper = sim_1024.with_controller(gamma=2.0, error_margin=False).run_policy("nereus").summary()
    assert any("within the cost model's uncertainty" in why for d in ours.decisions for _, why in d.rejected)
    assert ours.summary()["transitions"] < paper["transitions"]
    assert ours.summary()["mean_step_s"] < paper["mean_step_s"]


def test_1024_run_spends_at_most_0_079pct_in_transitions(run_1024):
    """The paper: 6 transitions, 49.5 s of a 62,353 s run (0.079%). Its workload is unpublished (ours:
    configs/sim/paper_1024.yaml, steps of ~33 s against its ~62 s), so the fraction is the comparable figure."""
    assert run_1024[0].summary()["overhead_fraction"] <= 0.00079
