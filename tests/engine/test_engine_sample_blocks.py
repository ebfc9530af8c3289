"""Sampling over blocks of rows (``sample_blocks``) draws exactly what sampling the whole batch draws, at a
real vocabulary size (151,936), with greedy, temperature, top-k and top-p rows mixed, repeated prefill rows
and a last block that is padded; and its compiled working memory is a block's, not the batch's."""

import jax
import jax.numpy as jnp
import numpy as np

from nereus_jax.engine.sampling import Requests, block_rows, make_requests, sample, sample_blocks

VOCAB = 151_936


def _requests(n: int) -> Requests:
    req = make_requests(n, 2, seed=11, prompt=np.arange(n) // 2, stop_tokens=(3,))
    kinds = np.arange(n) % 4  # greedy, plain temperature, top-k, top-p
    req = req._replace(sample=(np.arange(n) % 2).astype(np.int32),
                       temperature=np.where(kinds == 0, 0.0, 0.7 + 0.1 * kinds).astype(np.float32),
                       top_k=np.where(kinds == 2, 40, 0).astype(np.int32),
                       top_p=np.where(kinds == 3, 0.9, 1.0).astype(np.float32))
    return jax.tree.map(jnp.asarray, req)


def _logits(rows: int) -> jax.Array:
    return jax.random.normal(jax.random.key(5), (rows, VOCAB), jnp.float32) * 3.0


def test_blocks_draw_what_the_whole_batch_draws_at_a_real_vocabulary():
    n = 70  # block_rows(VOCAB) = 27: two full blocks and a padded one
    logits, requests = _logits(n), _requests(n)
    index = jnp.arange(n, dtype=jnp.int32) % 5
    want_t, want_lp = jax.jit(sample)(logits, requests, index)
    got_t, got_lp = jax.jit(sample_blocks)(logits, requests, index)
    assert block_rows(VOCAB) < n
    np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want_t))
    np.testing.assert_allclose(np.asarray(got_lp), np.asarray(want_lp), rtol=0, atol=1e-6)
    assert len(set(np.asarray(want_t[1::4]).tolist())) > 10  # sampled rows really sample


def test_repeated_rows_draw_what_repeating_the_logits_draws():
    rows, repeat = 23, 4  # the prefill path: each prompt row's logits serve its samples
    logits, requests = _logits(rows), _requests(rows * repeat)
    index = jnp.zeros((rows * repeat,), jnp.int32)
    want_t, want_lp = jax.jit(sample)(jnp.repeat(logits, repeat, axis=0), requests, index)
    got_t, got_lp = jax.jit(sample_blocks, static_argnames="repeat")(logits, requests, index, repeat=repeat)
    np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want_t))
    np.testing.assert_allclose(np.asarray(got_lp), np.asarray(want_lp), rtol=0, atol=1e-6)


def _temp_bytes(fn, n: int) -> int:
    args = (jax.ShapeDtypeStruct((n, VOCAB), jnp.float32), jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _requests(n)), jax.ShapeDtypeStruct((n,), jnp.int32))
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_working_memory_is_one_blocks_not_the_batchs():
    """256 decode slots: XLA's temporaries of the blocked sampler are those of sampling one block alone
    (within a quarter: the output buffers and the last block's), a fraction of the whole batch's."""
    whole, blocked, one_block = _temp_bytes(sample, 256), _temp_bytes(sample_blocks, 256), _temp_bytes(
        sample, block_rows(VOCAB))
    assert whole > 4 * 256 * VOCAB * 4  # sampling the whole batch holds several [256, vocab] arrays
    assert blocked <= 1.25 * one_block, (blocked, one_block)
    assert blocked < whole / 5, (blocked, whole)
