"""LoRA's frozen base held once (plan.share_frozen_base, the default): model-stages whose units hold a base leaf
identically (same ordered devices, layout, dtype) hold the same buffers; the job computes exactly what a job
with one copy per stage computes, bit for bit, through steps, parking and moves; the devices hold exactly the
duplicates' bytes less. References: the same job with ``plan.share_frozen_base=false``, and the bytes of the
leaves that are held more than once, counted from the units in the test."""

import gc
import random

import jax
import numpy as np
import pytest
from jobs import job_for, tiny_config
from plans import assert_same_state, host_state, move_randomly

from nereus_jax.elastic.executor import TransitionExecutor
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import DEVICE, HOST, ExecutionPlan, StagePlan
from nereus_jax.elastic.shared_base import array_buffers, frozen_leaves, unique_bytes
from nereus_jax.model_stage import ACTOR_GEN, ACTOR_TRAIN, CRITIC_TRAIN, REF_INFER
from nereus_jax.runtime.platform.device_memory import device_bytes_in_use
from nereus_jax.runtime.step.initial_plan import predicted_peak
from nereus_jax.runtime.step.move import move
from nereus_jax.sharding import Layout

LORA = ["model.lora_rank=4", "model.lora_alpha=8", "trainer.actor_lr=1e-2", "trainer.critic_lr=1e-2"]


def _job(warm, share: bool, *extra):
    return job_for(tiny_config([*LORA, f"plan.share_frozen_base={str(share).lower()}", *extra]), actor=warm)


def _frozen(job):
    """(stage, replica devices, layout, path) -> the frozen leaf's array, for every unit in device memory."""
    out = {}
    for ms, units in job.units.items():
        if ms.role == "reward":
            continue
        for u in units:
            if u.memory != DEVICE:  # parked: a host copy of its own
                continue
            for i, path in frozen_leaves(u.spec):
                out[(ms, u.device_ids, u.layout, path)] = u.leaves[i]
    return out


def _duplicate_bytes(job, device: int | None = None) -> int:
    """Bytes a job holds more than once when every stage keeps its own copy of the base: per (replica, layout,
    path, dtype), all holders but one, counted from the leaves themselves (``device``: on that device only)."""
    groups: dict[tuple, list] = {}
    for (_, devices, layout, path), x in _frozen(job).items():
        groups.setdefault((devices, layout, path, x.dtype), []).append(x)

    def size(x):
        return x.nbytes if device is None else sum(s.data.nbytes for s in x.addressable_shards if s.device.id == device)

    return sum(sum(size(x) for x in xs[1:]) for xs in groups.values())


def _check_sharing(job, shared: bool) -> int:
    """Every frozen leaf held identically by several stages is one set of buffers (``shared``) or one set per
    stage; returns how many leaves are held by more than one stage."""
    groups: dict[tuple, list] = {}
    for (_, devices, layout, path), x in _frozen(job).items():
        assert not x.is_deleted(), path
        groups.setdefault((devices, layout, path, x.dtype), []).append(array_buffers(x))
    many = [bufs for bufs in groups.values() if len(bufs) > 1]
    for bufs in many:
        if shared:
            assert all(b == bufs[0] for b in bufs)
        else:
            assert all(not (a & b) for i, a in enumerate(bufs) for b in bufs[i + 1:])
    return len(many)


@pytest.fixture(scope="module")
def runs(warm):
    """Two steps of the job with and without sharing (the shared one parks idle stages between uses); per run:
    its metrics, final state, how many leaves several stages hold, the duplicates' bytes, the devices' bytes in
    use after the steps. The jobs run one after the other, so each measurement sees one job."""
    out = {}
    for share, extra in ((True, ["plan.park_idle=true"]), (False, [])):
        job = _job(warm, share, *extra)
        metrics = [job.step(s).metrics for s in range(2)]
        memory = {ms: us[0].memory for ms, us in job.units.items()}
        for ms in job.units:  # parked: on device again, for the counts
            job.stages.use(ms)
        many = _check_sharing(job, share)
        gc.collect()
        units = [u for us in job.units.values() for u in us]
        out[share] = dict(metrics=metrics, memory=memory, state=host_state(job), many=many,
                          duplicates=_duplicate_bytes(job), plan=job.plan, on_device0=_duplicate_bytes(job, device=0),
                          unique=sum(unique_bytes(units).values()), held=sum(u.nbytes for u in units),
                          in_use=sum(device_bytes_in_use(jax.devices()).values()))
        job.close()
        del job, units
        gc.collect()
    return out


