"""The controller in the job's loop: a device leaving mid-run moves the job onto the remaining devices
without losing or repeating a sample, and the steps after the move compute exactly what a job restarted
on the smaller pool computes; an announced leave is compiled ahead, so the move is data movement only."""

import numpy as np
import pytest
from jobs import tiny_job
from plans import units_from_host

from nereus_jax.elastic.controller import UNCERTAINTY_Z, Observation
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.model_stage import ModelStage
from nereus_jax.runtime.control.adapt import Adapter
from nereus_jax.runtime.control.job_pricer import compile_by_stage, partial_moves
from nereus_jax.sharding import Layout

STEPS = 4


def _run(job, adapter, steps, first=0):
    out, metrics = [], None
    for s in range(first, first + steps):
        if adapter is not None:
            adapter.boundary(s, metrics)
        r = job.step(s)
        metrics = r.metrics
        out.append(r)
    return out


@pytest.fixture(scope="module")
def device_leaves():
    """8 devices; devices 6 and 7 leave at step 2 without notice (the urgent path)."""
    job = tiny_job(["cluster.schedule=[{step: 2, leave: [6, 7]}]"])
    first_plan = job.plan
    adapter = Adapter(job, log=lambda _: None)
    try:
        results = _run(job, adapter, STEPS)
    finally:
        adapter.close()
    return job, adapter, results, first_plan


def test_a_device_leaving_moves_the_job_off_it_and_loses_no_sample(device_leaves):
    job, adapter, results, first_plan = device_leaves
    moves = [e for e in adapter.events if e["event"] == "transition"]
    assert [e["step"] for e in moves] == [2] and adapter.transitions == 1
    decision = next(e for e in adapter.events if e["event"] == "decision")
    assert decision["urgent"] and decision["admitted"] and decision["trigger"] == "pool"
    assert {6, 7} <= set(first_plan.devices) and not {6, 7} & set(job.plan.devices)
    # every prompt of steps 0..3 was used exactly once, each with all its samples
    b, n = job.cfg.trainer.prompts_per_step, job.n
    positions = np.concatenate([r.batch.prompt_index_b for r in results])
    samples = np.concatenate([r.batch.sample_index_b for r in results])
    assert sorted(zip(positions.tolist(), samples.tolist(), strict=True)) == \
        [(p, k) for p in range(STEPS * b) for k in range(n)]


def test_the_controller_is_offered_the_plan_fast_by_what_the_job_measured(device_leaves, monkeypatch):
    """Beside the planner's fastest plans, the job's candidates hold the best plan under the options as
    ``Pricing.risk_adjusted`` ranks them (seconds plus the extrapolation sd of the layouts the job has not
    measured), unless the planner's best already runs only measured layouts (then that search would find it
    again). Here the ranking is replaced by its reverse, so that plan is one the plain planner never offers;
    reference: the planner's plan on those options."""
    job, adapter, _, _ = device_leaves
    pricer = adapter.pricer
    assert pricer.pricing.measured_layouts  # the job measured its stages

    def reverse(options, z):
        assert z == UNCERTAINTY_Z
        return {s: o.ranked_by(-o.latency) for s, o in options.items()}

    monkeypatch.setattr(pricer.pricing, "risk_adjusted", reverse)
    devices = tuple(range(6))
    obs = Observation(step=STEPS, plan=job.plan, devices=devices, response_length=4.0)
    plain = pricer.planner.plan(pricer.pricing.models, job.cfg.algorithm.name, pricer.workload, devices,
                                topology=pricer.topology)
    slow = pricer.planner.plan(pricer.pricing.models, job.cfg.algorithm.name, pricer.workload, devices,
                               topology=pricer.topology, options=lambda p: reverse(p.options(), UNCERTAINTY_Z)).plan
    assert slow not in {plain.plan, *(r.plan for r in plain.runners_up)}
    assert pricer.pricing.all_measured(pricer.pricing.choices(plain.plan, pricer.workload))  # tp 1 everywhere
    assert slow not in {c.plan for c in pricer.candidates(obs)}  # no second search
    monkeypatch.setattr(pricer.pricing, "all_measured", lambda choices: False)  # as if it extrapolated
    assert slow in {c.plan for c in pricer.candidates(obs)}


