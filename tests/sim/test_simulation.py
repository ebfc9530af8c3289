"""Policies on a small trace: determinism for a seed, the oracle as a lower bound, the baselines' rules,
the gamma sweep's ends, and the command line's JSON names and plot."""

import json

import numpy as np
import pytest
import yaml

from nereus_jax import simulate
from nereus_jax.sim import POLICIES, PolicyError, Simulation, build_trace, report


@pytest.fixture(scope="module")
def small_runs(small_module_data):
    sim = Simulation(build_trace(small_module_data))
    return sim, sim.run(POLICIES)


def _latencies(run):
    return [(r.latency_s, r.transition_s, r.wasted_s, r.plan) for r in run.records]


def test_a_seed_reproduces_every_step_bit_for_bit(small_data):
    first = Simulation(build_trace(small_data)).run(["nereus", "fixed"])
    again = Simulation(build_trace(small_data)).run(["nereus", "fixed"])
    for name in first:
        assert _latencies(first[name]) == _latencies(again[name])
        timing = ("decision_ms_mean", "decision_ms_max")  # wall-clock time of the controller itself
        assert {k: v for k, v in first[name].summary().items() if k not in timing} == \
            {k: v for k, v in again[name].summary().items() if k not in timing}
    small_data["seed"] = 7
    other = Simulation(build_trace(small_data)).run(["nereus"])
    assert _latencies(other["nereus"]) != _latencies(first["nereus"])


def test_oracle_is_a_lower_bound_of_every_policy_at_every_step(small_runs):
    _, runs = small_runs
    oracle = runs["oracle"].records
    for name, run in runs.items():
        for r, o in zip(run.records, oracle, strict=True):
            assert o.latency_s <= r.latency_s, (name, r.step)
        assert runs["oracle"].total_s <= run.total_s


def test_fixed_keeps_its_first_step_layouts_and_scales_dp(small_runs):
    sim, runs = small_runs
    first = sim.initial_plan().layouts()
    plans = [r.plan for r in runs["fixed"].records]
    assert all(p.layouts() == first for p in plans)
    assert len({p.devices for p in plans}) > 1  # it follows the pool (DP scaling)
    assert runs["fixed_best"].total_s <= runs["fixed"].total_s


def test_every_policy_stays_inside_the_pool(small_runs):
    sim, runs = small_runs
    for name, run in runs.items():
        for r in run.records:
            assert set(r.plan.devices) <= set(sim.trace.pool(r.step)), (name, r.step)


def test_every_3_replans_on_its_schedule_and_on_hard_triggers_only(small_runs):
    _, runs = small_runs
    triggers = [(d.step, d.trigger) for d in runs["every_3"].decisions]
    assert {t for _, t in triggers} <= {"schedule", "pool", "memory"}
    scheduled = [s for s, t in triggers if t == "schedule"]
    assert scheduled and all(s % 3 == 0 for s in scheduled)  # no length or efficiency trigger in between


def test_gamma_zero_adapts_only_on_urgent_triggers(small_data):
    small_data["controller"]["gamma"] = 0.0
    run = Simulation(build_trace(small_data)).run(["nereus"])["nereus"]
    admitted = [d for d in run.decisions if d.admitted]
    assert admitted and all(d.urgent for d in admitted)
    assert any(not d.urgent and not d.admitted for d in run.decisions)


def test_no_admission_never_rejects_a_gain_for_its_payback(small_runs):
    _, runs = small_runs
    reasons = [why for d in runs["no_admission"].decisions for _, why in d.rejected]
    assert not any("gamma*H" in why for why in reasons)


