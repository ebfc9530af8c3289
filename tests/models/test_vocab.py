"""Vocabulary-chunked log-probs, entropy and their gradients equal the whole-logits computation.

Reference: ``vocab_chunk=0`` (one ``tokens x vocab`` logits tensor, ``jax.nn.log_softmax``, autodiff), on
vocabularies that are and are not a multiple of the chunk (padded chunks), tied and untied heads, padded
and masked batches, and through the actor loss on tp 1/2/4 meshes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.config import AlgorithmConfig, ModelConfig
from nereus_jax.models import init_params
from nereus_jax.models.vocab import head_logprobs
from nereus_jax.runtime.step.losses import actor_loss
from nereus_jax.sharding import Layout, make_mesh, shard_params
from nereus_jax.vocab_chunks import chunk_width, vocab_split


@pytest.mark.parametrize("vocab", [151936, 128256, 152064, 32000, 50257, 1000, 1003, 997])
@pytest.mark.parametrize("chunk", [100, 256, 4096, 8192, 32768])
def test_vocab_split_covers_the_vocabulary_and_keeps_its_factor_of_two(vocab, chunk):
    n, padded = vocab_split(vocab, chunk)
    width = padded // n
    assert n * width == padded >= vocab and padded - vocab < width  # no chunk is all padding
    assert chunk_width(vocab, chunk) == width
    if padded == vocab:  # a split of the vocabulary itself: a tp split of it (up to 8) splits every chunk evenly
        assert width % np.gcd(vocab, 8) == 0
    if vocab > chunk:
        assert chunk / 4 <= width <= 4 * chunk


def test_real_vocabularies_split_without_padding_at_the_default_chunk():
    assert vocab_split(151936, 8192) == (16, 151936)  # Qwen3: 16 chunks of 9,496 ids
    assert vocab_split(128256, 8192) == (16, 128256)  # Llama 3
    assert vocab_split(100, 8192) == (1, 100)


def _head(vocab, tied, seed=0, d=32):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(vocab, d) if tied else (d, vocab)) * 0.5, jnp.float32)
    return {"embed": {"embedding": w}} if tied else {"lm_head": {"kernel": w}}


@pytest.mark.parametrize("vocab,chunk,tied", [(1000, 250, False), (1000, 250, True), (1003, 256, False),
                                              (997, 100, True)])
def test_chunked_logprobs_entropy_and_gradients_equal_whole_logits(vocab, chunk, tied):
    assert (vocab_split(vocab, chunk)[1] > vocab) == (vocab in (1003, 997))  # both split kinds are covered
    rng = np.random.default_rng(1)
    params = _head(vocab, tied)
    h = jnp.asarray(rng.normal(size=(3, 7, 32)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, size=(3, 7)))
    targets = targets.at[0, 0].set(vocab - 1).at[0, 1].set(0)  # the last id (in a padded chunk) and the first
    g_logp, g_ent = (jnp.asarray(rng.normal(size=(3, 7)), jnp.float32) for _ in range(2))

    def f(params, h, c):
        logp, ent = head_logprobs(params, h, targets, vocab_chunk=c, entropy=True)
        return jnp.sum(logp * g_logp) + jnp.sum(ent * g_ent), (logp, ent)

    grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True), static_argnums=2)
    (_, (logp0, ent0)), grads0 = grad(params, h, 0)
    (_, (logp1, ent1)), grads1 = grad(params, h, chunk)
    np.testing.assert_allclose(logp1, logp0, atol=1e-5)
    np.testing.assert_allclose(ent1, ent0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grads1, grads0)
    assert float(jnp.max(jnp.abs(ent0))) > 1.0 and float(jnp.max(jnp.abs(grads0[1]))) > 1e-2  # not trivially 0


def test_logprobs_without_entropy_match_and_return_no_entropy():
    params, rng = _head(1000, False), np.random.default_rng(2)
    h = jnp.asarray(rng.normal(size=(2, 5, 32)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 1000, size=(2, 5)))
    logp, ent = head_logprobs(params, h, targets, vocab_chunk=128)
    assert ent is None
    np.testing.assert_allclose(logp, head_logprobs(params, h, targets, vocab_chunk=0)[0], atol=1e-5)


CFG = dataclasses.replace(ModelConfig(), vocab_size=1000)  # 1000 ids: chunks of 200 at vocab_chunk=256
P, R, B = 6, 5, 8


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, size=(B, P + R)).astype(np.int32)
    plen, rlen = rng.integers(2, P + 1, size=B), rng.integers(1, R + 1, size=B)
    prompt_mask = (np.arange(P)[None] >= P - plen[:, None]).astype(np.int32)
    resp_mask = (np.arange(R)[None] < rlen[:, None]).astype(np.int32)
    return {"tokens": tokens, "mask": np.concatenate([prompt_mask, resp_mask], 1), "response_mask": resp_mask,
            "old_logp": rng.normal(-7, 0.1, size=(B, R)).astype(np.float32),
            "ref_logp": rng.normal(-7, 0.1, size=(B, R)).astype(np.float32),
            "advantages": (rng.normal(size=(B, R)) * resp_mask).astype(np.float32),
            "denom": np.float32(resp_mask.sum()), "seq_denom": np.float32(B)}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_actor_loss_and_gradients_chunked_equal_unchunked_on_tp_meshes(devices, tp):
    algo = AlgorithmConfig(kl_in_reward=False, entropy_coef=0.01)
    params = init_params(CFG, seed=0)
    mesh = make_mesh(devices[:tp], Layout(tp))
    sharded = shard_params(params, CFG, Layout(tp), mesh)
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    out = {}
    for chunk in (0, 256):
        fn = jax.jit(jax.value_and_grad(actor_loss(CFG, algo, P, vocab_chunk=chunk), has_aux=True))
        (loss, metrics), grads = fn(sharded, batch)
        out[chunk] = (loss, metrics, grads)
    (l0, m0, g0), (l1, m1, g1) = out[0], out[256]
    np.testing.assert_allclose(l1, l0, atol=1e-5)
    for k in ("entropy", "kl_loss", "policy_loss"):
        np.testing.assert_allclose(m1[k], m0[k], atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g1, g0)
    if tp > 1:  # the head's gradient keeps the kernel's vocabulary split
        assert g1["lm_head"]["kernel"].sharding.spec == sharded["lm_head"]["kernel"].sharding.spec
