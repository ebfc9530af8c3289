"""Async (one-step-off) policies in the simulator: the interval between weight syncs priced by hand from the
ground truth, actor-gen kept on its own devices, async never slower than sync for one disjoint plan, the
baseline's pinned layouts, determinism, and the command line's labelled JSON."""

import json

import pytest
import yaml

from nereus_jax import simulate
from nereus_jax.elastic.costs import counts
from nereus_jax.elastic.planner import critical_path
from nereus_jax.sim import ASYNC_POLICIES, SimPlan, Simulation, build_trace, load_trace
from nereus_jax.sim.asynchronous import gen_sizes

GEN = "actor-gen"


@pytest.fixture(scope="module")
def short_data(small_module_data):
    small_module_data["steps"] = 6  # keyframes past the last step still shape the trace
    return small_module_data


@pytest.fixture(scope="module")
def async_runs(short_data):
    sim = Simulation(build_trace(short_data))
    return sim, sim.run(list(ASYNC_POLICIES))


def _as_sync(plan: SimPlan) -> SimPlan:
    """The same choices on the same devices, run synchronously (generation, then scoring and training)."""
    return SimPlan.build(dict(plan.choices), plan.plan, plan.phases)


def _sync_by_hand(sim: Simulation, plan: SimPlan) -> float:
    """Seconds of the weight sync: the actor's tp shard per generator device in the compute dtype, over
    the link between generator and trainer (one node: intra, else inter), at the truth's link speed."""
    actor, node = sim.models["actor"], sim.hw.devices_per_node
    nbytes = counts.params_per_device(actor, plan.choice(GEN).tp, 1) * counts.dtype_bytes(actor.compute_dtype)
    devices = {d for ms, sp in plan.plan.items() if str(ms) in (GEN, "actor-train") for d in sp.devices}
    return sim.truth.link_seconds("intra" if len({d // node for d in devices}) == 1 else "inter", nbytes)


def test_async_step_is_max_of_next_generation_and_this_steps_training_plus_the_weight_sync(short_data):
    sim = Simulation(build_trace(short_data))
    plan = sim.initial_plan(asynchronous=True)
    truth, last = sim.truth, sim.trace.steps - 1
    for step in (0, 2, last):
        wl = sim.trace.workload(step)
        rest = {s: truth.stage_seconds(sim.cfg(s), s, c, wl, step) for s, c in plan.choices if s != GEN}
        rest_s = critical_path({**rest, GEN: 0.0}, set(_as_sync(plan).edges))  # scoring, then training
        gen_s = 0.0 if step == last else truth.stage_seconds(
            sim.cfg(GEN), GEN, plan.choice(GEN), sim.trace.workload(step + 1), step + 1)
        assert sim.measure_step(plan, step)[0] == pytest.approx(max(gen_s, rest_s) + _sync_by_hand(sim, plan),
                                                                rel=1e-12)


def test_async_plans_keep_actor_gen_off_every_other_stages_devices(async_runs):
    sim, runs = async_runs
    for name, run in runs.items():
        for r in run.records:
            gen = set(r.plan.plan[next(ms for ms in r.plan.plan if str(ms) == GEN)].devices)
            others = {d for ms, sp in r.plan.plan.items() if str(ms) != GEN for d in sp.devices}
            assert r.plan.overlapped and not gen & others, (name, r.step)
            assert set(r.plan.devices) <= set(sim.trace.pool(r.step)), (name, r.step)


def test_async_is_never_slower_than_sync_for_the_same_fixed_disjoint_plan(short_data):
    """Over the trace: gen(0) + sum_g max(gen(g+1), rest(g)) <= sum_g gen(g) + rest(g), same noise."""
    sim = Simulation(build_trace(short_data))
    plan = sim.initial_plan(asynchronous=True)
    wl0 = sim.trace.workload(0)
    async_total = sim.truth.stage_seconds(sim.cfg(GEN), GEN, plan.choice(GEN), wl0, 0)  # pipeline fill
    sync_total = 0.0
    for step in range(sim.trace.steps):
        interval = sim.measure_step(plan, step)[0]
        step_sync = sim.measure_step(_as_sync(plan), step)[0] + _sync_by_hand(sim, plan)
        async_total += interval
        sync_total += step_sync
    assert async_total <= sync_total
    assert async_total < 0.95 * sync_total  # and the overlap is worth something on this trace


def test_async_fixed_keeps_the_first_disjoint_plans_layouts(async_runs):
    sim, runs = async_runs
    first = sim.first_disjoint_plan().layouts()
    assert all(r.plan.layouts() == first for r in runs["async_fixed"].records if r.plan.overlapped)
    assert runs["async_fixed"].records[0].fill_s > 0  # batch 0 is generated before anything overlaps


def test_async_runs_are_deterministic_for_a_seed(short_data, async_runs):
    _, runs = async_runs
    again = Simulation(build_trace(short_data)).run(["async_nereus"])["async_nereus"]
    first = runs["async_nereus"]
    assert [(r.latency_s, r.transition_s, r.wasted_s, r.fill_s, r.plan) for r in again.records] == \
        [(r.latency_s, r.transition_s, r.wasted_s, r.fill_s, r.plan) for r in first.records]


def test_command_line_compares_async_policies_and_labels_the_output_simulated(short_data, tmp_path, capsys):
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(short_data))
    simulate.main([str(path), "--policies", "async_fixed,async_nereus", "--json", "--no-plot"])
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"] is True and out["hardware"] == "a100"
    assert set(out["policies"]) == set(ASYNC_POLICIES)
    reduction = out["comparison"]["async_nereus_reduction_vs_async_fixed"]
    fixed, ours = (out["policies"][p]["mean_step_s"] for p in ASYNC_POLICIES)
    assert reduction == pytest.approx(1 - ours / fixed)


def test_generator_splits_are_eighths_of_the_pool_in_whole_nodes_once_it_has_two():
    assert gen_sizes(4, 4) == [1, 2, 3]
    assert gen_sizes(8, 4) == [4]
    assert gen_sizes(32, 4) == [4, 8, 12, 16, 20, 24, 28]
    assert gen_sizes(1024, 8) == [128 * k for k in range(1, 8)]
    assert gen_sizes(1, 4) == []


def test_a_pool_too_small_for_a_split_runs_colocated_and_says_so():
    """8 A100s of 64 GB cannot hold PPO's 8B training state on fewer than 8: paper_drift's first steps."""
    sim = Simulation(load_trace("paper_drift", {"steps": 1}))
    run = sim.run(["async_nereus"])["async_nereus"]
    assert not run.records[0].plan.overlapped and run.summary()["sync_fallback_steps"] == 1
    assert run.records[0].fill_s == 0.0


@pytest.fixture(scope="module")
def drift_async():
    """The paper-shaped drift trace, async policies and sync nereus (slow: ~30 s on 2 shared cores)."""
    return simulate.main(["paper_drift", "--policies", "async_fixed,async_nereus,nereus", "--json", "--no-plot"])


@pytest.mark.slow
def test_paper_drift_async_nereus_beats_the_async_baseline_and_never_runs_out_of_memory_twice(drift_async):
    p = drift_async["policies"]
    assert p["async_nereus"]["mean_step_s"] < p["async_fixed"]["mean_step_s"]
    assert p["async_nereus"]["oom_events"] <= 1  # one measured: the plan is chosen for the last observed batch
    assert p["async_nereus"]["sync_fallback_steps"] == 4  # steps 0-3: 8 A100s cannot split PPO's 8B models


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="simulated: async_nereus is ~3.9% faster than async_fixed on paper_drift "
                   "(~0.9% on paper_1024), not 37.3%: generation is ~15-25% of a step under this ground truth, "
                   "so splitting it off and re-planning around it gains little")
def test_paper_drift_async_nereus_is_at_least_37_3pct_faster_than_the_async_baseline(drift_async):
    p = drift_async["policies"]
    assert p["async_nereus"]["mean_step_s"] <= (1 - 0.373) * p["async_fixed"]["mean_step_s"]
