"""The decoder against its own uncached reference: padding, KV cache, heads, full-size shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.config import ModelConfig, RopeScalingConfig, resolve_model
from nereus_jax.models import (
    Decoder,
    abstract_params,
    count_params,
    forward,
    forward_with_cache,
    init_cache,
    init_params,
)

TINY = ModelConfig()


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


@pytest.mark.smoke
def test_cached_prefill_then_decode_matches_full_forward(params):
    tokens = _tokens(2, 10, seed=2)
    full = forward(params, TINY, tokens)
    cache = init_cache(TINY, batch=2, max_len=16)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    logits, cache = forward_with_cache(params, TINY, tokens[:, :6], pos, cache)
    steps = [logits]
    for t in range(6, 10):
        out, cache = forward_with_cache(params, TINY, tokens[:, t:t + 1], jnp.full((2, 1), t), cache)
        steps.append(out)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), atol=1e-5)


def test_cache_rows_advance_independently(params):
    """Two slots at different lengths in one decode call each match their own full forward."""
    a, b = _tokens(1, 7, seed=4), _tokens(1, 4, seed=5)
    cache = init_cache(TINY, batch=2, max_len=12)
    cache_a = init_cache(TINY, batch=1, max_len=12)
    _, cache_a = forward_with_cache(params, TINY, a[:, :6], jnp.arange(6)[None], cache_a)
    cache_b = init_cache(TINY, batch=1, max_len=12)
    _, cache_b = forward_with_cache(params, TINY, b[:, :3], jnp.arange(3)[None], cache_b)
    cache = jax.tree.map(lambda x, y: jnp.concatenate([x, y], axis=1), cache_a, cache_b)
    step_tokens = jnp.concatenate([a[:, 6:7], b[:, 3:4]], axis=0)
    out, _ = forward_with_cache(params, TINY, step_tokens, jnp.array([[6], [3]]), cache)
    np.testing.assert_allclose(np.asarray(out[0, 0]), np.asarray(forward(params, TINY, a)[0, 6]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[1, 0]), np.asarray(forward(params, TINY, b)[0, 3]), atol=1e-5)


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