def test_steps_after_the_move_match_a_restart_on_the_smaller_pool(device_leaves):
    """Reference: a job started on the plan the controller moved to, given the moved job's state as it was
    at the boundary (a restart from host memory), runs the same two steps: the live transition moved every
    byte exactly, so tokens and metrics are bit-identical (tolerance: 0)."""
    job, _, results, _ = device_leaves
    before = tiny_job()
    _run(before, None, 2)  # the state at the boundary: two steps on the full pool
    ref = tiny_job(plan=job.plan)
    for ms in before.units:
        ref.units[ms] = units_from_host(ref, ms, before.stage_host_state(ms))
    ref.version = before.version
    ref.adopt(ref.plan, ref.units)
    for got, want in zip(results[2:], _run(ref, None, 2, first=2), strict=True):
        np.testing.assert_array_equal(got.batch.response_br, want.batch.response_br)
        for key in ("reward_mean", "kl", "loss", "policy_loss", "value_loss", "response_length_mean"):
            assert got.metrics[key] == want.metrics[key], key


def test_an_announced_leave_is_compiled_ahead_and_the_move_is_data_movement_only():
    """With notice, the target's programs and engines are built on a background thread while the old plan
    keeps stepping; the step after the move compiles nothing new."""
    job = tiny_job(["cluster.schedule=[{step: 5, leave: [7], notice: 4}]"])
    adapter = Adapter(job, log=lambda _: None)
    try:
        metrics = None
        for s in range(6):
            adapter.boundary(s, metrics)
            if adapter.pending is not None:
                adapter.pending.future.result()  # deterministic: the compile finishes before the next boundary
            before, engines = dict(job.stages.programs), list(job.rollout.engines)
            metrics = job.step(s).metrics
            if adapter.transitions:
                break
    finally:
        adapter.close()
    move = next(e for e in adapter.events if e["event"] == "transition")
    assert move["compile_hidden"] and move["wait_for_compile_s"] < 0.05 and move["step"] < 5
    assert 7 not in job.plan.devices
    # the step after the move built nothing
    assert job.stages.programs == before and list(job.rollout.engines) == engines


def test_a_predicted_memory_violation_is_an_urgent_trigger_toward_a_plan_that_fits():
    """cluster.device_memory_bytes below the current plan's predicted peak (past the memory trigger, halfway
    between the cap less the headroom and the cap): the controller admits, without the profitability test,
    a plan whose predicted peak per device fits the cap less the headroom, and the move runs at the next
    boundary (it does not wait for a compile to finish in the background)."""
    job = tiny_job(["cluster.device_memory_bytes=20168352", "controller.memory_headroom=0.0"])
    adapter = Adapter(job, log=lambda _: None)
    try:
        metrics = None
        for s in range(3):
            adapter.boundary(s, metrics)
            if s < 2:
                metrics = job.step(s).metrics
        pricer = adapter.pricer
        assert pricer.peak_bytes(job.plan) > pricer.pricing.trigger_bytes(20168352) == pricer.memory_cap_bytes
        decision = next(e for e in adapter.events if e["event"] == "decision")
        assert decision["trigger"] == "memory" and decision["urgent"] and decision["admitted"], \
            (decision["reason"], decision["rejected"])
        target = adapter.pending.target
        assert pricer.peak_bytes(target) <= pricer.memory_cap_bytes and adapter.pending.wait
        adapter.boundary(3, job.step(2).metrics)  # urgent: moved at the next boundary, compiled or not
        assert adapter.transitions == 1 and adapter.job.plan == target
    finally:
        adapter.close()


