"""A LoRA job (model.lora_rank > 0) end to end: the base stays bit-identical through RL steps, the reference
model is the base without adapters, optimizer state exists for the adapters alone, moves between random plans
and a checkpoint restored into another plan keep every bit, and the export writes the merged model plus a PEFT
adapter. References: the warm-started base tree (bits), merge_lora of the trained tree (the export)."""

import random

import numpy as np
import pytest
from jobs import job_for, restore_for, tiny_config
from plans import assert_same_state, host_state, move_randomly

from nereus_jax.elastic.weight_sync import WeightSync
from nereus_jax.model_stage import ACTOR_GEN, ACTOR_TRAIN, CRITIC_TRAIN, REF_INFER
from nereus_jax.models import lora
from nereus_jax.models.hf import load_hf
from nereus_jax.models.peft import read_adapter
from nereus_jax.runtime.durability.checkpoint import Checkpointer
from nereus_jax.runtime.durability.export import export_actor
from nereus_jax.runtime.step.initial_plan import plan_from_config
from nereus_jax.sharding import Layout

LORA = ["model.lora_rank=4", "model.lora_alpha=8", "trainer.actor_lr=1e-2", "trainer.critic_lr=1e-2"]


def _cfg(*extra):
    return tiny_config(LORA + list(extra))


def _leaves(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), np.asarray(v)


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return np.asarray(tree)


@pytest.fixture(scope="module")
def trained(warm):
    job = job_for(_cfg(), actor=warm)
    for s in range(2):
        job.step(s)
    yield job
    job.close()


def test_the_base_stays_bit_identical_and_only_adapters_and_the_value_head_train(trained, warm):
    actor = trained.stage_host_state(ACTOR_TRAIN)
    for path, x in _leaves(actor["params"]):
        if lora.is_adapter(path):
            if path[-1].endswith(lora.SUFFIX_B):
                assert np.any(x != 0), f"{path} did not train"
        else:
            np.testing.assert_array_equal(x, _at(warm, path), err_msg=str(path))
    n_adapter = sum(x.size for p, x in _leaves(actor["params"]) if lora.is_adapter(p))
    assert sum(np.asarray(x).size for x in _opt_leaves(actor["opt"])) == 2 * n_adapter + 1
    critic = trained.units[CRITIC_TRAIN][0].to_host()["params"]
    assert np.any(_at(critic, ("value_head", "kernel")) != 0)
    for path, x in _leaves(critic):
        if path[0] != "value_head" and not lora.is_adapter(path):
            np.testing.assert_array_equal(x, _at(warm, path), err_msg=f"critic {path}")


def _opt_leaves(opt):
    import jax

    return jax.tree.leaves(opt)


def test_the_reference_is_the_base_without_adapters(trained, warm):
    ref = trained.units[REF_INFER][0].to_host()["params"]
    assert not lora.has_adapters(ref["layers"])
    for path, x in _leaves(ref):
        np.testing.assert_array_equal(x, _at(warm, path).astype(x.dtype), err_msg=str(path))


@pytest.mark.long  # ~35 s; the dense job's random moves run in CI
def test_moves_between_random_lora_plans_keep_every_bit_and_the_job_trains_on(trained):
    move_randomly(trained, random.Random(5), 3)
    result = trained.step(2)  # trains on the last plan
    assert np.isfinite(result.metrics["loss"])