def test_stages_that_hold_the_base_alike_share_it_and_compute_the_same(runs):
    shared, alone = runs[True], runs[False]
    assert shared["many"] == alone["many"] > 0  # ref-infer, actor-train, critic-train on the same 8 devices
    for got, want in zip(shared["metrics"], alone["metrics"], strict=True):
        assert got.keys() == want.keys()
        for k in got:
            if not k.endswith(("seconds", "_s", "bytes")) and isinstance(want[k], float):
                assert got[k] == want[k] or (np.isnan(got[k]) and np.isnan(want[k])), k
    assert_same_state(shared["state"], alone["state"])
    # parking idle stages: the critic's adapters and optimizer go to host memory; the reference, whose every buffer
    # actor-train holds too, stays (parking it would free nothing)
    assert shared["memory"][CRITIC_TRAIN] == HOST and shared["memory"][REF_INFER] == DEVICE


def test_the_devices_hold_exactly_the_duplicates_less(runs):
    shared, alone = runs[True], runs[False]
    assert alone["unique"] == alone["held"]  # nothing shared without it
    assert shared["held"] == alone["held"]
    assert shared["duplicates"] == alone["duplicates"] > 0
    assert shared["unique"] == alone["held"] - alone["duplicates"]
    # and the duplicates' buffers are gone from the devices, not only from the units
    assert alone["in_use"] - shared["in_use"] == alone["duplicates"]


def test_the_memory_model_predicts_the_saving_on_the_busiest_device(runs):
    """Device 0 holds actor-gen's first replica beside ref-infer, actor-train and critic-train (the busiest): the
    predicted peak drops by exactly the bytes held there more than once."""
    alone = runs[False]
    assert alone["on_device0"] > 0
    shared_peak, _ = predicted_peak(tiny_config([*LORA, "plan.share_frozen_base=true"]), alone["plan"])
    alone_peak, _ = predicted_peak(tiny_config([*LORA, "plan.share_frozen_base=false"]), alone["plan"])
    assert alone_peak - shared_peak == alone["on_device0"]


def test_moves_keep_every_bit_and_never_delete_a_shared_buffer(warm):
    """A random move, then a plan where every stage holds the same tp 2 replicas, then actor-train away and back:
    each move keeps every stage's state bit for bit (checked against the state before it, and by the executor's
    checksums) and no unit is left holding a deleted buffer; where holders coincide after a move they share, and
    the move moved the base once per place (the executor's reused bytes are exactly the duplicates an unshared job
    holds there; coming back, exactly actor-train's base); the job then steps on. (That a shared job computes what
    an unshared one does, step by step: the first test.)"""
    job = _job(warm, True)
    try:
        job.step(0)
        move_randomly(job, random.Random(7), 1)
        _check_sharing(job, True)
        pairs = ((0, 1), (2, 3), (4, 5), (6, 7))
        target = ExecutionPlan({ms: StagePlan(Layout(tp=2), pairs[:2] if ms == ACTOR_GEN else pairs)
                                for ms in job.plan})
        before = host_state(job)
        executor = TransitionExecutor(checksums=True)  # every unit made checked against its stage's state
        move(job, TransitionGraph.build(job.plan, target, job.specs), executor=executor)
        assert_same_state(host_state(job), before)
        assert _check_sharing(job, True) > 0
        # the base moved once per place: every further holder took the first one's arrays instead of a copy
        assert executor.reused_bytes == _duplicate_bytes(job) > 0
        frozen = _frozen(job)
        here = [(path, x) for (ms, devices, _, path), x in frozen.items() if ms == ACTOR_TRAIN and devices == (0, 1)]
        assert here
        for path, x in here:  # actor-gen's first replica and actor-train's hold one base
            assert array_buffers(frozen[(ACTOR_GEN, (0, 1), Layout(tp=2), path)]) == array_buffers(x), path
        # actor-train alone leaves, then comes back to where the others hold the base: only its adapters and
        # optimizer state move back
        away = ExecutionPlan({**target, ACTOR_TRAIN: StagePlan(Layout(tp=1), tuple((d,) for d in range(8)))})
        move(job, TransitionGraph.build(job.plan, away, job.specs))
        executor = TransitionExecutor(checksums=True)
        move(job, TransitionGraph.build(job.plan, target, job.specs), executor=executor)
        assert_same_state(host_state(job), before)
        base = sum(u.leaves[i].nbytes for u in job.units[ACTOR_TRAIN] for i, _ in frozen_leaves(u.spec))
        assert executor.reused_bytes == base
        assert np.isfinite(job.step(1).metrics["policy_loss"])
    finally:
        job.close()
