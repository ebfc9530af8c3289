"""Async (one-step-off) policies in the simulator: the interval between weight syncs priced by hand from the
ground truth, actor-gen kept on its own devices, async never slower than sync for one disjoint plan, the
baseline's pinned layouts, actor-gen sized for the batch in flight, the async oracle (a brute-force reference on
a short trace, a lower bound of every policy), determinism, and the command line's labelled JSON."""

import itertools
import json

import pytest
import yaml

from nereus_jax import simulate
from nereus_jax.elastic.costs import counts
from nereus_jax.elastic.planner import critical_path
from nereus_jax.elastic.topology import gen_sizes
from nereus_jax.sim import ASYNC_POLICIES, SimPlan, Simulation, build_trace, load_trace
from nereus_jax.sim.asynchronous import (
    Batches,
    async_oracle,
    oracle_candidates,
    oracle_models,
    oracle_record,
)
from nereus_jax.sim.model import plan_peak_memory
from nereus_jax.sim.records import StepRecord

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
    return SimPlan.build(dict(plan.choices), plan.plan, plan.topology)


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
    """Every overlapped plan keeps actor-gen on devices of its own; async_nereus always finds one. The pinned
    baseline may fall back to a synchronous plan when its layouts stop fitting (scoring runs on the
    training units' layout, so pinning training pins scoring too): counted in ``sync_fallback_steps``."""
    sim, runs = async_runs
    for name, run in runs.items():
        fallbacks = 0
        for r in run.records:
            gen = set(r.plan.plan[next(ms for ms in r.plan.plan if str(ms) == GEN)].devices)
            others = {d for ms, sp in r.plan.plan.items() if str(ms) != GEN for d in sp.devices}
            assert (r.plan.overlapped and not gen & others) or name != "async_nereus", (name, r.step)
            fallbacks += not r.plan.overlapped
            assert set(r.plan.devices) <= set(sim.trace.pool(r.step)), (name, r.step)
        assert run.summary()["sync_fallback_steps"] == fallbacks


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


def _observe(model, *workloads):
    for wl in workloads:
        model.observed = wl
    return model


def test_the_batch_in_flight_is_the_last_observed_grown_twice_by_the_last_observed_growth(short_data):
    sim = Simulation(build_trace(short_data))
    wl = sim.trace.workload(2)
    r = wl.response_length
    grown = wl.with_response_length(r.scaled(1.1))
    assert _observe(sim.model(asynchronous=True), wl).in_flight(wl) == wl  # one observation: no trend yet
    ahead = _observe(sim.model(asynchronous=True), wl, grown).in_flight(grown).response_length
    assert ahead.mean == pytest.approx(r.mean * 1.1 * 1.1 ** 2, rel=1e-9)
    assert ahead.max == pytest.approx(r.max * 1.1 ** 3, abs=2)
    assert _observe(sim.model(asynchronous=True), grown, wl).in_flight(wl) == wl  # shrinking: never below observed


def test_an_overlapped_plans_memory_counts_actor_gen_at_the_batch_in_flight(short_data):
    """The memory trigger and the planner see actor-gen holding the batch in flight, the rest the observed one."""
    sim = Simulation(build_trace(short_data))
    plan = sim.initial_plan(asynchronous=True)
    wl = sim.trace.workload(1)
    grown = wl.with_response_length(wl.response_length.scaled(4.0))  # actor-gen then holds the most
    model = _observe(sim.model(asynchronous=True), sim.trace.workload(0), wl)
    ahead = model.in_flight(wl)
    assert ahead.response_length.mean > wl.response_length.mean
    cm = model.cost_model
    by_hand = plan_peak_memory(plan, wl, lambda s, c: cm.stage_memory(sim.cfg(s), s, c, ahead if s == GEN else wl))
    assert model.peak_memory(plan, wl) == pytest.approx(by_hand, rel=1e-12)
    assert model.peak_memory(plan, Batches(wl, grown)) > model.peak_memory(plan, Batches(wl, wl))


