"""The decoder against its own references: one device vs tensor parallel, the engine's cached decode path
(``nereus_jax.engine.decode``) vs the uncached ``forward``, padding, heads, Qwen3's q/k norms, full-size shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.config import ModelConfig, RopeScalingConfig, resolve_model
from nereus_jax.engine import decode
from nereus_jax.models import (
    Decoder,
    abstract_params,
    count_params,
    forward,
    init_params,
    param_axes,
)
from nereus_jax.sharding import Layout, activation_sharding, make_mesh, shard_params

TINY = ModelConfig()
# Qwen3-shaped: per-head q/k RMSNorm, head_dim (32) != hidden / heads (16), tied embeddings, GQA.
QWEN3 = ModelConfig(name="qwen3-tiny", family="qwen3", qk_norm=True, head_dim=32, tie_embeddings=True,
                    rms_norm_eps=1e-6, rope_theta=1e6)


@pytest.fixture(scope="module")
def params():
    return init_params(TINY, seed=0)


def _tokens(b, t, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, TINY.vocab_size)


def test_forward_returns_float32_logits_of_vocab_size(params):
    logits = forward(params, TINY, _tokens(2, 7))
    assert logits.shape == (2, 7, TINY.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_nnx_module_call_equals_pure_forward(params):
    model = Decoder(TINY, rngs=__import__("flax").nnx.Rngs(0))
    tokens = _tokens(2, 5)
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(forward(model.params(), TINY, tokens)))


def test_right_padding_changes_nothing_at_real_positions(params):
    tokens = _tokens(1, 6)
    padded = jnp.concatenate([tokens, jnp.zeros((1, 3), jnp.int32)], axis=1)
    mask = jnp.array([[1] * 6 + [0] * 3])
    ref = forward(params, TINY, tokens)
    out = forward(params, TINY, padded, attention_mask_bt=mask)
    np.testing.assert_allclose(np.asarray(out[:, :6]), np.asarray(ref), atol=1e-6)


def test_left_padding_with_mask_matches_unpadded(params):
    tokens = _tokens(1, 6, seed=3)
    padded = jnp.concatenate([jnp.full((1, 4), 5, jnp.int32), tokens], axis=1)
    mask = jnp.array([[0] * 4 + [1] * 6])
    ref = forward(params, TINY, tokens)
    out = forward(params, TINY, padded, attention_mask_bt=mask)  # positions derived from the mask
    np.testing.assert_allclose(np.asarray(out[:, 4:]), np.asarray(ref), atol=1e-5)


def test_pad_token_values_are_irrelevant(params):
    tokens = _tokens(2, 8, seed=1)
    mask = jnp.array([[1] * 5 + [0] * 3, [1] * 8])
    other = tokens.at[0, 5:].set(jnp.array([1, 2, 3]))
    a = forward(params, TINY, tokens, attention_mask_bt=mask)
    b = forward(params, TINY, other, attention_mask_bt=mask)
    np.testing.assert_array_equal(np.asarray(a[0, :5]), np.asarray(b[0, :5]))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def test_cache_rows_advance_independently(params):
    """Two slots at different lengths in one engine decode call each match their own full forward."""
    a, b = _tokens(1, 7, seed=4), _tokens(1, 4, seed=5)
    unstacked = decode.unstack_layers(params)
    _, cache_a = decode.run(unstacked, TINY, a[:, :6], jnp.zeros(1, jnp.int32), _caches(TINY, 1, 12))
    _, cache_b = decode.run(unstacked, TINY, b[:, :3], jnp.zeros(1, jnp.int32), _caches(TINY, 1, 12))
    caches = jax.tree.map(lambda x, y: jnp.concatenate([x, y], axis=0), cache_a, cache_b)
    step_tokens = jnp.concatenate([a[:, 6:7], b[:, 3:4]], axis=0)
    hidden, _ = decode.run(unstacked, TINY, step_tokens, jnp.array([6, 3], jnp.int32), caches)
    out = decode.logits(unstacked, hidden[:, 0])
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(forward(params, TINY, a)[0, 6]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(forward(params, TINY, b)[0, 3]), atol=1e-5)


def _caches(cfg, batch, length):
    return decode.empty_caches(cfg, batch, length, cfg.num_kv_heads, jnp.float32)


def test_value_head_returns_per_token_values():
    params = init_params(TINY, seed=1, head="value", num_labels=1)
    assert "lm_head" not in params and params["value_head"]["kernel"].shape == (TINY.hidden_size, 1)
    values = forward(params, TINY, _tokens(3, 5))
    assert values.shape == (3, 5, 1)


def test_tied_embeddings_have_no_lm_head_and_use_embedding():
    cfg = dataclasses.replace(TINY, tie_embeddings=True)
    params = init_params(cfg, seed=0)
    assert "lm_head" not in params
    hidden = forward(params, cfg, _tokens(1, 3), return_hidden=True)
    logits = forward(params, cfg, _tokens(1, 3))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(hidden @ params["embed"]["embedding"].T), atol=1e-5)


def test_qkv_bias_params_exist_only_when_configured():
    assert "bq" not in init_params(TINY)["layers"]["attn"]
    biased = init_params(dataclasses.replace(TINY, qkv_bias=True))
    assert biased["layers"]["attn"]["bq"].shape == (TINY.num_layers, TINY.num_heads, TINY.head_dim)


def test_remat_gives_identical_logits_and_grads(params):
    cfg = dataclasses.replace(TINY, remat=True)
    tokens = _tokens(2, 6, seed=7)
    loss = lambda p, c: jnp.mean(forward(p, c, tokens) ** 2)  # noqa: E731
    np.testing.assert_allclose(np.asarray(loss(params, cfg)), np.asarray(loss(params, TINY)), rtol=1e-6)
    g1, g2 = jax.grad(loss)(params, cfg), jax.grad(loss)(params, TINY)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6), g1, g2)


def _random_norms(params: dict, seed: int) -> dict:
    """init_params sets norm scales to one; random scales make a misplaced or skipped norm change the output."""
    rng = np.random.RandomState(seed)
    out = jax.tree.map(np.asarray, params)
    attn = out["layers"]["attn"]
    for name in ("q_norm", "k_norm"):
        if name in attn:
            attn[name]["scale"] = (1.0 + 0.3 * rng.standard_normal(attn[name]["scale"].shape)).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def qwen3_params():
    return _random_norms(init_params(QWEN3, seed=4), seed=4)


def test_qk_norm_params_are_per_layer_head_dim_vectors(qwen3_params):
    attn = qwen3_params["layers"]["attn"]
    assert attn["q_norm"]["scale"].shape == attn["k_norm"]["scale"].shape == (QWEN3.num_layers, QWEN3.head_dim)
    assert param_axes(QWEN3)["layers"]["attn"]["k_norm"]["scale"] == ("layers", "head_dim")
    assert "q_norm" not in init_params(TINY)["layers"]["attn"]


def test_qk_norm_normalises_each_head_of_q_and_k_before_rope(qwen3_params):
    """Against a hand-written single-layer reference: the norm over head_dim sits between projection and RoPE."""
    from nereus_jax.models.layers import apply_rope, attention, rms_norm, rope_inv_freq, swiglu

    cfg = dataclasses.replace(QWEN3, num_layers=1)
    p = {**qwen3_params, "layers": jax.tree.map(lambda x: x[:1], qwen3_params["layers"])}
    tokens = _tokens(2, 6, seed=8)
    lp = jax.tree.map(lambda x: x[0], p["layers"])
    a, eps = lp["attn"], cfg.rms_norm_eps
    x = p["embed"]["embedding"][tokens]
    h = rms_norm(x, lp["attn_norm"]["scale"], eps)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta)

    def heads(w, scale):
        y = jnp.einsum("btd,dhe->bthe", h, w)
        y32 = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
        return apply_rope(scale * y32, pos, inv)

    q, k = heads(a["wq"], a["q_norm"]["scale"]), heads(a["wk"], a["k_norm"]["scale"])
    v = jnp.einsum("btd,dhe->bhte", h, a["wv"])
    out = attention(q, k.transpose(0, 2, 1, 3), v, jnp.tril(jnp.ones((6, 6), bool))[None])
    x = x + jnp.einsum("bthe,hed->btd", out, a["wo"])
    x = x + swiglu(rms_norm(x, lp["mlp_norm"]["scale"], eps), lp["mlp"]["w_gate"], lp["mlp"]["w_up"],
                   lp["mlp"]["w_down"])
    ref = rms_norm(x, p["final_norm"]["scale"], eps) @ p["embed"]["embedding"].T
    np.testing.assert_allclose(np.asarray(forward(p, cfg, tokens)), np.asarray(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen3_sharded_forward_matches_one_device(qwen3_params, devices, tp):
    """q_norm/k_norm (axes layers, head_dim) stay whole on every tp rank; tp=4 exceeds the 2 kv heads."""
    tokens = _tokens(2, 9, seed=6)
    mask = jnp.array([[0] * 3 + [1] * 6, [1] * 9])
    ref = np.asarray(forward(qwen3_params, QWEN3, tokens, None, mask))
    layout = Layout(tp=tp)
    mesh = make_mesh(devices[:tp], layout)
    sharded = shard_params(qwen3_params, QWEN3, layout, mesh)
    assert sharded["layers"]["attn"]["q_norm"]["scale"].sharding.is_fully_replicated
    with activation_sharding(mesh, "train"):
        logits = jax.jit(forward, static_argnums=1)(sharded, QWEN3, tokens, None, mask)
    assert len(logits.sharding.device_set) == tp
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cfg", [pytest.param(TINY, id="llama", marks=pytest.mark.smoke),
                                 pytest.param(dataclasses.replace(TINY, qkv_bias=True), id="qkv_bias"),
                                 pytest.param(QWEN3, id="qwen3"),
                                 pytest.param(dataclasses.replace(QWEN3, family="qwen3_moe", num_experts=4,
                                                                  num_experts_per_tok=2, moe_intermediate_size=64),
                                              id="qwen3_moe")])
def test_engine_decode_path_equals_forward_for_prefill_and_each_step(cfg):
    """The engine's unrolled per-layer path (nereus_jax.engine.decode) against models.forward, per family."""
    raw = _random_norms(init_params(cfg, seed=2), seed=2)
    if cfg.qkv_bias:
        raw["layers"]["attn"] = {k: v + 0.1 if k.startswith("b") else v for k, v in raw["layers"]["attn"].items()}
    params = decode.unstack_layers(raw)
    run = jax.jit(decode.run, static_argnums=1)
    tokens = _tokens(2, 10, seed=9)
    full = np.asarray(forward(raw, cfg, tokens))
    caches = decode.empty_caches(cfg, 2, 16, cfg.num_kv_heads, jnp.float32)
    hidden, caches = run(params, cfg, tokens[:, :6], jnp.zeros(2, jnp.int32), caches)
    prefill = jax.vmap(lambda h: decode.logits(params, h), in_axes=1, out_axes=1)(hidden)
    np.testing.assert_allclose(np.asarray(prefill), full[:, :6], atol=1e-5, rtol=0)
    for t in range(6, 10):
        hidden, caches = run(params, cfg, tokens[:, t:t + 1], jnp.full(2, t, jnp.int32), caches)
        np.testing.assert_allclose(np.asarray(decode.logits(params, hidden[:, 0])), full[:, t], atol=1e-5, rtol=0)


