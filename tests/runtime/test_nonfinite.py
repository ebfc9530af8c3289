"""Non-finite training never reaches the state or a checkpoint: a step whose loss, gradient norm or update is
not finite keeps the old state bit for bit and is counted; ``trainer.max_nonfinite_steps`` of them in a row
stop the job with a message naming the stage and the learning rate; the checkpoints left behind are finite
and resume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.config import ModelConfig, load_config
from nereus_jax.models import init_params
from nereus_jax.runtime.checkpoint import latest_step, restore_job
from nereus_jax.runtime.job import NonFiniteTraining
from nereus_jax.runtime.losses import make_optimizer, make_train_step
from nereus_jax.runtime.run import check_inputs, run_job

CFG = ModelConfig()


def _step(poison: bool):
    def loss_fn(params, mb):
        x = params["final_norm"]["scale"].sum() * mb["w"].sum()
        return (x * jnp.nan if poison else x), {}

    opt = make_optimizer(1e-2)
    params = init_params(CFG, seed=0)
    state = opt.init(params)
    batches = {"w": jnp.ones((2, 3))}
    return params, state, jax.jit(make_train_step(loss_fn, opt, CFG))(params, state, batches)


def _bits(tree):
    return [np.asarray(x).view(np.uint32 if np.asarray(x).dtype.itemsize == 4 else np.int32)
            for x in jax.tree.leaves(tree)]


def test_a_non_finite_loss_skips_the_update_and_keeps_the_state_bit_for_bit():
    params, opt_state, (new_params, new_opt, metrics) = _step(poison=True)
    assert float(metrics["nonfinite"]) == 1.0
    for a, b in zip(_bits(params) + _bits(opt_state), _bits(new_params) + _bits(new_opt), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_finite_step_updates_and_reports_no_skip():
    params, _, (new_params, _, metrics) = _step(poison=False)
    assert float(metrics["nonfinite"]) == 0.0
    assert not np.array_equal(np.asarray(params["final_norm"]["scale"]), np.asarray(new_params["final_norm"]["scale"]))


@pytest.mark.slow
def test_a_diverging_run_stops_naming_the_stage_and_leaves_a_finite_checkpoint_that_resumes(tmp_path):
    cfg = load_config("ppo_tiny", [
        "trainer.actor_lr=1e9", "algorithm.entropy_coef=0.1", "checkpoint.every_steps=1", "trainer.steps=12",
        "trainer.warmup_sft_steps=0", "trainer.prompts_per_step=8", "task.eval_size=8", "cluster.schedule=[]",
        "logging.progress=false", "logging.tensorboard=false", "controller.enabled=false"])
    with pytest.raises(NonFiniteTraining, match=r"actor-train: 3 consecutive .*trainer\.actor_lr=1000000000"):
        run_job(cfg, str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints"
    step = latest_step(str(ckpt))
    assert step is not None and step < 12
    inputs = check_inputs(cfg)
    try:
        job, meta = restore_job(cfg, inputs.task, inputs.tokenizer, str(ckpt), rewarder=inputs.rewarder)
        for units in job.units.values():
            for x in units[0].leaves:
                assert np.isfinite(np.asarray(x)).all()
        assert meta["step"] == step
    finally:
        inputs.rewarder.close()
