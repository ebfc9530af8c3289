"""plan.shard_optimizer (ZeRO-1) in a running job: training over dp replicas that each keep 1/dp of the optimizer
state computes exactly what replicas with whole copies compute, holds a quarter of the optimizer bytes at dp 4,
moves between random plans (dp changes included) keeping every bit, and its checkpoints resume into any dp.
References: the same job with plan.shard_optimizer=false, and the state before a move or save, bit for bit."""

import random

import numpy as np
import pytest
from jobs import restore_for, tiny_config, tiny_job
from plans import assert_same_state, host_state, move_randomly

from nereus_jax.elastic.emu import stage_checksum
from nereus_jax.model_stage import ACTOR_TRAIN, CRITIC_TRAIN
from nereus_jax.runtime.durability.checkpoint import Checkpointer
from nereus_jax.runtime.step.initial_plan import plan_from_config

DP4 = ["plan.default.dp=4", "plan.default.tp=2"]  # training on 4 replicas of tp 2 (PPO: a critic too)
TRAINED = (ACTOR_TRAIN, CRITIC_TRAIN)
KEYS = ("loss", "grad_norm", "policy_loss", "value_loss", "kl", "reward_mean", "clip_fraction")


def _job(warm, *extra):
    return tiny_job(DP4 + list(extra), actor=warm)


@pytest.fixture(scope="module")
def runs(warm):
    """3 steps of the dp 4 job, with the optimizer split over the replicas and with whole copies."""
    jobs = {split: _job(warm, f"plan.shard_optimizer={str(split).lower()}") for split in (True, False)}
    out = {split: (job, [job.step(s).metrics for s in range(3)]) for split, job in jobs.items()}
    yield out
    for job in jobs.values():
        job.close()


def test_training_with_the_optimizer_split_over_dp_equals_whole_copies(runs):
    """Within 1e-6 after 3 steps, as the issue asks; in fact bit for bit (Adam is elementwise)."""
    (split, got), (whole, want) = runs[True], runs[False]
    assert want[-1]["grad_norm"] > 0 and want[-1]["loss"] != 0  # the warm actor learns: there is something to compare
    for a, b in zip(got, want, strict=True):
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
    for ms in TRAINED:
        assert split.units[ms][0].spec.shards == 4 and whole.units[ms][0].spec.shards == 1
        for x, y in zip(split.specs[ms].flatten(split.stage_host_state(ms)),
                        whole.specs[ms].flatten(whole.stage_host_state(ms)), strict=True):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


def test_each_training_device_holds_a_quarter_of_the_optimizer_state(runs):
    split, whole = runs[True][0], runs[False][0]
    for ms in TRAINED:
        spec, layout = whole.specs[ms], whole.plan[ms].layout
        params = spec.param_bytes_per_device(layout)
        optimizer = {s: job.units[ms][0].bytes_per_device()[job.units[ms][0].device_ids[0]] - params
                     for s, job in ((True, split), (False, whole))}
        step_count = 4  # Adam's step counter, a scalar on every replica
        assert optimizer[True] - step_count == (optimizer[False] - step_count) / 4, ms
    # the memory model the planner and the memory check use counts the same saving on every device
    saved = sum(whole.units[ms][0].nbytes - split.units[ms][0].nbytes for ms in TRAINED) / 2  # per device of tp 2
    predicted = whole.stages.predicted_peak_bytes() - split.stages.predicted_peak_bytes()
    assert predicted == pytest.approx(saved, rel=0.01)


def test_moves_between_random_plans_keep_every_bit_of_a_split_optimizer(warm):
    """Random plans (dp 1, 2, 4, 8, any layout, devices shuffled): each move gathers the blocks, moves the state
    and splits it over the new replicas; the state after each move equals the state before, bit for bit, and
    the job trains on."""
    job = _job(warm)
    try:
        job.step(0)
        move_randomly(job, random.Random(7), moves=3)
        for ms in TRAINED:
            assert job.units[ms][0].spec.shards == (job.plan[ms].dp if job.plan[ms].dp > 1 else 1)
        assert np.isfinite(job.step(1).metrics["loss"])
    finally:
        job.close()


@pytest.mark.parametrize("dp,tp", [(2, 2), (8, 1)])
def test_a_checkpoint_written_at_dp4_resumes_into_another_dp(runs, tmp_path, dp, tp):
    """Saved from 4 replicas each holding a block, restored into ``dp`` replicas: the same state bit for bit
    (checksums of the whole state), each replica holding its own block."""
    job = runs[True][0]
    ckpt = Checkpointer(str(tmp_path / "ck"))
    ckpt.save(job, 3, wait=True)
    ckpt.close()
    cfg = tiny_config([f"plan.default.dp={dp}", f"plan.default.tp={tp}"])
    resumed, _ = restore_for(cfg, str(tmp_path / "ck" / "3"), plan=plan_from_config(cfg))
    try:
        want = host_state(job)
        for ms in TRAINED:
            assert resumed.plan[ms].dp == dp and resumed.units[ms][0].spec.shards == dp
            assert stage_checksum(resumed.units[ms]).tolist() == stage_checksum(job.units[ms]).tolist()
        assert_same_state(host_state(resumed), want)
    finally:
        resumed.close()
