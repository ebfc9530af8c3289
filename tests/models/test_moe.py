"""Qwen3-MoE against its references: the routed experts against every expert run densely and masked by the
router's top-k (exactly the same function), transformers' Qwen3MoeForCausalLM (logits and the load-balancing
loss within 1e-4 / 1e-5, padded, 3.11 lane), the engine's decode path against the full forward, tp-sharded and
pipelined against one device, and the HF export round trip bit for bit (the engine's decode path:
tests/models/test_decoder.py, family qwen3_moe).

Routing replay and the load-balancing loss against a reference written out here layer by layer with every
expert run on every token: replayed routes equal the logits (and router gradients) of a model whose router
logits are raised by 1e4 at the recorded experts (its own top-k is then the record, its renormalised weights
its softmax there); the loss equals transformers' formula in numpy on that reference's router logits."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_reference import hf_load_balancing_loss_numpy, overridden_router_forward, random_routes

from nereus_jax.config import ConfigError, ModelConfig
from nereus_jax.models import forward, init_params
from nereus_jax.models import layers as L
from nereus_jax.models.hf import load_hf, save_hf
from nereus_jax.models.routing import load_balancing_loss
from nereus_jax.sharding import Layout, activation_sharding, make_mesh, shard_params
from nereus_jax.sharding.pipeline import pipeline_forward, pipeline_forward_fn

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
    weights, experts = L.route(x, m["router"], 2, norm)[:2]
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


@pytest.mark.parametrize("impl,block_rows", [("ragged_dot", None), ("blocks", 2), ("blocks", 4), ("blocks", 64)])
def test_every_grouped_matmul_equals_every_expert_masked_forward_and_gradients(params, impl, block_rows):
    """Skewed routes (replayed: most pairs on experts 0 and 3, experts 5-7 empty) make groups of several blocks,
    partial last blocks and empty groups; the gradients are the hand-written backward of 'blocks'."""
    x = jnp.asarray(np.random.default_rng(8).normal(size=(2, 9, 32)), jnp.float32)
    m = jax.tree.map(lambda a: a[1], params["layers"]["moe"])
    skew = np.random.default_rng(9).choice([0, 3, 1, 2, 4], size=(2, 9), p=[0.4, 0.3, 0.1, 0.1, 0.1])
    forced = jnp.asarray(np.stack([skew, (skew + 3) % 5], -1), jnp.int32)

    def moe(x, mm):
        routed = L.route(x, mm["router"], 2, True, forced)
        return L.experts_mlp(x, routed, mm["w_gate"], mm["w_up"], mm["w_down"], impl=impl, block_rows=block_rows)

    def masked(x, mm):
        routed = L.route(x, mm["router"], 2, True, forced)
        gate = jnp.einsum("btke,btk->bte", jax.nn.one_hot(routed.experts, 8), routed.weights)
        every = jnp.stack([L.swiglu(x, mm["w_gate"][e], mm["w_up"][e], mm["w_down"][e]) for e in range(8)], axis=2)
        return jnp.einsum("bted,bte->btd", every, gate)

    np.testing.assert_allclose(np.asarray(moe(x, m)), np.asarray(masked(x, m)), atol=1e-6, rtol=0)
    loss = lambda f: lambda x, mm: jnp.sum(jnp.sin(f(x, mm)))  # noqa: E731
    got, want = jax.grad(loss(moe), argnums=(0, 1))(x, m), jax.grad(loss(masked), argnums=(0, 1))(x, m)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    assert float(jnp.abs(got[1]["w_down"][5:]).max()) == 0 and float(jnp.abs(got[1]["w_down"][0]).max()) > 0


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


def _hf():
    if os.environ.get("NEREUS_REQUIRE_HF") == "1":
        import torch
        import transformers
    else:
        why = "Hugging Face parity needs torch and transformers (pip install -e '.[hf]' on Python 3.11)"
        torch = pytest.importorskip("torch", reason=why)
        transformers = pytest.importorskip("transformers", reason=why)
    return torch, transformers


def _hf_moe_and_padded_batch(tmp_path, seed: int, **extra):
    """A random transformers Qwen3-MoE saved to and loaded from ``tmp_path``, and a padded 3 x 10 batch:
    (torch, transformers, model, (cfg, ours), tokens, positions, mask)."""
    torch, transformers = _hf()
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=64, initializer_range=0.2,
        attn_implementation="eager", **extra)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    mask = np.ones((3, 10), np.int64)
    mask[1, :4] = 0
    mask[2, 7:] = 0
    tokens = np.where(mask == 1, np.random.RandomState(seed).randint(1, 96, (3, 10)), 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return torch, transformers, model, load_hf(tmp_path), tokens, positions, mask


def test_hf_parity_qwen3_moe_logits_match_transformers_on_a_padded_batch(tmp_path):
    torch, transformers, model, (cfg, ours), tokens, positions, mask = _hf_moe_and_padded_batch(tmp_path, 0)
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


def test_hf_parity_qwen3_moe_load_balancing_loss_matches_transformers_aux_loss(tmp_path):
    torch, _, model, (cfg, ours), tokens, positions, mask = _hf_moe_and_padded_batch(
        tmp_path, 1, output_router_logits=True)
    with torch.no_grad():
        want = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions), use_cache=False).aux_loss.item()
    _, stats = forward(ours, cfg, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask),
                       return_routing=True)
    assert float(stats.tokens) == mask.sum()
    np.testing.assert_allclose(float(load_balancing_loss(stats)), want, rtol=1e-5)


# ------------------------------------------------------------------------------ routing replay and the aux loss
def test_replayed_routes_equal_a_model_whose_router_is_overridden(params):
    tokens, mask = _tokens(3, 9, seed=2), jnp.array([[0] * 3 + [1] * 6, [1] * 9, [1] * 7 + [0] * 2])
    routes = random_routes(MOE, 3, 9, seed=3)
    got = forward(params, MOE, tokens, None, mask, routes_btlk=routes, replay=True)
    want = overridden_router_forward(params, MOE, tokens, mask, routes)[0]
    real = np.asarray(mask) == 1
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5, rtol=0)
    own = forward(params, MOE, tokens, None, mask)
    assert np.abs(np.asarray(own) - np.asarray(got))[real].max() > 1e-2  # the routes changed the logits
    # the router still learns: its gradient through the replayed gates is the overridden model's
    loss = lambda f: lambda p: jnp.sum(jnp.where(mask[..., None] == 1, f(p), 0.0) ** 2)  # noqa: E731
    g = jax.grad(loss(lambda p: forward(p, MOE, tokens, None, mask, routes_btlk=routes, replay=True)))(params)
    g_ref = jax.grad(loss(lambda p: overridden_router_forward(p, MOE, tokens, mask, routes)[0]))(params)
    router, router_ref = np.asarray(g["layers"]["moe"]["router"]), np.asarray(g_ref["layers"]["moe"]["router"])
    assert np.abs(router).max() > 1e-3
    np.testing.assert_allclose(router, router_ref, atol=2e-5 * np.abs(router_ref).max(), rtol=0)


def test_the_mismatch_names_tokens_whose_recorded_routes_differ_from_their_own(params):
    tokens, mask = _tokens(2, 8, seed=4), jnp.array([[0] * 2 + [1] * 6, [1] * 8])
    _, gate_logits = overridden_router_forward(params, MOE, tokens, mask)
    own = jax.lax.top_k(jax.nn.softmax(gate_logits, axis=-1), MOE.num_experts_per_tok)[1]  # [layers, b, t, k]
    routes = np.asarray(jnp.moveaxis(own, 0, 2)).astype(np.int16)
    routes[0, 5, 1] = [(routes[0, 5, 1, 0] + 1 + j) % MOE.num_experts for j in range(2)]  # a changed set
    routes[1, 3, 0] = routes[1, 3, 0, ::-1]  # the same set in another order: no mismatch
    routes[1, 6] = -1  # no record
    for replay in (False, True):
        _, stats = forward(params, MOE, tokens, None, mask, routes_btlk=jnp.asarray(routes), replay=replay,
                           return_routing=True)
        expected = np.zeros((2, 8), bool)
        expected[0, 5] = True
        np.testing.assert_array_equal(np.asarray(stats.own_mismatch_bt), expected)
        np.testing.assert_array_equal(np.asarray(stats.mismatch_bt), expected & (not replay))


def test_load_balancing_loss_is_transformers_formula_on_the_real_tokens(params):
    tokens, mask = _tokens(3, 9, seed=5), jnp.array([[0] * 3 + [1] * 6, [1] * 9, [1] * 7 + [0] * 2])
    _, stats = forward(params, MOE, tokens, None, mask, return_routing=True)
    _, gate_logits = overridden_router_forward(params, MOE, tokens, mask)
    want = hf_load_balancing_loss_numpy(gate_logits, mask, MOE.num_experts_per_tok)
    np.testing.assert_allclose(float(load_balancing_loss(stats)), want, rtol=1e-6)
    assert float(stats.tokens) == int(mask.sum())
    np.testing.assert_array_equal(np.asarray(stats.counts_le).sum(-1), int(mask.sum()) * MOE.num_experts_per_tok)
    # gradients reach the router through the probabilities only (the counts are a top-k)
    g = jax.grad(lambda p: load_balancing_loss(forward(p, MOE, tokens, None, mask, return_routing=True)[1]))(params)
    assert float(jnp.abs(g["layers"]["moe"]["router"]).max()) > 0
    assert float(jnp.abs(g["layers"]["moe"]["w_gate"][-1]).max()) == 0  # the last layer's experts feed no router


@pytest.mark.parametrize("layout,m", [(Layout(pp=2), 2), (Layout(tp=2, pp=2), 4)])
def test_pipelined_routing_equals_one_device(params, devices, layout, m):
    tokens, mask = _tokens(4, 9, seed=6), jnp.array([[0] * 3 + [1] * 6, [1] * 9, [1] * 9, [0] + [1] * 8])
    routes = random_routes(MOE, 4, 9, seed=7)

    def run(p, fn):
        def loss(p):
            logits, stats = fn(p, routes_btlk=routes, replay=True, return_routing=True)
            return jnp.mean(logits ** 2) + load_balancing_loss(stats), (logits, stats)
        return jax.value_and_grad(loss, has_aux=True)(p)

    (_, (logits, stats)), grads = run(params, lambda p, **kw: forward(p, MOE, tokens, None, mask, **kw))
    mesh = make_mesh(devices[:layout.size], layout)
    sharded = shard_params(jax.tree.map(np.asarray, params), MOE, layout, mesh)
    piped = lambda p, **kw: pipeline_forward(p, MOE, tokens, None, mask, mesh=mesh, microbatches=m, **kw)  # noqa: E731
    with activation_sharding(mesh, "train"):
        (_, (logits2, stats2)), grads2 = jax.jit(lambda p: run(p, piped))(sharded)
    np.testing.assert_allclose(np.asarray(logits2), np.asarray(logits), atol=1e-5, rtol=0)
    for name in ("counts_le", "probs_le", "tokens"):
        np.testing.assert_allclose(np.asarray(getattr(stats2, name)), np.asarray(getattr(stats, name)), atol=1e-5)
    for name in ("mismatch_bt", "own_mismatch_bt"):
        np.testing.assert_array_equal(np.asarray(getattr(stats2, name)), np.asarray(getattr(stats, name)))
    assert np.asarray(stats.own_mismatch_bt).any()
    for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


_EP_MASK = jnp.array([[0] * 3 + [1] * 6, [1] * 9, [1] * 7 + [0] * 2, [0] + [1] * 8])


def _ep_loss(fn):
    """value_and_grad of the padded batch's mean squared logit over its real tokens."""
    def f(p):
        logits = fn(p)
        real = jnp.where(_EP_MASK[..., None] == 1, logits, 0.0)
        return jnp.sum(real ** 2) / (jnp.sum(_EP_MASK) * MOE.vocab_size), logits
    return jax.value_and_grad(f, has_aux=True)


