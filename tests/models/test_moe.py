"""Qwen3-MoE against its references: the routed experts against every expert run densely and masked by the
router's top-k (exactly the same function), transformers' Qwen3MoeForCausalLM (logits within 1e-4, padded,
3.11 lane), the engine's decode path against the full forward, tp-sharded against one device, and the HF export
round trip bit for bit (the engine's decode path: tests/models/test_decoder.py, family qwen3_moe)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.config import ConfigError, ModelConfig
from nereus_jax.models import forward, init_params
from nereus_jax.models import layers as L
from nereus_jax.models.hf import load_hf, save_hf
from nereus_jax.sharding import Layout, activation_sharding, make_mesh, shard_params

MOE = ModelConfig(family="qwen3_moe", qk_norm=True, vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6)


def _tokens(b, t, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(1, MOE.vocab_size, (b, t)), jnp.int32)


@pytest.fixture(scope="module")
def params():
    return init_params(MOE, seed=0)


@pytest.mark.parametrize("norm", [True, False])
def test_routed_experts_equal_every_expert_masked_by_the_top_k(params, norm):
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 7, 32)), jnp.float32)
    m = jax.tree.map(lambda a: a[0], params["layers"]["moe"])
    weights, experts = L.route(x, m["router"], 2, norm)
    dense = jnp.stack([L.swiglu(x, m["w_gate"][e], m["w_up"][e], m["w_down"][e]) for e in range(8)], axis=2)
    gate = jnp.zeros((3, 7, 8)).at[jnp.arange(3)[:, None, None], jnp.arange(7)[None, :, None], experts].set(weights)
    want = jnp.einsum("bted,bte->btd", dense, gate)
    got = L.moe_mlp(x, m["router"], m["w_gate"], m["w_up"], m["w_down"], 2, norm)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    if norm:
        np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, atol=1e-6)
    # every parameter, the router included (through the weights), gets a gradient
    grads = jax.grad(lambda mm: jnp.sum(L.moe_mlp(x, mm["router"], mm["w_gate"], mm["w_up"], mm["w_down"], 2,
                                                  norm) ** 2))(m)
    assert all(float(jnp.abs(g).sum()) > 0 for g in grads.values())


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_moe_forward_matches_one_device(params, devices, tp):
    tokens, mask = _tokens(2, 9, seed=6), jnp.array([[0] * 3 + [1] * 6, [1] * 9])
    ref = np.asarray(forward(params, MOE, tokens, None, mask))
    layout = Layout(tp=tp)
    mesh = make_mesh(devices[:tp], layout)
    sharded = shard_params(jax.tree.map(np.asarray, params), MOE, layout, mesh)
    with activation_sharding(mesh, "train"):
        logits = jax.jit(forward, static_argnums=1)(sharded, MOE, tokens, None, mask)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-5, rtol=0)


def test_hf_export_round_trips_bit_for_bit(params, tmp_path):
    host = jax.tree.map(np.asarray, params)
    save_hf(tmp_path, MOE, host)
    cfg, back = load_hf(tmp_path)
    assert cfg.num_experts == 8 and cfg.moe_intermediate_size == 16 and cfg.family == "qwen3_moe"
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(x, y)


def test_bad_moe_settings_are_refused_with_the_fix():
    import dataclasses

    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        dataclasses.replace(MOE, num_experts_per_tok=9)
    with pytest.raises(ConfigError, match="qwen3_moe"):
        dataclasses.replace(MOE, family="qwen3")
    with pytest.raises(ConfigError, match="adapters on experts"):
        dataclasses.replace(MOE, lora_rank=4)


def test_hf_parity_qwen3_moe_logits_match_transformers_on_a_padded_batch(tmp_path):
    if os.environ.get("NEREUS_REQUIRE_HF") == "1":
        import torch
        import transformers
    else:
        why = "Hugging Face parity needs torch and transformers (pip install -e '.[hf]' on Python 3.11)"
        torch = pytest.importorskip("torch", reason=why)
        transformers = pytest.importorskip("transformers", reason=why)
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=64, initializer_range=0.2,
        attn_implementation="eager")
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    cfg, ours = load_hf(tmp_path)
    mask = np.ones((3, 10), np.int64)
    mask[1, :4] = 0
    mask[2, 7:] = 0
    tokens = np.where(mask == 1, np.random.RandomState(0).randint(1, 96, (3, 10)), 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions), use_cache=False).logits.numpy()
    got = np.asarray(forward(ours, cfg, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))
    real = mask == 1
    np.testing.assert_allclose(got[real], ref[real], atol=1e-4, rtol=0)
    # our export loads in transformers and gives the same logits
    save_hf(tmp_path / "ours", cfg, ours)
    again = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        back = again(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions), use_cache=False).logits.numpy()
    np.testing.assert_allclose(back[real], ref[real], atol=1e-5, rtol=0)
