"""Checkpoints resume anywhere: 6 steps straight vs 3 + save + restore into a fresh Job + 3, on the same
plan (bit for bit), on 4 devices and back on 8 (within float tolerance), with every data position used
exactly once; and a checkpoint the job cannot use fails with an error naming the problem and the fix.

Runs in ~60-90 s on a loaded 2-core machine: one warm start, one reference run, three short resumed runs
(the persistent compilation cache lets a fresh Job reuse the reference run's programs).
"""

import os
import shutil

import jax
import numpy as np
import pytest
from jobs import job_for, restore_for, tiny_config

from nereus_jax.elastic.emu import stage_checksum
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.model_stage import ACTOR_TRAIN, CRITIC_TRAIN
from nereus_jax.runtime.durability.checkpoint import Checkpointer, CheckpointError, plan_from_json, read_metadata
from nereus_jax.runtime.step.initial_plan import plan_from_config

pytestmark = pytest.mark.resume

B, N = 16, 2  # prompts a step, samples a prompt
KEYS = ("reward_mean", "kl", "loss", "policy_loss", "value_loss", "response_length_mean", "policy_version")
# Across plans (dp 8 vs 4) only the reduction order of the gradient all-reduce and of the micro-batch sums
# differs, so floats differ in the last bits; the same tolerance as the placement test in test_job.py.
RTOL, ATOL = 1e-4, 1e-6
PARAM_ATOL = 1e-5  # parameters after 2-3 Adam steps at lr 1e-3 from last-bit gradient differences


def _cfg(*extra):
    return tiny_config(extra)


def _train_state(job):
    return {ms: job.stage_host_state(ms) for ms in (ACTOR_TRAIN, CRITIC_TRAIN)}


@pytest.fixture(scope="module")
def reference(warm, tmp_path_factory):
    """6 steps straight on 8 devices; a checkpoint is written (asynchronously) after step 3 of the same run."""
    ckdir = str(tmp_path_factory.mktemp("ckpt") / "ref")
    job = job_for(_cfg(), actor=warm)
    ckpt = Checkpointer(ckdir, every_steps=3, keep=2)
    results = []
    for s in range(6):
        results.append(job.step(s))
        ckpt.maybe_save(job, s + 1)
    ckpt.close()
    return {"dir": ckdir, "results": results, "state": _train_state(job), "plan": job.plan}


def _resume(path, steps, *extra, save_dir=None, save_after=None):
    job, meta = restore_for(_cfg(*extra), path)
    results = []
    for s in steps:
        results.append(job.step(s))
        if s + 1 == save_after:
            ckpt = Checkpointer(save_dir)
            ckpt.save(job, s + 1, wait=True)
            ckpt.close()
    return job, meta, results


def _same_rollouts(got, want):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.batch.prompt_index_b, b.batch.prompt_index_b)
        np.testing.assert_array_equal(a.batch.response_br, b.batch.response_br)


def test_resume_on_the_same_plan_is_bit_identical(reference):
    assert sorted(os.listdir(reference["dir"])) == ["3", "6"]
    job, meta, got = _resume(os.path.join(reference["dir"], "3"), range(3, 6))
    assert meta["step"] == 3 and job.plan == reference["plan"]
    want = reference["results"][3:]
    _same_rollouts(got, want)
    for a, b in zip(got, want, strict=True):
        assert {k: a.metrics[k] for k in KEYS} == {k: b.metrics[k] for k in KEYS}
    state = _train_state(job)
    for ms in state:
        for x, y in zip(jax.tree.leaves(state[ms]), jax.tree.leaves(reference["state"][ms]), strict=True):
            np.testing.assert_array_equal(x, y, err_msg=str(ms))


def test_no_data_position_is_skipped_or_repeated_across_a_stop(reference):
    meta = read_metadata(os.path.join(reference["dir"], "3"))
    assert meta["step"] == 3 and meta["data_position"] == 3 * B and meta["policy_version"] == 3
    _, _, resumed = _resume(os.path.join(reference["dir"], "3"), range(3, 4))
    before = [r.batch.prompt_index_b for r in reference["results"][:3]]
    seen = np.concatenate(before + [resumed[0].batch.prompt_index_b])
    np.testing.assert_array_equal(np.sort(seen), np.repeat(np.arange(4 * B), N))
    assert resumed[0].batch.prompt_index_b.min() == meta["data_position"]
    assert set(resumed[0].batch.policy_version_b) == {3}


def _close(got, want, state, ref_state):
    _same_rollouts(got, want)
    for a, b in zip(got, want, strict=True):
        for k in KEYS:
            np.testing.assert_allclose(a.metrics[k], b.metrics[k], rtol=RTOL, atol=ATOL, err_msg=k)
    for ms in state:
        for x, y in zip(jax.tree.leaves(state[ms]), jax.tree.leaves(ref_state[ms]), strict=True):
            np.testing.assert_allclose(x, y, rtol=0, atol=PARAM_ATOL, err_msg=str(ms))


@pytest.fixture(scope="module")
def on_four(reference, tmp_path_factory):
    """Written on 8, resumed on 4 devices for steps 3..5; it writes its own checkpoint after step 3."""
    save_dir = str(tmp_path_factory.mktemp("ckpt") / "four")
    job, meta, got = _resume(os.path.join(reference["dir"], "3"), range(3, 6), "cluster.num_devices=4",
                             save_dir=save_dir, save_after=4)
    return job, got, save_dir