@pytest.fixture(scope="module")
def one_device_ep_reference(params):
    tokens = _tokens(4, 9, seed=6)
    return tokens, _ep_loss(lambda p: forward(p, MOE, tokens, None, _EP_MASK))(params)


@pytest.mark.parametrize("layout,dp", [(Layout(ep=4), None), (Layout(tp=2, ep=2), None), (Layout(ep=2), 2)])
def test_expert_parallel_forward_and_gradients_equal_one_device(params, devices, one_device_ep_reference, layout,
                                                                 dp):
    """Experts split over ep ranks (alone, beside tp, or in dp replicas): the same logits and gradients as one
    device, on a padded batch; each rank holds and runs only its experts (nothing gathered)."""
    tokens, ((_, want), grads) = one_device_ep_reference
    mesh = make_mesh(devices[:layout.size * (dp or 1)], layout, dp=dp)
    sharded = shard_params(jax.tree.map(np.asarray, params), MOE, layout, mesh)
    w = sharded["layers"]["moe"]["w_gate"]
    assert w.sharding.shard_shape(w.shape)[1] == MOE.num_experts // layout.ep
    fn = pipeline_forward_fn(mesh, 2)  # what the job's programs run: the expert-parallel layer installed
    program = jax.jit(_ep_loss(lambda p: fn(p, MOE, tokens, None, _EP_MASK))).lower(sharded)
    program = program.compile()
    assert "all-gather" not in program.as_text()  # no expert's weights gathered: each rank runs its own
    (_, got), grads2 = program(sharded)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