def test_json_has_the_names_others_rely_on(small_data, tmp_path, capsys):
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small_data))
    simulate.main([str(path), "--json", "--no-plot"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["simulated"] is True and out["hardware"] == "a100"
    assert set(POLICIES) <= set(out["policies"])
    for name, p in out["policies"].items():
        for key in ("mean_step_s", "transitions", "transition_s", "overhead_fraction", "oom_events"):
            assert key in p, (name, key)
        assert 0.0 <= p["overhead_fraction"] < 1.0


def test_json_carries_the_oracle_gain_captured_and_the_transfer_error(small_runs):
    sim, runs = small_runs
    policies = report.result_json(sim, runs)["policies"]
    fixed, oracle = runs["fixed"].total_s, runs["oracle"].total_s
    assert fixed > oracle  # the small trace leaves the oracle something to gain
    for name, run in runs.items():
        assert policies[name]["oracle_gain_captured"] == pytest.approx((fixed - run.total_s) / (fixed - oracle))
    assert policies["fixed"]["oracle_gain_captured"] == 0.0 and policies["oracle"]["oracle_gain_captured"] == 1.0
    moved = [r for r in runs["nereus"].records if any("transition" in e for e in r.events)]
    assert moved, "nereus moves on the small trace"
    errors = sorted(abs(r.predicted_s - r.latency_s) / r.latency_s for r in moved)
    assert policies["nereus"]["transfer_error_max"] == errors[-1]
    assert policies["nereus"]["transfer_error_median"] == pytest.approx(float(np.median(errors)))
    assert "transfer_error_median" not in policies["oracle"]  # not a controller policy: no predictions


def test_table_and_plot_say_simulated_and_name_the_hardware(small_data, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, png = tmp_path / "small.yaml", tmp_path / "out" / "small.png"
    path.write_text(yaml.safe_dump(small_data))
    simulate.main([str(path), "--policies", "fixed,nereus,oracle", "--plot", str(png)])
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "hardware table 'a100'" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_reruns_per_value(small_data, tmp_path, capsys):
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small_data))
    simulate.main([str(path), "--sweep", "controller.gamma=0,1", "--json", "--no-plot"])
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"] is True and out["sweep"]["key"] == "controller.gamma"
    runs = out["sweep"]["runs"]
    assert [r["value"] for r in runs] == [0, 1]
    assert runs[0]["policies"]["nereus"]["transitions"] <= runs[1]["policies"]["nereus"]["transitions"]


def test_a_controller_variant_shares_the_caches_and_runs_as_a_fresh_simulation(small_data):
    base = Simulation(build_trace(small_data))
    base.run(["nereus"])  # fills the planner's and the graphs' caches
    shared = base.with_controller(gamma=1.0).run(["nereus"])["nereus"]
    small_data["controller"]["gamma"] = 1.0
    fresh = Simulation(build_trace(small_data)).run(["nereus"])["nereus"]
    assert _latencies(shared) == _latencies(fresh)
    assert base.trace.controller["gamma"] == 0.5  # the base is unchanged


def test_unknown_policy_is_rejected_with_the_valid_names(small_trace):
    with pytest.raises(PolicyError, match="nereus"):
        Simulation(small_trace).run(["nerues"])
    with pytest.raises(SystemExit):
        simulate.main(["paper_drift", "--policies", "nerues", "--no-plot"])


def _nereus_at(data, gamma):
    data = {**data, "controller": {**data["controller"], "gamma": gamma}}
    return Simulation(build_trace(data)).run(["nereus"])["nereus"].summary()


@pytest.mark.xfail(strict=True, reason="simulated: gamma 0.5, 1, 2 and infinity make the same 5 transitions here "
                   "(31.1 s/step): the one non-urgent move admitted is a pool growth predicted to gain 19.2 s/step "
                   "for 5.2 s of transition, and the one soft trigger (length, step 5) finds no gain, so there is "
                   "no marginal move for a large gamma to admit (the paper: gamma = 1 made 14 transitions and a "
                   "slower run)")
def test_large_gamma_makes_more_transitions_and_loses_time(small_data):
    mid, large = _nereus_at(small_data, 0.5), _nereus_at(small_data, 1.0)
    assert large["transitions"] > mid["transitions"]
    assert large["mean_step_s"] > mid["mean_step_s"]