def test_a_device_in_use_leaving_with_no_live_transition_fails_naming_the_restart():
    """A leave the controller cannot plan around (here it is given no candidate) stops the job with the
    restart command instead of letting it run on devices that are gone."""
    from nereus_jax.runtime.control.adapt import LiveTransitionError

    job = tiny_job(["cluster.schedule=[{step: 1, leave: [1, 2, 3, 4, 5, 6, 7]}]", "plan.stages.actor-gen.dp=1"])
    adapter = Adapter(job, log=lambda _: None)
    adapter.controller.plan_fn = lambda obs: []  # nothing reaches the 1-device pool
    try:
        adapter.boundary(0, None)
        metrics = job.step(0).metrics
        with pytest.raises(LiveTransitionError, match=r"devices \[1, 2, 3, 4, 5, 6, 7\] left .*resume_from"):
            adapter.boundary(1, metrics)
    finally:
        adapter.close()


def test_a_move_of_one_model_stage_keeps_the_others_programs_and_engines_and_prices_only_its_compile():
    """A move that changes ref-infer alone compiles ref-infer's programs only (actor-gen keeps its engines,
    actor-train its programs) and is priced with ref-infer's measured compile; the step after it generates
    the tokens and computes the losses of a job that did not move."""
    moved, still = tiny_job(), tiny_job()
    adapter = Adapter(moved, log=lambda _: None)
    try:
        metrics = None
        for s in range(3):
            adapter.boundary(s, metrics)
            metrics = moved.step(s).metrics
            still.step(s)
        by_stage = adapter.pricer.stage_compile_s
        assert set(by_stage) == {str(ms) for ms in moved.plan} and all(v > 0 for v in by_stage.values())
        ref = next(ms for ms in moved.plan if str(ms) == "ref-infer")
        gen = next(ms for ms in moved.plan if str(ms) == "actor-gen")
        src = moved.plan[ref]
        target = ExecutionPlan({**moved.plan, ref: StagePlan(src.layout, src.replicas[:len(src.replicas) // 2])})
        assert partial_moves(moved.plan, target) == [target]
        priced = adapter.pricer.transition_seconds(moved.plan, target)
        assert priced.seconds == pytest.approx(adapter.pricer.movement_s(priced.move) + by_stage["ref-infer"])
        engines, programs = list(moved.rollout.engines), dict(moved.stages.programs)
        adapter.request(target, wait=True)
        prepared = adapter.pending.future.result()
        assert prepared.engines is None and {key[1] for key in prepared.programs} == {ref}
        adapter.boundary(3, metrics)
        assert moved.plan == target and list(moved.rollout.engines) == engines and moved.plan[gen] == still.plan[gen]
        assert all(moved.stages.programs[k] is v for k, v in programs.items() if k[1] != ref)
        a, b = moved.step(3), still.step(3)
    finally:
        adapter.close()
    np.testing.assert_array_equal(a.batch.response_br, b.batch.response_br)
    np.testing.assert_array_equal(a.batch.behaviour_logp_br, b.batch.behaviour_logp_br)
    losses = [k for k in b.metrics if "loss" in k or k == "kl"]
    assert losses
    np.testing.assert_allclose([a.metrics[k] for k in losses], [b.metrics[k] for k in losses], rtol=1e-6, atol=1e-7)


def test_compile_seconds_go_to_the_model_stage_whose_programs_a_stage_runs():
    plan = ExecutionPlan({ms: StagePlan(Layout(1, 1), ((0,),)) for ms in
                          (ModelStage("actor", "gen"), ModelStage("actor", "train"), ModelStage("ref", "infer"))})
    compiling = {"actor-gen": 5.0, "actor-infer": 1.0, "actor-train": 3.0, "ref-infer": 0.75, "reward": 0.2,
                 "weight-sync": 0.5}
    steady = {"actor-gen": 1.0, "actor-infer": 0.5, "actor-train": 1.0, "ref-infer": 1.0, "reward": 0.1,
              "weight-sync": 0.1}
    assert compile_by_stage(compiling, steady, plan) == {"actor-gen": 4.0, "actor-train": 2.5, "ref-infer": 0.0}
