"""Training steps: the update does not depend on the DP degree, micro-batching or tp layout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nereus_jax.config import AlgorithmConfig, ModelConfig
from nereus_jax.elastic.topology import accumulation_steps
from nereus_jax.models import init_params
from nereus_jax.runtime.step.losses import (
    actor_loss,
    critic_loss,
    make_optimizer,
    make_train_step,
    response_logprobs,
    split_micro,
)
from nereus_jax.sharding import Layout, gather_params, make_mesh, shard_params

CFG = ModelConfig()
P, R, B = 6, 5, 8


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, size=(B, P + R)).astype(np.int32)
    plen = rng.integers(2, P + 1, size=B)
    rlen = rng.integers(1, R + 1, size=B)
    prompt_mask = (np.arange(P)[None] >= P - plen[:, None]).astype(np.int32)
    resp_mask = (np.arange(R)[None] < rlen[:, None]).astype(np.int32)
    return {
        "tokens": tokens, "mask": np.concatenate([prompt_mask, resp_mask], 1), "response_mask": resp_mask,
        "old_logp": rng.normal(-3, 0.1, size=(B, R)).astype(np.float32),
        "advantages": rng.normal(size=(B, R)).astype(np.float32) * resp_mask,
        "ref_logp": rng.normal(-3, 0.1, size=(B, R)).astype(np.float32),
        "old_values": rng.normal(size=(B, R)).astype(np.float32),
        "returns": rng.normal(size=(B, R)).astype(np.float32),
        "denom": np.float32(resp_mask.sum()),
    }


def _run_step(params, batch, layout, dp, accum, loss, devices):
    mesh = make_mesh(devices[: layout.size * dp], layout, dp=dp)
    sharded = shard_params(params, CFG, layout, mesh)
    # SGD keeps the update linear in the gradient: Adam's first step is ~lr * sign(g), which turns
    # float-order noise in near-zero gradients into lr-sized differences and would test nothing.
    opt = optax.sgd(1.0)
    opt_state = opt.init(sharded)
    micro = split_micro(batch, accum)
    data = {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec(None, "dp") if v.ndim > 1 else PartitionSpec()))
            for k, v in micro.items()}
    step = jax.jit(make_train_step(loss, opt, CFG))
    new, _, metrics = step(sharded, opt_state, data)
    return gather_params(new, CFG), jax.tree.map(float, metrics)


@pytest.fixture(scope="module")
def reference(devices):
    params = init_params(CFG, seed=0)
    loss = actor_loss(CFG, AlgorithmConfig(kl_in_reward=False, entropy_coef=0.01), P)
    return params, loss, _run_step(params, _batch(), Layout(1), 1, 1, loss, devices)


@pytest.mark.parametrize("tp,dp,accum", [(1, 2, 1), (1, 4, 2), (2, 2, 2), (4, 1, 4), (2, 4, 1)])
def test_actor_update_is_independent_of_layout_dp_and_micro_batching(reference, devices, tp, dp, accum):
    params, loss, (ref_params, ref_metrics) = reference
    new, metrics = _run_step(params, _batch(), Layout(tp), dp, accum, loss, devices)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6), new, ref_params)


def test_tp_above_kv_heads_keeps_kv_copies_identical_after_an_update(devices):
    params = init_params(CFG, seed=1)
    mesh = make_mesh(devices[:4], Layout(4))
    sharded = shard_params(params, CFG, Layout(4), mesh)
    opt = make_optimizer(1e-2)
    data = jax.device_put(split_micro(_batch(), 1), NamedSharding(mesh, PartitionSpec()))
    loss = actor_loss(CFG, AlgorithmConfig(), P)
    new, _, _ = jax.jit(make_train_step(loss, opt, CFG))(sharded, opt.init(sharded), data)
    wk = np.asarray(new["layers"]["attn"]["wk"])  # [L, D, 4 stored = 2 heads x 2 copies, E]
    np.testing.assert_array_equal(wk[:, :, 0], wk[:, :, 1])
    np.testing.assert_array_equal(wk[:, :, 2], wk[:, :, 3])


def test_critic_update_is_independent_of_dp(devices):
    params = init_params(CFG, seed=2, head="value")
    loss = critic_loss(CFG, AlgorithmConfig(), P)
    a, ma = _run_step(params, _batch(1), Layout(1), 1, 1, loss, devices)
    b, mb = _run_step(params, _batch(1), Layout(2), 4, 1, loss, devices)
    np.testing.assert_allclose(ma["value_loss"], mb["value_loss"], rtol=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=2e-6), a, b)


def test_response_logprobs_ignore_prompt_padding():
    params = init_params(CFG, seed=3)
    batch = _batch(2)
    row = 0
    plen = int(batch["mask"][row, :P].sum())
    full = response_logprobs(params, CFG, jnp.asarray(batch["tokens"][row:row + 1]),
                             jnp.asarray(batch["mask"][row:row + 1]), P)
    unpadded = batch["tokens"][row:row + 1, P - plen:]
    alone = response_logprobs(params, CFG, jnp.asarray(unpadded), jnp.ones_like(unpadded), plen)
    real = batch["response_mask"][row] == 1  # response padding is masked in `full`, attended in `alone`
    np.testing.assert_allclose(np.asarray(full)[0, real], np.asarray(alone)[0, real], atol=1e-5)


def test_accumulation_steps_fit_the_token_budget_and_divide_the_batch():
    assert accumulation_steps(rows=32, dp=2, seq_len=64, micro_batch_tokens=4096) == 1
    assert accumulation_steps(rows=32, dp=2, seq_len=64, micro_batch_tokens=256) == 4
    assert accumulation_steps(rows=24, dp=2, seq_len=64, micro_batch_tokens=320) == 3  # 12 rows, 5 fit -> 3x4
    with pytest.raises(ValueError, match="dp=5"):
        accumulation_steps(rows=32, dp=5, seq_len=64, micro_batch_tokens=256)
