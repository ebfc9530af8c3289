"""The 1F1B training schedule (issue 19): the job's losses through it give the plain model's values and
gradients (padded and packed, lm and value heads, under dp and tp), the real job with pp in {2, 4} trains as
the pp = 1 job does, its compiled train program is the pipelined one, and it holds less than GPipe's."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jobs import tiny_config, tiny_job, warm_actor

from nereus_jax.config import AlgorithmConfig, ModelConfig, load_config
from nereus_jax.models import init_params
from nereus_jax.rl import packing
from nereus_jax.runtime.step import losses
from nereus_jax.runtime.step.job import stage_value_and_grad
from nereus_jax.sharding import Layout, gather_params, make_mesh, shard_params
from nereus_jax.sharding.pipeline import PipelineError, check_schedule

CFG = dataclasses.replace(ModelConfig(), num_layers=4)  # pp = 4 divides
P, R, B = 7, 9, 16
ALGO = dataclasses.replace(AlgorithmConfig(), entropy_coef=0.01, kl_in_reward=False)  # every actor-loss term


def _batch(seed=0):
    """Mixed prompt and response lengths, the padded layout of nereus_jax.rl.batch (as tests/runtime/test_packing)."""
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(1, P + 1, B), rng.integers(1, R + 1, B)
    mask = np.zeros((B, P + R), np.int32)
    for i in range(B):
        mask[i, P - plen[i]:P + rlen[i]] = 1
    resp = mask[:, P:]
    noise = lambda mean, scale: (rng.normal(mean, scale, (B, R)) * resp).astype(np.float32)  # noqa: E731
    return {"tokens": (rng.integers(3, CFG.vocab_size, (B, P + R)) * mask).astype(np.int32), "mask": mask,
            "response_mask": resp, "old_logp": noise(-4.9, 0.3), "ref_logp": noise(-4.9, 0.3),
            "advantages": noise(0, 1), "old_values": noise(0, 1), "returns": noise(0, 1)}


def _micro_batch(packed: bool, dp: int) -> dict:
    """One training micro-batch as the job hands it to the loss (whole-batch normalisers included)."""
    batch = _batch()
    if packed:
        layout = packing.pack(batch["tokens"], batch["mask"], prompt_len=P, mini=1, dp=dp, budget_rows=4, quantum=4)
        data = losses.split_packed(batch, layout, 1)
    else:
        data = losses.split_minibatches(batch, 1, 1)
    return jax.tree.map(lambda v: v[0, 0], data)


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("head,packed,pp,tp,dp,m", [
    ("lm", False, 2, 2, 2, 2), ("lm", True, 4, 1, 2, 4),
    pytest.param("value", True, 2, 2, 2, 4, marks=pytest.mark.long),
    pytest.param("value", False, 4, 2, 1, 8, marks=pytest.mark.long),
    pytest.param("lm", True, 2, 2, 2, 2, marks=pytest.mark.long),
    pytest.param("lm", False, 4, 1, 2, 4, marks=pytest.mark.long),
    pytest.param("value", True, 4, 1, 2, 2, marks=pytest.mark.long)])
def test_1f1b_value_and_grad_of_the_job_losses_match_the_plain_model(devices, head, packed, pp, tp, dp, m):
    """losses.pipelined_value_and_grad (what the job's train step calls for pp > 1) against
    jax.value_and_grad of the same loss on the plain model: loss, every metric and every gradient."""
    params = init_params(CFG, seed=0, head=head)
    make_loss = functools.partial(losses.actor_loss if head == "lm" else losses.critic_loss, CFG, ALGO, P)
    mb = _micro_batch(packed, dp)
    reference = jax.jit(jax.value_and_grad(make_loss(losses.forward), has_aux=True))
    (ref_loss, ref_metrics), ref_grads = reference(params, mb)
    layout = Layout(tp=tp, pp=pp)
    mesh = make_mesh(devices[: layout.size * dp], layout, dp=dp)
    fn = jax.jit(losses.pipelined_value_and_grad(make_loss, mesh, m))
    (loss, metrics), grads = fn(shard_params(params, CFG, layout, mesh), mb)
    _close(loss, ref_loss)
    assert sorted(metrics) == sorted(ref_metrics)
    jax.tree.map(_close, metrics, ref_metrics)
    assert grads["layers"]["mlp"]["w_up"].sharding.spec[0] == "pp"  # gradients laid out like the parameters
    jax.tree.map(_close, gather_params(grads, CFG), ref_grads)


def _train_step(mesh, params, micro, schedule: str):
    """The job's update (make_minibatch_train_step on the actor loss, AdamW), differentiated as the job does
    (stage_value_and_grad), compiled."""
    make_loss = functools.partial(losses.actor_loss, CFG, ALGO, P)
    optimizer = losses.make_optimizer(1e-3)
    step = losses.make_minibatch_train_step(None, optimizer, CFG,
                                           value_and_grad=stage_value_and_grad(mesh, "train", make_loss, schedule))
    return jax.jit(step).lower(params, optimizer.init(params), micro).compile()


def test_1f1b_train_program_is_pipelined_and_holds_less_than_gpipe_at_m8(devices):
    """At m = 8 (pp = 2, 8 rows a call): both compiled train programs hand activations over pp (collective
    permutes in the HLO), and 1F1B's temporary buffers are below GPipe's, which keeps every micro-batch's
    activations for the backward."""
    layout = Layout(pp=2)
    mesh = make_mesh(devices[:2], layout, dp=1)
    params = shard_params(init_params(CFG, seed=0), CFG, layout, mesh)
    batch = _batch()
    micro = losses.put_minibatches(losses.split_minibatches({k: v[:8] for k, v in batch.items()}, 1, 1), mesh)
    temp = {}
    for schedule in ("1f1b", "gpipe"):
        compiled = _train_step(mesh, params, micro, schedule)
        assert "collective-permute" in compiled.as_text()
        temp[schedule] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["1f1b"] < temp["gpipe"], temp


def test_unknown_schedule_names_the_valid_ones(devices):
    with pytest.raises(PipelineError, match="unknown pipeline schedule 'pipedream'; valid: 1f1b, gpipe"):
        check_schedule("pipedream")
    with pytest.raises(Exception, match="trainer.pipeline_schedule: expected one of '1f1b', 'gpipe'"):
        load_config(None, ["trainer.pipeline_schedule=pipedream"])


@pytest.fixture(scope="module")
def warm4(tmp_path_factory):
    """A warm-started 4-layer actor (150 supervised steps of the tiny job, as the ``warm`` fixture's 2-layer
    one), so pp = 4 divides its layers and every layer has a real gradient from the first step. Trained over
    4 devices: over 8, this model's supervised steps hang in a CPU collective under jax 0.10.2 (with or
    without the pipeline code)."""
    cfg = tiny_config(["model.num_layers=4", "trainer.warmup_sft_steps=150", "cluster.num_devices=4"])
    cache = str(tmp_path_factory.getbasetemp() / "warm4-cache")
    return jax.tree.map(np.asarray, warm_actor(cfg, cache))


def _run(overrides, warm):
    """Three GRPO steps of the tiny job with 4 layers: per-step metrics, the actor after them, the compiled
    train programs' HLO and the plan."""
    job = tiny_job(["algorithm.name=grpo", "model.num_layers=4"] + overrides, actor=warm)
    try:
        metrics = [job.step(s).metrics for s in range(3)]
        programs = job.stages.prepare_programs(job.plan, changed_only=False)  # compiled ahead, as a move would
        hlo = [c.as_text() for key, c in programs.items() if key[0] == "train"]
        return metrics, job.actor_host_params(), hlo, job.plan
    finally:
        job.close()


