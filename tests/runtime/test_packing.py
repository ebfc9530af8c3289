"""Sequence packing (trainer.packing): a packed batch computes what the padded batch computes, losses and
gradients within 1e-5 in float32 for mixed lengths, under dp; the layout keeps every real token once and
each segment to itself; the job's steps with packing match the padded job's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jobs import tiny_config, tiny_job

from nereus_jax.config import AlgorithmConfig, ModelConfig, load_config
from nereus_jax.models import init_params
from nereus_jax.rl import packing
from nereus_jax.runtime.step import losses
from nereus_jax.sharding import Layout, make_mesh

CFG = ModelConfig()
P, R, B = 7, 9, 16


def _batch(seed=0):
    """Mixed prompt and response lengths (1..P, 1..R), the padded layout of nereus_jax.rl.batch."""
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(1, P + 1, B), rng.integers(1, R + 1, B)
    mask = np.zeros((B, P + R), np.int32)
    for i in range(B):
        mask[i, P - plen[i]:P + rlen[i]] = 1
    tokens = (rng.integers(3, CFG.vocab_size, size=(B, P + R)) * mask).astype(np.int32)
    resp = mask[:, P:]
    return {"tokens": tokens, "mask": mask, "response_mask": resp,
            "old_logp": rng.normal(-4.9, 0.3, size=(B, R)).astype(np.float32) * resp,
            "ref_logp": rng.normal(-4.9, 0.3, size=(B, R)).astype(np.float32) * resp,
            "advantages": rng.normal(size=(B, R)).astype(np.float32) * resp,
            "old_values": rng.normal(size=(B, R)).astype(np.float32) * resp,
            "returns": rng.normal(size=(B, R)).astype(np.float32) * resp}


def _packed(batch, mini, dp, budget_rows, quantum=None):
    layout = packing.pack(batch["tokens"], batch["mask"], prompt_len=P, mini=mini, dp=dp, budget_rows=budget_rows,
                          quantum=quantum)
    return layout, losses.split_packed(batch, layout, mini)


def test_layout_holds_every_real_token_once_in_its_own_segment():
    batch = _batch(1)
    layout = packing.pack(batch["tokens"], batch["mask"], prompt_len=P, mini=2, dp=2, budget_rows=3)
    assert layout.packed_tokens == batch["mask"].sum()
    assert sorted(layout.order) == list(range(B))
    width, per_group = P + R, B // (2 * layout.accum * 2)
    for k, seq in enumerate(layout.order):
        real = batch["tokens"][seq][batch["mask"][seq] > 0]
        mi, ai, di = np.unravel_index(k // per_group, (2, layout.accum, 2))
        flat, seg, pos = (x[mi, ai, di].reshape(-1) for x in (layout.tokens, layout.segments, layout.positions))
        start, end = layout.last[k] + 1 - len(real), layout.last[k] + 1
        assert start // width == (end - 1) // width  # one row
        np.testing.assert_array_equal(flat[start:end], real)
        np.testing.assert_array_equal(pos[start:end], np.arange(len(real)))
        assert seg[start] > 0 and set(seg[start:end]) == {seg[start]}
        assert start % width == 0 or seg[start - 1] != seg[start]  # its own segment
        assert end % width == 0 or seg[end] != seg[start]
        resp = batch["mask"][seq, P:] > 0  # index + 1: the column of each response token
        np.testing.assert_array_equal(flat[layout.index[k][resp] + 1], batch["tokens"][seq, P:][resp])


def test_fewest_micro_batches_that_fit_the_budget_and_rows_up_the_ladder():
    batch = _batch(2)
    tight = packing.pack(batch["tokens"], batch["mask"], prompt_len=P, mini=1, dp=2, budget_rows=1)
    assert tight.rows == 1 and tight.accum > 1  # one packed row a micro-batch: more micro-batches
    loose = packing.pack(batch["tokens"], batch["mask"], prompt_len=P, mini=1, dp=2, budget_rows=16)
    exact = packing.pack(batch["tokens"], batch["mask"], prompt_len=P, mini=1, dp=2, budget_rows=16, quantum=1)
    assert loose.accum == exact.accum == 1 and loose.rows in (1, 2, 3, 4, 6, 8, 12, 16)
    assert exact.rows <= loose.rows < 1.42 * exact.rows  # the smallest rung that holds what is needed
    assert loose.tokens.size < B * (P + R)  # fewer token slots than the padded batch
    assert [packing._bucket(n) for n in range(1, 13)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12]


def test_bad_rows_are_refused():
    batch = _batch(3)
    mask = batch["mask"].copy()
    mask[0, P + 1] = 0  # a hole in the response
    mask[0, P + 2:] = 1
    with pytest.raises(ValueError, match="one run"):
        packing.pack(batch["tokens"], mask, prompt_len=P, mini=1, dp=1, budget_rows=4)


@pytest.mark.parametrize("algo", [
    AlgorithmConfig(name="ppo", kl_in_reward=False, entropy_coef=0.01),
    AlgorithmConfig(name="grpo", kl_in_reward=False, kl_coef=0.05),
    AlgorithmConfig(name="gspo", kl_in_reward=False),
    AlgorithmConfig(name="dr_grpo"),
], ids=lambda a: a.name)
@pytest.mark.parametrize("vocab_chunk", [0, 32], ids=["whole-vocab", "vocab-chunks"])
def test_packed_loss_and_gradients_equal_the_padded_batch(algo, vocab_chunk):
    """Token-mean (ppo, with entropy), seq-mean-token-mean (grpo, with the KL loss), GSPO's sequence ratio and
    Dr.GRPO's constant normaliser: loss and every gradient leaf within 1e-5 of the padded micro-batch, with the
    whole logits tensor and over vocabulary chunks (128 ids in 4 chunks)."""
    params = init_params(CFG, seed=0)
    batch = _batch(4)
    loss = losses.actor_loss(CFG, algo, P, vocab_chunk=vocab_chunk)
    padded = jax.tree.map(lambda x: x[0, 0], losses.split_minibatches(batch, 1, 1))
    layout, host = _packed(batch, mini=1, dp=1, budget_rows=16, quantum=1)
    assert layout.accum == 1
    packed = jax.tree.map(lambda x: x[0, 0], host)
    assert packed["packed_tokens"].size < batch["tokens"].size
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (want, _), want_g = grad(params, padded)
    (got, _), got_g = grad(params, packed)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got_g, want_g)
    assert max(jax.tree.leaves(diff)) <= 1e-5, diff


def test_packed_critic_loss_values_and_scores_equal_the_padded_batch():
    params = init_params(CFG, seed=1, head="value")
    batch = _batch(5)
    padded = jax.tree.map(lambda x: x[0, 0], losses.split_minibatches(batch, 1, 1))
    layout, host = _packed(batch, mini=1, dp=1, budget_rows=16, quantum=1)
    assert layout.accum == 1
    packed, order = jax.tree.map(lambda x: x[0, 0], host), layout.order
    critic = jax.jit(jax.value_and_grad(losses.critic_loss(CFG, AlgorithmConfig(), P), has_aux=True))
    (want, _), want_g = critic(params, padded)
    (got, _), got_g = critic(params, packed)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), got_g, want_g)
    mask = packed["response_mask"]  # packed outputs come in the layout's order
    np.testing.assert_allclose(losses.stage_values(params, CFG, packed, P) * mask,
                               np.asarray(losses.stage_values(params, CFG, padded, P))[order] * mask, atol=1e-5)
    np.testing.assert_allclose(losses.stage_scores(params, CFG, packed),
                               np.asarray(losses.stage_scores(params, CFG, padded))[order], atol=1e-5)


def test_packed_minibatch_updates_under_dp_equal_the_padded_program(eight_devices):
    """The whole training program (2 mini-batches, dp=4 replicas, several micro-batches) on packed input gives
    the padded program's parameters within 1e-5, and its gather stays on each replica (no all-gather)."""
    params = init_params(CFG, seed=2)
    batch = _batch(6)
    opt = optax.sgd(0.1)
    mesh = make_mesh(eight_devices[:4], Layout(), dp=4)
    step = jax.jit(losses.make_minibatch_train_step(losses.actor_loss(CFG, AlgorithmConfig(kl_in_reward=False), P),
                                                   opt, CFG))
    want, _, wm = step(params, opt.init(params), losses.put_minibatches(losses.split_minibatches(batch, 2, 2), mesh))
    layout, host = _packed(batch, mini=2, dp=4, budget_rows=1)
    assert layout.accum == 2  # the 2 sequences a replica holds per mini-batch do not fit one row of 16
    micro = losses.put_minibatches(host, mesh)
    got, _, gm = step(params, opt.init(params), micro)
    np.testing.assert_allclose(gm["loss"], wm["loss"], atol=1e-5, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), got, want)
    hlo = step.lower(params, opt.init(params), micro).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo


