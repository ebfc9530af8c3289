"""One move path (nereus_jax.runtime.step.move): the ledger is the truth about a moving job's memory, a failed
move gives the job its state back, bad input changes nothing, and a device failing mid-step lands on the
plan a device leaving with notice gets.

Memory is measured as the allocator sees it on CPU: every live buffer (``jax.live_arrays()``, each
buffer once, by device and pointer, under the ledger's key for its memory kind), after every dispatch
and every completion of a step. Buffers alive before the move that are not the job's state (engines'
KV caches, their parameter copies, compiled constants) are outside the ledger by design and left out;
everything else counts, whoever references it (the job, a sibling replica's whole-state arrays, the
executor).
"""

import gc
import random

import jax
import numpy as np
import pytest
from jobs import TINY_JOB
from plans import host_state, random_plan

from nereus_jax.config import load_config
from nereus_jax.elastic.emu import assemble_replicas, split_replicas
from nereus_jax.elastic.executor import TransitionExecutor, TransitionFailed
from nereus_jax.elastic.graph import TransitionGraph, plan_usage
from nereus_jax.elastic.ledger import key
from nereus_jax.elastic.plan import DEVICE, ExecutionPlan, StagePlan
from nereus_jax.elastic.recipe import align_ranks
from nereus_jax.elastic.schedule import Infeasible
from nereus_jax.model_stage import ACTOR_GEN, REF_INFER
from nereus_jax.rl.tasks import make_task
from nereus_jax.rl.tokenizer import CharTokenizer
from nereus_jax.runtime.control.adapt import Adapter
from nereus_jax.runtime.control.recovery import training_snapshot
from nereus_jax.runtime.durability.checkpoint import CheckpointError
from nereus_jax.runtime.step.job import Job, JobError, Prepared
from nereus_jax.runtime.step.move import InMove, move
from nereus_jax.sharding import Layout, device_index

BASE = TINY_JOB
PAIRS = 6  # feasible random plan pairs in the memory test


def _job(overrides=()):
    cfg = load_config(None, BASE + list(overrides))
    return Job(cfg, make_task(cfg.task), CharTokenizer())


def _live(exclude=frozenset()) -> dict[tuple[int, int], int]:
    """(ledger key, buffer pointer) -> bytes of every live buffer, each once, except ``exclude``."""
    out = {}
    for x in jax.live_arrays():
        try:
            memory = x.sharding.memory_kind or DEVICE
            shards = [(key(device_index(s.device), memory), s.data.unsafe_buffer_pointer(), s.data.nbytes)
                      for s in x.addressable_shards]
        except RuntimeError:  # deleted meanwhile
            continue
        for k, pointer, nbytes in shards:
            if (k, pointer) not in exclude:
                out[k, pointer] = nbytes
    return out


def _state(job) -> dict[tuple[int, int], int]:
    """The buffers of the job's units, as :func:`_live` keys them."""
    out = {}
    for units in job.units.values():
        for u in units:
            for x in u.leaves:
                memory = x.sharding.memory_kind or DEVICE
                for s in x.addressable_shards:
                    out[key(device_index(s.device), memory), s.data.unsafe_buffer_pointer()] = s.data.nbytes
    return out


def _per_key(buffers) -> dict[int, int]:
    out: dict[int, int] = {}
    for (k, _), n in buffers.items():
        out[k] = out.get(k, 0) + n
    return out


def _as_trained(job) -> None:
    """Each training stage's replicas as a training step leaves them: views of one whole-state array per
    leaf (``split_replicas``), so a replica's arrays also reach every sibling's buffers."""
    for ms in job.plan:
        if ms.kind == "train":
            leaves, mesh = assemble_replicas(job.units[ms])
            job.units[ms] = split_replicas(leaves, mesh, ms, job.unit_spec(ms))