@pytest.fixture(scope="module")
def flat(warm4):
    return _run([], warm4)


@pytest.mark.long  # ~35 s for the pp = 1 job, ~12 s per pipelined run
@pytest.mark.parametrize("pp", [2, 4])
def test_job_with_pp_trains_as_pp1_with_1f1b(warm4, flat, pp):
    """GRPO with actor-train and ref-infer at pp (dp = 8 / pp), 1F1B training, against the pp = 1 job: the
    compiled train program is the pipelined one; the first step (same parameters in) gives the same loss, kl,
    reward and gradient norm within 1e-5; over 3 steps the metrics and the actor's parameters stay within
    1e-5 of the pp = 1 job's, or within 4x of where GPipe (the other valid reduction order of the same
    pipeline) lands, whichever is larger.

    Why the GPipe envelope after the first step: AdamW's update g / (|g| + eps) divides a coordinate's gradient
    by itself, so where a gradient is within ~10 eps of 0 the float noise of any other reduction order (another
    micro-batch split, GPipe's too) moves the update by a good part of lr, and the next steps' metrics with it
    (measured: step 1's gradient norm 8.47917 at pp = 1, 8.47916 under GPipe, 8.47915 under 1F1B; the first
    step's agree within 5e-7). A schedule bug (a wrong tick, a dropped micro-batch, optimizer state on the wrong
    stage) moves them by orders of magnitude more."""
    stages = [f"plan.stages.{s}.{key}={v}" for s in ("actor-train", "ref-infer")
              for key, v in (("pp", pp), ("dp", 8 // pp))]
    metrics, params, hlo, plan = _run(stages + ["trainer.pipeline_schedule=1f1b"], warm4)
    gp_metrics, gp_params, _, _ = _run(stages + ["trainer.pipeline_schedule=gpipe"], warm4)
    ref_metrics, ref_params, ref_hlo, _ = flat
    assert {str(ms): sp.layout.pp for ms, sp in plan.items()} == {"actor-gen": 1, "ref-infer": pp, "actor-train": pp}
    assert hlo and all("collective-permute" in h for h in hlo)
    assert not any("collective-permute" in h for h in ref_hlo)
    keys = ("loss", "kl", "reward_mean", "grad_norm")
    for key in keys:
        assert abs(metrics[0][key] - ref_metrics[0][key]) < 1e-5, (key, metrics[0][key], ref_metrics[0][key])
    for step, (a, g, b) in enumerate(zip(metrics, gp_metrics, ref_metrics, strict=True)):
        for key in keys:
            assert abs(a[key] - b[key]) <= max(1e-5, 4 * abs(g[key] - b[key])), (step, key, a[key], g[key], b[key])

    def close(a, g, b):
        a, g, b = (np.asarray(x) for x in (a, g, b))
        assert np.max(np.abs(a - b)) <= max(1e-5, 4 * float(np.max(np.abs(g - b))))

    jax.tree.map(close, params, gp_params, ref_params)