def test_qwen3_cached_decode_matches_full_forward(qwen3_params):
    """The engine's cached decode of Qwen3 filled to the cache's last slot equals the uncached forward."""
    tokens = _tokens(2, 8, seed=10)
    full = forward(qwen3_params, QWEN3, tokens)
    params = decode.unstack_layers(qwen3_params)
    hidden, caches = decode.run(params, QWEN3, tokens[:, :5], jnp.zeros(2, jnp.int32), _caches(QWEN3, 2, 8))
    steps = [jax.vmap(lambda h: decode.logits(params, h), in_axes=1, out_axes=1)(hidden)]
    for t in range(5, 8):
        hidden, caches = decode.run(params, QWEN3, tokens[:, t:t + 1], jnp.full(2, t, jnp.int32), caches)
        steps.append(decode.logits(params, hidden[:, 0])[:, None])
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), atol=1e-5)


@pytest.mark.smoke
def test_qwen3_8b_has_8_19b_params_without_allocating():
    """Reference: the Qwen/Qwen3-8B model card, "Number of Parameters: 8.2B; Number of Paramaters
    (Non-Embedding): 6.95B" (8.19e9 to three figures: untied 151,936 x 4,096 embedding and lm head)."""
    cfg = resolve_model("qwen3-8b")
    shapes = abstract_params(cfg)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    n = count_params(shapes)
    assert abs(n - 8.19e9) / 8.19e9 < 5e-3, n
    embedding = 2 * cfg.vocab_size * cfg.hidden_size
    assert abs(n - embedding - 6.95e9) / 6.95e9 < 5e-3, n - embedding