def test_checkpoint_written_on_8_devices_resumes_on_4(reference, on_four):
    job, got, _ = on_four
    assert len(job.devices) == 4 and job.plan.devices == (0, 1, 2, 3)
    _close(got, reference["results"][3:], _train_state(job), reference["state"])


def test_checkpoint_written_on_4_devices_resumes_on_8(reference, on_four):
    _, _, four_dir = on_four
    meta = read_metadata(os.path.join(four_dir, "4"))
    assert meta["num_devices"] == 4 and plan_from_json(meta["plan"]).devices == (0, 1, 2, 3)
    job, _, got = _resume(os.path.join(four_dir, "4"), range(4, 6))
    assert job.plan == reference["plan"]  # the config's plan for the 8 devices present now
    _close(got, reference["results"][4:], _train_state(job), reference["state"])


def test_layouts_that_repeat_kv_heads_save_and_restore_the_canonical_state(reference, tmp_path):
    """tp=4 over 2 kv heads stores each kv head twice: restored into it, saved from it, and restored into
    tp=1 again, every model-stage's state is bit for bit the checkpoint's (checksums are layout-free)."""
    path = os.path.join(reference["dir"], "3")
    plain, _ = _restore(path)
    cfg = _cfg("plan.stages.actor-train.tp=4", "plan.stages.ref-infer.tp=4")
    # on as many devices as it was written on, a checkpoint resumes into its own plan unless given one
    wide, _ = restore_for(cfg, path, plan=plan_from_config(cfg))
    assert wide.specs[ACTOR_TRAIN].repeat(wide.plan[ACTOR_TRAIN].layout) == 2
    ckpt = Checkpointer(str(tmp_path / "wide"))
    ckpt.save(wide, 3, wait=True)
    ckpt.close()
    back, _ = _restore(str(tmp_path / "wide"))
    for ms in plain.units:
        want = stage_checksum(plain.units[ms]).tolist()
        assert stage_checksum(wide.units[ms]).tolist() == want and stage_checksum(back.units[ms]).tolist() == want, ms


# ------------------------------------------------------------------------------------ clear errors
def _restore(path, *extra):
    return restore_for(_cfg(*extra), path)


def test_checkpoint_of_another_model_shape_is_refused_naming_the_key(reference):
    with pytest.raises(CheckpointError, match=r"model\.hidden_size=64 \(config: 32\)"):
        _restore(reference["dir"], "model.hidden_size=32", "model.intermediate_size=128")


def test_truncated_checkpoint_is_refused_naming_the_folder(reference, tmp_path):
    broken = tmp_path / "3"
    shutil.copytree(os.path.join(reference["dir"], "3"), broken)
    for root, _, files in os.walk(broken / "state" / "d"):
        for f in files:
            with open(os.path.join(root, f), "r+b") as fh:
                fh.truncate(os.path.getsize(os.path.join(root, f)) // 2)
    with pytest.raises(CheckpointError, match="incomplete or damaged.*delete that folder"):
        _restore(str(broken))
    (broken / "meta" / "metadata").write_text('{"step": ')
    with pytest.raises(CheckpointError, match="incomplete or damaged"):
        _restore(str(broken))


def test_plan_needing_more_devices_than_exist_is_refused(reference):
    cfg = _cfg("cluster.num_devices=4")
    plan = reference["plan"]
    assert isinstance(plan, ExecutionPlan) and max(plan.devices) == 7
    with pytest.raises(CheckpointError, match=r"uses devices \[4, 5, 6, 7\] but only devices 0\.\.3 exist"):
        restore_for(cfg, reference["dir"], plan=plan)


def test_an_empty_checkpoint_folder_is_refused(tmp_path):
    (tmp_path / "3.orbax-checkpoint-tmp-123").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint.*unfinished saves"):
        _restore(str(tmp_path))


def test_the_controller_state_saved_with_a_checkpoint_is_the_one_a_resumed_controller_starts_from(warm, tmp_path):
    """The controller's state goes into the checkpoint as an argument of save (not through the job), and
    load_controller gives it to the resumed run's controller: its references, horizons, calibrated
    efficiencies and n_1/2, and compile figures equal the saved controller's; on another device count the
    resumed controller starts afresh."""
    from nereus_jax.runtime.control.adapt import Adapter
    from nereus_jax.runtime.durability.checkpoint import load_controller
    from nereus_jax.runtime.step.initial_plan import job_pricing

    cfg = _cfg("controller.enabled=true")
    job = job_for(cfg, actor=warm)
    adapter = Adapter(job, log=lambda _: None)
    try:
        metrics = None
        for s in range(3):
            adapter.boundary(s, metrics)
            metrics = job.step(s).metrics
        saved = adapter.state_dict()
        ckpt = Checkpointer(str(tmp_path / "ck"), every_steps=0)
        ckpt.save(job, 3, controller=saved, wait=True)
        ckpt.close()
    finally:
        adapter.close()
    assert saved["compile_by_stage"] and saved["efficiency"] != job_pricing(cfg).cost.efficiency  # it calibrated
    resumed, meta = restore_for(cfg, str(tmp_path / "ck"))
    fresh = Adapter(resumed, log=lambda _: None)
    try:
        assert load_controller(fresh, resumed, meta)
        assert read_metadata(str(tmp_path / "ck"))["controller"] == fresh.state_dict() == saved
        assert not load_controller(fresh, resumed, {**meta, "num_devices": 4})
    finally:
        fresh.close()