def test_a_checkpoint_resumes_into_another_plan_bit_exact(trained, tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ck"))
    ckpt.save(trained, 3, wait=True)
    ckpt.close()
    want = host_state(trained)
    # python -m nereus_jax.export --adapter: the checkpoint's adapters as a PEFT folder; without: merged
    from nereus_jax import export

    assert export.main(["--adapter", str(tmp_path / "ck"), str(tmp_path / "adapter")]) == 0
    params = trained.actor_host_params()
    adapters = read_adapter(tmp_path / "adapter", trained.cfg.model)
    assert adapters.keys() == {p[-1] for p, _ in _leaves(params) if lora.is_adapter(p)}
    for path, x in _leaves(params):
        if lora.is_adapter(path):
            np.testing.assert_array_equal(adapters[path[-1]], x)
    assert export.main([str(tmp_path / "ck"), str(tmp_path / "hf")]) == 0
    _, merged = load_hf(tmp_path / "hf", dtype="float32")
    for path, x in _leaves(lora.merge_lora(params, trained.cfg.model)):
        np.testing.assert_array_equal(_at(merged, path), x, err_msg=str(path))
    cfg = _cfg("plan.stages.actor-train.tp=2", "plan.stages.actor-train.dp=4")
    job, meta = restore_for(cfg, str(tmp_path / "ck"), plan=plan_from_config(cfg))
    try:
        assert job.plan[ACTOR_TRAIN].layout == Layout(tp=2) and meta["step"] == 3
        assert_same_state(host_state(job), want)
    finally:
        job.close()


def test_the_export_is_the_merged_model_and_a_peft_adapter(trained, tmp_path):
    params = trained.actor_host_params()
    out = export_actor(trained, tmp_path / "hf", tmp_path / "adapter")
    cfg, exported = load_hf(out, dtype="float32")
    assert cfg.lora_rank == 0 and not lora.has_adapters(exported["layers"])
    merged = lora.merge_lora(params, trained.cfg.model)
    for path, x in _leaves(merged):
        np.testing.assert_array_equal(_at(exported, path), x, err_msg=str(path))
    adapters = read_adapter(tmp_path / "adapter", trained.cfg.model)
    for path, x in _leaves(params):
        if lora.is_adapter(path):
            np.testing.assert_array_equal(adapters[path[-1]], x)


def test_a_job_starts_from_a_peft_adapter_and_a_misfit_one_is_refused(trained, warm, tmp_path):
    from nereus_jax.models.peft import AdapterError, write_adapter

    params = trained.actor_host_params()
    write_adapter(tmp_path / "adapter", trained.cfg.model, params)
    job = job_for(_cfg(f"model.lora_path={tmp_path / 'adapter'}"), actor=warm)
    try:
        got = job.actor_host_params()
        for path, x in _leaves(got):
            want = _at(params, path) if lora.is_adapter(path) else _at(warm, path)
            np.testing.assert_array_equal(x, want, err_msg=str(path))
    finally:
        job.close()
    with pytest.raises(AdapterError, match="lora_rank"):
        job_for(_cfg(f"model.lora_path={tmp_path / 'adapter'}", "model.lora_rank=8"), actor=warm)


def test_a_missing_or_misfit_adapter_is_refused_before_any_compile(trained, tmp_path):
    from nereus_jax.models.peft import write_adapter
    from nereus_jax.runtime.run import check_inputs
    from nereus_jax.runtime.step.job import JobError

    with pytest.raises(JobError, match="has no adapter_config.json"):
        check_inputs(_cfg(f"model.lora_path={tmp_path / 'none'}"), log=lambda _: None)
    write_adapter(tmp_path / "adapter", trained.cfg.model, trained.actor_host_params())
    with pytest.raises(JobError, match="set model.lora_targets"):
        check_inputs(_cfg(f"model.lora_path={tmp_path / 'adapter'}", "model.lora_targets=[q_proj]"), log=lambda _: None)


def test_the_weight_sync_moves_only_the_adapters_and_equals_a_whole_sync(trained):
    """Reference: the whole-tree sync (every leaf re-derived from actor-train). The adapter-only sync leaves
    the generation units' base arrays in place (the same buffers) and re-derives the adapters alone; so does
    async's double-buffered one, which leaves the generating units as they were."""
    job = trained
    sync = job.stages.sync
    assert sync.index, "a LoRA job's sync should move the adapters only"
    specs, train = job.specs, job.units[ACTOR_TRAIN]
    whole = WeightSync(job.plan, specs[ACTOR_TRAIN], specs[ACTOR_GEN], keep_old=True,  # leaves the gen units be
                       adapters_only=False)
    assert whole.index is None
    want = [specs[ACTOR_GEN].flatten(u.to_host()) for u in whole(train, job.units[ACTOR_GEN])]
    base = {i: [u.leaves[i] for u in job.units[ACTOR_GEN]] for i in range(specs[ACTOR_GEN].n_params)
            if i not in sync.index}
    # async's double buffer: adapters only too, the generating units left intact beside the new ones
    double = WeightSync(job.plan, specs[ACTOR_TRAIN], specs[ACTOR_GEN], keep_old=True)
    assert double.index == sync.index
    old = job.units[ACTOR_GEN]
    old_host = [specs[ACTOR_GEN].flatten(u.to_host()) for u in old]
    for name, run in (("double", double), ("sync", sync)):  # the plain sync last: it consumes the old units
        units = run(train, old)
        got = [specs[ACTOR_GEN].flatten(u.to_host()) for u in units]
        for a, b in zip(got, want, strict=True):
            for x, y in zip(a, b, strict=True):
                np.testing.assert_array_equal(x, y, err_msg=name)
        for i, arrays in base.items():  # the frozen base: the same buffers, not copies
            assert all(u.leaves[i] is x for u, x in zip(units, arrays, strict=True)), name
        if name == "double":  # the generating copy still holds its old adapters
            for u, before in zip(old, old_host, strict=True):
                for x, y in zip(specs[ACTOR_GEN].flatten(u.to_host()), before, strict=True):
                    np.testing.assert_array_equal(x, y)
    job.units[ACTOR_GEN] = units
    assert sync.moved_bytes_per_device == double.moved_bytes_per_device < 0.5 * whole.moved_bytes_per_device
    job.rollout.set_params()  # the engines adopt the synced units


def _jobs(warm, variants: dict[str, tuple[str, ...]], run) -> tuple[dict, dict]:
    """For each named variant (config overrides), a job from the warm start: ``run(name, job)``'s result and the
    actor's host parameters after it, by name."""
    runs, params = {}, {}
    for name, extra in variants.items():
        job = job_for(_cfg(*extra), actor=warm)
        try:
            runs[name] = run(name, job)
            params[name] = job.actor_host_params()
        finally:
            job.close()
    return runs, params


def test_pipelined_lora_steps_compute_what_unpipelined_ones_compute(warm):
    """actor-train with pp 2 (1F1B; its gradients of the frozen base are computed and dropped) against pp 1,
    two steps: the same rollouts, metrics (gradient norm included) within float reduction order, and the base
    bit for bit (as tests/runtime/test_pipeline_job.py compares dense pp 2 with pp 1)."""
    runs, params = _jobs(warm, {"pp1": (), "pp2": ("plan.stages.actor-train.pp=2", "plan.stages.actor-train.dp=4")},
                         lambda name, job: [job.step(s) for s in range(2)])
    for a, b in zip(runs["pp1"], runs["pp2"], strict=True):
        np.testing.assert_array_equal(a.batch.response_br, b.batch.response_br)
        for key in ("reward_mean", "kl", "loss", "policy_loss", "value_loss", "grad_norm"):
            np.testing.assert_allclose(b.metrics[key], a.metrics[key], rtol=1e-4, atol=1e-6, err_msg=key)
    for path, x in _leaves(params["pp2"]):
        if not lora.is_adapter(path):
            np.testing.assert_array_equal(x, _at(warm, path), err_msg=str(path))


def test_pipelined_dropout_draws_the_unpipelined_masks(warm):
    """model.lora_dropout with actor-train at pp 2 (1F1B and GPipe) against pp 1, two steps: each layer and row
    reads its own key (lora.row_keys), so a pipeline stage and micro-batch draw the masks the unpipelined call
    draws, and metrics agree within float reduction order, as without dropout (the test above). A mask drawn
    differently would change the update far beyond that (dropout 0.5 on every adapter input)."""
    drop = ("model.lora_dropout=0.5",)
    pp2 = ("plan.stages.actor-train.pp=2", "plan.stages.actor-train.dp=4")
    runs, params = _jobs(warm, {"pp1": drop, "1f1b": drop + pp2, "gpipe": drop + pp2 + ("trainer.pipeline_schedule="
                                                                                            "gpipe",)},
                         lambda name, job: [job.step(s) for s in range(2)])
    for name in ("1f1b", "gpipe"):
        for a, b in zip(runs["pp1"], runs[name], strict=True):
            np.testing.assert_array_equal(a.batch.response_br, b.batch.response_br)
            for key in ("loss", "policy_loss", "grad_norm"):
                np.testing.assert_allclose(b.metrics[key], a.metrics[key], rtol=1e-4, atol=1e-6, err_msg=(name, key))
        # Adam turns a gradient's float-order difference into up to lr / 100 on an element whose gradient is tiny;
        # a mask drawn differently moves the adapters by O(lr) = 1e-2 (checked by drawing micro-batch 0's keys for all)
        for path, x in _leaves(params[name]):
            np.testing.assert_allclose(x, _at(params["pp1"], path), rtol=0, atol=1e-4, err_msg=(name, path))


@pytest.mark.long  # ~60 s (two jobs); in CI: the padded comparison above
def test_pipelined_dropout_on_packed_rows_draws_the_unpipelined_masks_at_the_same_dp(warm):
    """With trainer.packing the masks follow the packed rows, and the packing depends on dp: at the same dp a
    pipelined actor-train (1F1B) draws pp 1's masks (a different dp packs other rows, so other masks)."""
    drop = ("model.lora_dropout=0.5", "trainer.packing=true", "plan.stages.actor-train.dp=4")
    runs, params = _jobs(warm, {"pp1": drop, "1f1b": drop + ("plan.stages.actor-train.pp=2",)},
                         lambda name, job: job.step(0).metrics)
    for key in ("loss", "policy_loss", "grad_norm"):
        np.testing.assert_allclose(runs["1f1b"][key], runs["pp1"][key], rtol=1e-4, atol=1e-6, err_msg=key)
    for path, x in _leaves(params["1f1b"]):  # tolerance: see the test above
        np.testing.assert_allclose(x, _at(params["pp1"], path), rtol=0, atol=1e-4, err_msg=str(path))


def test_a_dropout_job_seeds_actor_and_critic_training_and_keeps_the_base(warm):
    """model.lora_dropout through the job's own inputs: both training programs get the step's seed (and the
    scoring programs none), the update runs with it, and the frozen base stays the warm start's bit for bit.
    (The masks themselves, their rate and reproducibility: tests/models/test_lora_dropout.py.)"""
    job = job_for(_cfg("model.lora_dropout=0.5"), actor=warm)
    try:
        result = job.step(0)
        assert np.isfinite(result.metrics["loss"]) and np.isfinite(result.metrics["value_loss"])
        signatures = job.stages.signatures
        for ms in (ACTOR_TRAIN, CRITIC_TRAIN):
            assert signatures[("train", ms)]["dropout_seed"] == ((), np.dtype(np.uint32))
        assert not any("dropout_seed" in s for key, s in signatures.items() if key[0] == "infer")
        for path, x in _leaves(job.actor_host_params()):
            if not lora.is_adapter(path):
                np.testing.assert_array_equal(x, _at(warm, path), err_msg=str(path))
            elif path[-1].endswith(lora.SUFFIX_B):
                assert np.any(x != 0), f"{path} did not train"
    finally:
        job.close()


@pytest.mark.long  # ~75 s (two jobs); in CI: test_async.py's dense async-vs-sync equality at staleness 0 and the
# double-buffered adapter-only sync against the whole sync (test_the_weight_sync_moves_only_the_adapters_...)
def test_async_lora_syncs_the_adapters_alone_and_with_staleness_0_computes_what_sync_computes(warm):
    """Reference: the same LoRA job in sync mode (as tests/runtime/test_async.py compares dense runs). With
    max_staleness 0 the async runner's double-buffered sync reaches the engines before each batch, so every
    batch, metric and the trained adapters are the sync run's bit for bit; that sync moves the adapters only."""
    from nereus_jax.runtime.async_rl import AsyncRunner

    def run(mode, job):
        if mode == "sync":
            return [job.step(s) for s in range(2)]
        runner = AsyncRunner(job, log=lambda _: None)
        results = list(runner.run(2))
        sync, specs = runner.weight_sync, job.specs
        whole = WeightSync(job.plan, specs[ACTOR_TRAIN], specs[ACTOR_GEN], keep_old=True, adapters_only=False)
        assert sync.keep_old and sync.index
        assert sync.moved_bytes_per_device == sync.sub_specs[ACTOR_GEN].bytes_per_device(
            job.plan[ACTOR_GEN].layout) < 0.5 * whole.moved_bytes_per_device
        return results

    common = ("plan.colocate=false", "plan.stages.actor-gen.dp=4", "algorithm.name=grpo")
    runs, params = _jobs(warm, {"sync": common, "async": (*common, "trainer.mode=async", "trainer.max_staleness=0")},
                         run)
    for a, b in zip(runs["async"], runs["sync"], strict=True):
        np.testing.assert_array_equal(a.batch.response_br, b.batch.response_br)
        np.testing.assert_array_equal(a.batch.policy_version_b, b.batch.policy_version_b)
        for key in ("reward_mean", "kl", "loss", "policy_loss", "grad_norm", "response_length_mean"):
            assert a.metrics[key] == b.metrics[key], key
    for (path, x), (_, y) in zip(_leaves(params["async"]), _leaves(params["sync"]), strict=True):
        np.testing.assert_array_equal(x, y, err_msg=str(path))