@pytest.mark.smoke
def test_llama31_8b_has_8_03b_params_without_allocating():
    shapes = abstract_params(resolve_model("llama3.1-8b"))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    n = count_params(shapes)
    assert abs(n - 8.03e9) / 8.03e9 < 1e-3, n


def test_rope_scaling_changes_only_long_wavelengths():
    from nereus_jax.models.layers import rope_inv_freq

    scaling = RopeScalingConfig(factor=8.0, original_max_position_embeddings=64)
    plain = rope_inv_freq(64, 500000.0)
    scaled = rope_inv_freq(64, 500000.0, scaling)
    wavelen = 2 * np.pi / plain
    np.testing.assert_array_equal(scaled[wavelen < 64 / 4.0], plain[wavelen < 64 / 4.0])
    np.testing.assert_allclose(scaled[wavelen > 64], plain[wavelen > 64] / 8.0, rtol=1e-6)


def test_an_out_of_range_token_id_never_turns_the_logits_into_nan():
    """jnp.take fills out-of-range ids with NaN by default; one such id would poison every later position."""
    cfg = ModelConfig()
    params = init_params(cfg, seed=0)
    tokens = jnp.asarray([[1, 5, cfg.vocab_size + 7, 9]], jnp.int32)
    logits = np.asarray(forward(params, cfg, tokens))
    assert np.isfinite(logits).all()