def _assert_same_state(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for ms in a:
        for x, y in zip(a[ms], b[ms], strict=True):
            np.testing.assert_array_equal(x, y, err_msg=str(ms))


@pytest.fixture(scope="module")
def job():
    return _job()


def test_live_bytes_never_exceed_the_ledger_or_a_cap_during_a_move(job):
    """Random plan pairs under tight per-device caps (1.0-1.15x the larger plan's footprint), each move
    run by ``move`` on the job as a training step leaves it. Reference: the executor's ledger, which the
    graph was scheduled to keep under the caps. Every live buffer that is not outside the ledger by design
    counts, whoever holds it; live arrays do not show XLA's scratch space (the workspace estimate covers
    that), so the bound here is the ledger itself: per ledger key, live <= ledger, and on a device live <=
    cap, after every dispatch and every completion. After the move only the new plan's bytes are alive,
    and every model-stage holds the state it held before."""
    rng = random.Random(19)
    worst = {"over_ledger": 0, "over_cap": -1.0, "samples": 0}
    pairs = tries = 0
    while pairs < PAIRS:
        tries += 1
        assert tries < 60, "too few feasible random plan pairs"
        target = align_ranks(job.plan, random_plan(rng, job))
        old_use, new_use = plan_usage(job.plan, job.specs), plan_usage(target, job.specs)
        cap = int(max(*old_use.values(), *new_use.values()) * rng.uniform(1.0, 1.15))
        try:
            graph = TransitionGraph.build(job.plan, target, job.specs, caps=cap)
        except Infeasible:
            continue
        pairs += 1
        _as_trained(job)
        want = host_state(job)
        gc.collect()  # what is alive now is referenced: nothing outside the state is freed during the move
        state = _state(job)
        outside = frozenset(_live().keys() - state.keys())
        samples = []

        def monitor(event, step, ledger, samples=samples, outside=outside):
            live = _live(outside)
            samples.append((event, step.sid, _per_key(live), dict(ledger.used), set(live)))

        move(job, graph, executor=TransitionExecutor(monitor=monitor))
        assert job.plan == target and not any(isinstance(us, InMove) for us in job.units.values())
        assert len(samples) == 2 * len(graph.steps)
        # the executor's end: exactly the new units' buffers are alive, exactly the new plan's bytes booked
        *_, live, booked, buffers = samples[-1]
        assert buffers == set(_state(job)), "a buffer other than the new plan's outlived the move"
        assert {k: n for k, n in live.items() if n} == {k: n for k, n in booked.items() if n} == \
            {k: n for k, n in graph.final_usage().items() if n}
        for event, sid, live, booked, _ in samples:
            for k, n in live.items():
                assert n <= booked.get(k, 0), (f"pair {pairs}, after s{sid} {event}: key {k} holds {n} B live, "
                                               f"the ledger {booked.get(k, 0)} B")
                assert k < 0 or n <= cap, f"pair {pairs}, after s{sid} {event}: device {k} holds {n} B, cap {cap}"
            worst["over_ledger"] = max(worst["over_ledger"], *(n - booked.get(k, 0) for k, n in live.items()))
            worst["over_cap"] = max(worst["over_cap"], *(n / cap - 1 for k, n in live.items() if k >= 0))
            worst["samples"] += 1
        _assert_same_state(host_state(job), want)
    print(f"memory truth over {pairs} pairs ({tries} drawn), {worst['samples']} samples: live - ledger max "
          f"{worst['over_ledger']} B, live / cap - 1 max {worst['over_cap']:+.1%}")


def test_a_move_that_fails_gives_the_job_its_state_back_on_its_plan(job):
    """A failure half-way (injected at each third step): TransitionFailed reaches the caller, and the job
    holds its old plan's replicas with the state it had (reference: the state before the move)."""
    plan = job.plan
    target = align_ranks(plan, ExecutionPlan({ms: StagePlan.contiguous(Layout(2), 2, first=4 if ms == ACTOR_GEN else 0)
                                              for ms in plan}))
    graph = TransitionGraph.build(plan, target, job.specs)
    want = host_state(job)
    for step in graph.steps[1::3]:
        _as_trained(job)
        with pytest.raises(TransitionFailed):
            move(job, graph, executor=TransitionExecutor(fail_at=step.sid))
        assert job.plan == plan
        for ms, sp in plan.items():
            assert [u.device_ids for u in job.units[ms]] == list(sp.replicas), (step.sid, ms)
            assert all(u.layout == sp.layout and u.memory == sp.memory for u in job.units[ms])
        _assert_same_state(host_state(job), want)


def test_bad_input_raises_before_anything_moves(job):
    plan, units = job.plan, {ms: list(us) for ms, us in job.units.items()}
    elsewhere = ExecutionPlan({ms: StagePlan.contiguous(Layout(4, 2), 1) if ms == REF_INFER else sp
                               for ms, sp in plan.items()})
    with pytest.raises(ValueError, match="ref-infer: the graph starts from .* which the job does not hold"):
        move(job, TransitionGraph.build(elsewhere, plan, job.specs))
    odd = ExecutionPlan({ms: StagePlan.contiguous(Layout(1), 3) if ms == REF_INFER else sp for ms, sp in plan.items()})
    with pytest.raises(JobError, match="do not split over dp=3"):
        move(job, TransitionGraph.build(plan, odd, job.specs))
    ref_only = ExecutionPlan({REF_INFER: plan[REF_INFER]})
    with pytest.raises(ValueError, match="changes ref-infer's layout .* a layout change moves the whole plan"):
        move(job, TransitionGraph.build(ref_only, ExecutionPlan({REF_INFER: StagePlan.contiguous(Layout(2), 4)}),
                                        job.specs))
    assert job.plan == plan
    assert all(a is b for ms in units for a, b in zip(job.units[ms], units[ms], strict=True))


def test_a_planned_move_that_fails_leaves_the_job_on_its_plan(job, monkeypatch):
    """The adapter's move fails half-way (the executor's first run fails at its third step): the failure is
    logged as an event, the job keeps its plan and state (reference: before the move), and no move is pending."""
    from nereus_jax.runtime.step import move as move_module

    runs = []

    class FailFirst(TransitionExecutor):
        def __init__(self, **kw):
            runs.append(1)
            super().__init__(**kw, **({"fail_at": 2} if len(runs) == 1 else {}))

    monkeypatch.setattr(move_module, "TransitionExecutor", FailFirst)
    monkeypatch.setattr(job, "prepare", lambda plan: Prepared(plan, {}, [], 0.0))  # never adopted: it fails
    plan, want = job.plan, host_state(job)
    adapter = Adapter(job, log=lambda _: None)
    try:
        adapter.request(ExecutionPlan({ms: StagePlan.contiguous(Layout(2), 2, first=4 * (ms == ACTOR_GEN))
                                       for ms in plan}))
        adapter.pending.future.result()
        adapter.boundary(0, None)
    finally:
        adapter.close()
    assert [e["event"] for e in adapter.events] == ["transition_failed"] and "s2" in adapter.events[0]["error"]
    assert adapter.pending is None and adapter.transitions == 0 and job.plan == plan
    _assert_same_state(host_state(job), want)


def test_a_device_failing_mid_step_gets_the_plan_a_device_leaving_with_notice_gets():
    """Two adapters fed the same measured steps: one told at step 2 that devices 6 and 7 leave at step 3
    (notice), one whose job loses them during step 2. Both ask the controller's urgent path for the same
    pool, so both land on the same plan (ranks aligned); the failed one is moved there from its surviving
    units, live. A third loses devices 0 and 1, every actor-gen replica: no live move exists, so it falls
    back to the checkpoint (none here: the error names the fix). Training replicas hold whole optimizer states
    (plan.shard_optimizer=false): with the state split over them, a lost replica's block forces the checkpoint."""
    whole = "plan.shard_optimizer=false"
    noticed_job = _job(["cluster.schedule=[{step: 3, leave: [6, 7], notice: 1}]", whole])
    failed_job, no_copy_job = _job([whole]), _job([whole])
    metrics = [noticed_job.step(s).metrics for s in range(2)]
    noticed_job.prepare = lambda plan: Prepared(plan, {}, [], 0.0)  # only its decision is compared
    noticed, failed, no_copy = (Adapter(j, log=lambda _: None) for j in (noticed_job, failed_job, no_copy_job))
    try:
        for adapter in (noticed, failed, no_copy):
            for s, m in enumerate([None, *metrics]):
                adapter.boundary(s, m)
        assert noticed.pending is not None, noticed.events
        decision = noticed.pending.decision
        assert decision.trigger == "pool" and decision.urgent
        assert noticed.pending.graph is decision.move  # the move that runs is the graph it was priced with
        rec = failed.lose([6, 7], 2, training_snapshot(failed_job), None)
        with pytest.raises(CheckpointError, match=r"no replica of actor-gen survived.*no checkpoint to restore.*"
                                                  r"set checkpoint.every_steps"):
            no_copy.lose([0, 1], 2, training_snapshot(no_copy_job), None)
    finally:
        for adapter in (noticed, failed, no_copy):
            adapter.close()
    assert rec.how == "survivors" and rec.plan == failed_job.plan and rec.next_step == 2 and rec.moved is not None
    urgent = [e for e in failed.events if e["event"] == "decision"][-1]
    assert urgent["trigger"] == "pool" and urgent["urgent"] and urgent["admitted"]
    assert not {6, 7} & set(failed_job.plan.devices)
    assert failed_job.plan == noticed.pending.target
    urgent = [e for e in no_copy.events if e["event"] == "decision"][-1]
    assert urgent["urgent"] and not urgent["admitted"] and "no feasible live transition" in urgent["reason"]
    assert all(why == "no live transition reaches it" for _, why in urgent["rejected"])
