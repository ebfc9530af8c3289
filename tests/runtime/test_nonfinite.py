"""Non-finite training never reaches the state or a checkpoint: a step whose loss, gradient norm or update is
not finite keeps the old state bit for bit and is counted, and so is a step whose scores (log-probs, values)
are not finite (it trains nothing); ``trainer.max_nonfinite_steps`` of them in a row stop the job with a
message naming the stage and the learning rate. No checkpoint is written during such a streak, and the
message names one that resumes to a finite step (or says none exists)."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jobs import TINY_JOB

from nereus_jax import train
from nereus_jax.config import ModelConfig, load_config
from nereus_jax.models import init_params
from nereus_jax.runtime.durability.checkpoint import complete_steps, latest_step, restore_job
from nereus_jax.runtime.run import check_inputs, run_job
from nereus_jax.runtime.step.job import NonFiniteTraining
from nereus_jax.runtime.step.losses import make_optimizer, make_train_step

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
    with pytest.raises(NonFiniteTraining, match=r"3 consecutive training steps .*trainer\.actor_lr=1000000000"):
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


# --------------------------------------------------------------------- a non-finite forward (lr 1e9)
# Adam moves every weight by about the learning rate: at 1e9 the update is huge but finite (it passes the
# training program's check and the checkpoint's), and the next step's forward overflows to NaN log-probs.
def _diverging(tmp_path, *extra):
    return TINY_JOB + ["algorithm.entropy_coef=0.1", "checkpoint.every_steps=1", "checkpoint.keep=2",
                       "logging.tensorboard=false", "controller.enabled=false", f"logging.cache_dir={tmp_path}/cache",
                       *extra]


def _metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def _one_step_from(tmp_path, name, checkpoint, step):
    """Step ``step`` of the lr-1e9 run resumed from ``checkpoint``: its metrics."""
    run_job(load_config(None, _diverging(tmp_path, "trainer.actor_lr=1e9", f"trainer.steps={step + 1}",
                                         f"checkpoint.resume_from={checkpoint}")), str(tmp_path / name))
    (metrics,) = _metrics(tmp_path / name)
    assert metrics["step"] == step
    return metrics


def _finite(m) -> bool:
    """A step's scores and the actor's update were finite."""
    return all(np.isfinite(m[k]) for k in ("kl", "policy_loss", "grad_norm")) and m["actor_updates_skipped"] == 0


def test_a_diverging_run_writes_no_checkpoint_in_the_streak_and_names_one_that_resumes_finite(tmp_path, capsys):
    """Two steps at a sane learning rate (checkpoints 1, 2), then the run resumed at lr 1e9: step 2's update
    is huge but finite (checkpoint 3 holds it), the steps after it are not finite. The CLI exits 2 with one
    line; no checkpoint is written once the streak began; the one the line names resumes to a finite step,
    and the newest one before the streak (3, not named) does not."""
    ckpt = str(tmp_path / "ckpt")
    run_job(load_config(None, _diverging(tmp_path, "trainer.steps=2", f"checkpoint.dir={ckpt}")),
            str(tmp_path / "sane"))
    assert complete_steps(ckpt) == [1, 2]
    args = _diverging(tmp_path, "trainer.actor_lr=1e9", "trainer.steps=10", f"checkpoint.dir={ckpt}",
                      f"checkpoint.resume_from={ckpt}")
    assert train.main(["default", *args, "--run-dir", str(tmp_path / "diverged")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: 3 consecutive training steps were non-finite"), err
    assert "trainer.actor_lr=1000000000.0" in err
    first, last = (int(x) for x in re.search(r"steps (\d+)\.\.(\d+)", err).groups())
    steps = _metrics(tmp_path / "diverged")
    assert [m["step"] for m in steps] == list(range(2, last))  # the step that raises logs nothing
    assert all(_finite(m) for m in steps if m["step"] < first) and not _finite(steps[first - 2])
    assert max(complete_steps(ckpt)) == first  # written before step `first`, none after it
    named = re.search(r"checkpoint\.resume_from=(\S+)", err).group(1)
    step = int(os.path.basename(named))
    assert os.path.dirname(named) == ckpt and step < first
    assert _finite(_one_step_from(tmp_path, "named", named, step))
    assert not _finite(_one_step_from(tmp_path, "newest", os.path.join(ckpt, str(first)), first))


def test_a_run_whose_first_update_poisons_the_weights_says_no_checkpoint_resumes(tmp_path):
    """lr 1e9 from the start: step 0's update is the poisoned one, so checkpoint 1 (written before the streak)
    resumes into NaN too; the message says plainly that no checkpoint precedes it, and none is written after."""
    none = r"steps 1\.\.3; step 3: actor-infer's log-probs .*No checkpoint written before step 0's update exists"
    with pytest.raises(NonFiniteTraining, match=none + r" \(\S+/checkpoints/1 holds the weights") as stop:
        run_job(load_config(None, _diverging(tmp_path, "trainer.actor_lr=1e9", "trainer.steps=10")),
                str(tmp_path / "run"))
    assert stop.value.first_step == 1
    assert complete_steps(str(tmp_path / "run" / "checkpoints")) == [1]


def test_a_signal_during_a_streak_stops_without_saving_and_names_no_checkpoint(tmp_path, sigterm_after, capsys):
    """SIGTERM after step 1 (non-finite, lr 1e9 from the start): the CLI stops with exit 0 as usual, but writes no
    checkpoint of the streak's weights and says that none resumes (checkpoint 1 would resume into NaN)."""
    sigterm_after(1)
    args = _diverging(tmp_path, "trainer.actor_lr=1e9", "trainer.steps=10")
    assert train.main(["default", *args, "--run-dir", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "stopped by SIGTERM after step 1; no checkpoint to resume from (the steps before the stop were non-finite)")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_after"] == 1 and summary["resume_from"] is None and summary["resume_step"] is None
    assert complete_steps(str(tmp_path / "run" / "checkpoints")) == [1]