@pytest.fixture(scope="module")
def eight_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return jax.devices()


def test_job_with_packing_matches_the_padded_job(warm):
    """Two PPO steps (critic, actor-infer, ref-infer, critic-infer, both trainings) with trainer.packing=true:
    the same rollouts and metrics as padded, within float reduction order."""
    results = {}
    for packed in (False, True):
        job = tiny_job(["rollout.max_response_length=16", f"trainer.packing={packed}", "trainer.micro_batch_tokens=64"],
                       actor=warm)
        results[packed] = [job.step(s) for s in range(2)]
        job.close()
    for padded, packed in zip(results[False], results[True], strict=True):
        np.testing.assert_array_equal(padded.batch.response_br, packed.batch.response_br)
        for key in ("reward_mean", "kl", "loss", "policy_loss", "value_loss", "grad_norm"):
            np.testing.assert_allclose(packed.metrics[key], padded.metrics[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert 0 < results[True][-1].metrics["packing_fill"] <= 1 and "packing_fill" not in results[False][-1].metrics


def test_the_cost_model_prices_packed_tokens():
    """With trainer.packing the planner's workload is packed: a long-tailed step's training is priced by its
    mean length (cheaper than padding every row to the longest); equal lengths cost the same either way."""
    from dataclasses import replace

    from nereus_jax.elastic.costs import CostModel, StageChoice
    from nereus_jax.elastic.hardware import get_hardware
    from nereus_jax.elastic.workload import LengthStats, Workload

    cfg = load_config(None, ["model=qwen2.5-0.5b", "trainer.prompts_per_step=256", "trainer.packing=true"])
    wl = Workload.from_config(cfg)
    assert wl.packed and not Workload.from_config(tiny_config()).packed
    cost, choice = CostModel(get_hardware("h100")), StageChoice(1, 1, 8, 4)
    price = lambda w: cost.stage_latency(cfg.model, "actor-train", choice, w).total  # noqa: E731
    tail = wl.with_response_length(LengthStats(40.0, 300.0, 1024))
    assert price(tail) < 0.5 * price(replace(tail, packed=False))
    flat = wl.with_response_length(LengthStats.fixed(1024))
    assert price(flat) == pytest.approx(price(replace(flat, packed=False)), rel=0.05)