@pytest.fixture(scope="module")
def short_oracle(short_data):
    """Every async policy, sync nereus and the sync oracle on the short trace, then the async oracle over them."""
    sim = Simulation(build_trace(short_data))
    runs = sim.run([*ASYNC_POLICIES, "nereus", "oracle"])
    return sim, runs, async_oracle(sim, list(runs.values()))


def test_async_oracle_is_a_lower_bound_of_every_policy_sync_and_async(short_oracle):
    _, runs, oracle = short_oracle
    assert oracle.summary()["transitions"] == 0 and oracle.summary()["oom_events"] == 0
    for name, run in runs.items():
        assert oracle.total_s <= run.total_s * (1 + 1e-12), name


def test_async_oracle_pays_a_fill_exactly_when_an_overlapped_plan_follows_a_colocated_one(short_oracle):
    sim, _, oracle = short_oracle
    generated = False
    for r in oracle.records:
        assert (r.fill_s > 0) == (r.plan.overlapped and not generated), r.step
        assert r.latency_s == sim.measure_step(r.plan, r.step, generated=generated and not r.plan.overlapped)[0]
        generated = r.plan.overlapped


def test_async_oracle_equals_brute_force_over_its_candidates_on_a_three_step_trace(small_module_data):
    data = {**small_module_data, "steps": 3, "pool": [{"step": 0, "devices": 4}, {"step": 2, "devices": 8}]}
    sim = Simulation(build_trace(data))
    models = oracle_models(sim)
    cands = [oracle_candidates(sim, step, (), models) for step in range(3)]
    assert any(p.overlapped for c in cands for p in c) and any(not p.overlapped for c in cands for p in c)

    def total(seq):
        generated, out = False, 0.0
        for step, p in enumerate(seq):
            r = oracle_record(sim, p, step, generated, StepRecord)
            out, generated = out + r.latency_s + r.fill_s, p.overlapped
        return out

    best = min(total(seq) for seq in itertools.product(*cands))
    assert async_oracle(sim).total_s == pytest.approx(best, rel=1e-12)


@pytest.fixture(scope="module")
def drift_async():
    """The paper-shaped drift trace: async policies, sync nereus and the async oracle (slow: ~2 min on 2 shared
    cores)."""
    sim = Simulation(load_trace("paper_drift"))
    runs = sim.run(["async_fixed", "async_nereus", "nereus"])
    runs["async_oracle"] = async_oracle(sim, list(runs.values()))
    return {name: run.summary() for name, run in runs.items()}


@pytest.mark.slow
@pytest.mark.long  # ~3 min of simulation, shared with the next test
def test_paper_drift_async_nereus_beats_the_async_baseline_and_nothing_runs_out_of_memory(drift_async):
    p = drift_async
    assert p["async_nereus"]["mean_step_s"] < p["async_fixed"]["mean_step_s"]
    # actor-gen sized for the batch in flight (planned for the last observed batch, both ran out once at step 5)
    assert p["async_nereus"]["oom_events"] == p["async_fixed"]["oom_events"] == 0
    assert p["async_nereus"]["sync_fallback_steps"] == 4  # steps 0-3: 8 A100s cannot split PPO's 8B models
    assert p["async_oracle"]["mean_step_s"] <= min(p[n]["mean_step_s"] for n in ("async_fixed", "async_nereus",
                                                                                "nereus"))


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.xfail(strict=True, reason="simulated: async_nereus is 0.5% faster than async_fixed on paper_drift "
                   "(322.1 vs 323.5 s/step), not 37.3%; the async oracle is 26.1% faster (239.2) only by running a "
                   "colocated synchronous plan in 23 of 26 intervals (sync nereus: 248.5 s/step): actor-gen scales "
                   "with mean length under this ground truth, so giving it devices of its own slows training more "
                   "than the overlap saves (nereus_jax/sim/asynchronous.py says why Laminar differs)")
def test_paper_drift_async_nereus_is_at_least_37_3pct_faster_than_the_async_baseline(drift_async):
    p = drift_async
    assert p["async_nereus"]["mean_step_s"] <= (1 - 0.373) * p["async_fixed"]["mean_step_s"]
