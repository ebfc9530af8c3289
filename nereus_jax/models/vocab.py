"""Token log-probabilities and entropies from final hidden states, over vocabulary chunks.

A real vocabulary (Qwen3: 151,936 tokens) makes ``tokens x vocab`` float32 logits the largest array of a
training or scoring call: 4,096 tokens give 2.5 GB, before ``log_softmax``, its exponent and the gradient
each add as much again. :func:`head_logprobs` never builds it: the output projection and the softmax run
over ``n`` vocabulary chunks with a running log-sum-exp (and a running softmax-weighted logit sum for the
entropy), and a custom VJP recomputes each chunk's logits in the backward pass, so the largest
vocabulary-sized array of a call is ``tokens x chunk``. ``vocab_chunk=0`` builds the whole logits tensor
as the plain path does (the reference the tests compare with).

Chunk ``c`` holds vocabulary ids ``c, c + n, c + 2n, ...`` (a strided split): a vocabulary split over tp
in contiguous blocks keeps every chunk split over tp the same way, so each device computes its own
part of every chunk and only per-token scalars cross devices. How a vocabulary splits
(:func:`~nereus_jax.vocab_chunks.vocab_split`) is JAX-free, so the cost model counts the same chunks.

    logp_bt, ent_bt = head_logprobs(params, hidden_btd, targets_bt, vocab_chunk=8192, entropy=True)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from nereus_jax.models.layers import constrain
from nereus_jax.vocab_chunks import DEFAULT_VOCAB_CHUNK, vocab_split

__all__ = ["DEFAULT_VOCAB_CHUNK", "head_kernel", "head_logprobs", "vocab_split"]

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def head_kernel(params: dict) -> tuple[jax.Array, int]:
    """The language-model output projection and its vocabulary axis: ``lm_head/kernel`` [embed, vocab]
    (axis 1), or the tied embedding [vocab, embed] (axis 0)."""
    if "lm_head" in params:
        return params["lm_head"]["kernel"], 1
    return params["embed"]["embedding"], 0


def head_logprobs(params: dict, hidden_btd: jax.Array, targets_bt: jax.Array, *, vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                  entropy: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """log p(target) [b, t] (float32) and, with ``entropy``, the softmax entropy [b, t] of the logits of
    ``hidden_btd`` (the final-normed hidden states) under the model's output projection, over
    ``vocab_chunk``-wide vocabulary chunks (0, or a vocabulary that fits one chunk: the whole logits tensor
    at once, as the plain forward computes it)."""
    w, axis = head_kernel(params)
    vocab = w.shape[axis]
    if vocab_chunk <= 0 or vocab <= vocab_chunk:
        return _unchunked(hidden_btd, w, axis, targets_bt, entropy)
    n, padded = vocab_split(vocab, vocab_chunk)
    if padded > vocab:
        w = jnp.pad(w, [(0, padded - vocab) if a == axis else (0, 0) for a in range(2)])
    # [embed, width, n] (axis 1) or [width, n, embed] (axis 0): chunk c is index c of the n axis
    w3 = w.reshape(w.shape[0], padded // n, n) if axis == 1 else w.reshape(padded // n, n, w.shape[1])
    logp, ent = _chunked(hidden_btd, w3, targets_bt.astype(jnp.int32), axis, vocab, entropy)
    return logp, ent if entropy else None


def _unchunked(h, w, axis, targets, entropy):
    spec = "btd,dv->btv" if axis == 1 else "btd,vd->btv"
    logits = constrain(jnp.einsum(spec, h, w).astype(jnp.float32), ("batch", "length", "vocab"))
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1) if entropy else None


def _chunk_of(w3: jax.Array, axis: int, c: jax.Array) -> jax.Array:
    """Chunk ``c``'s columns: [embed, width] (axis 1) or [width, embed] (axis 0)."""
    return jax.lax.dynamic_index_in_dim(w3, c, axis=2 if axis == 1 else 1, keepdims=False)


def _chunk_logits(h, w3, axis, c, vocab):
    """float32 logits [b, t, width] of chunk ``c`` (ids c, c + n, ...); padded ids get a large negative value.
    Returns them with the chunk's ids' validity [width]."""
    spec = "btd,dv->btv" if axis == 1 else "btd,vd->btv"
    logits = jnp.einsum(spec, h, _chunk_of(w3, axis, c), preferred_element_type=jnp.float32)
    logits = constrain(logits, ("batch", "length", "vocab"))
    n = w3.shape[2 if axis == 1 else 1]
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32) * n + c
    if logits.shape[-1] * n == vocab:  # no padded ids
        return logits, ids, None
    valid = ids < vocab
    return jnp.where(valid, logits, _MASK_VALUE), ids, valid


def _n_chunks(w3, axis) -> int:
    return w3.shape[2 if axis == 1 else 1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked(h, w3, targets, axis, vocab, entropy):
    return _forward(h, w3, targets, axis, vocab, entropy)[0]


def _forward(h, w3, targets, axis, vocab, entropy):
    """One pass over the chunks: running max m, sum s of exp(l - m), sum u of exp(l - m) l (entropy), and the
    target's logit z. lse = m + log s; entropy = lse - u / s."""
    b, t = targets.shape

    def body(carry, c):
        m, s, u, z = carry
        logits, ids, _ = _chunk_logits(h, w3, axis, c, vocab)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(logits - m_new[..., None])
        s = s * scale + jnp.sum(e, axis=-1)
        if entropy:
            u = u * scale + jnp.sum(e * logits, axis=-1)
        z = z + jnp.sum(jnp.where(ids == targets[..., None], logits, 0.0), axis=-1)
        return (m_new, s, u, z), None

    zeros = jnp.zeros((b, t), jnp.float32)
    init = (jnp.full((b, t), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    (m, s, u, z), _ = jax.lax.scan(body, init, jnp.arange(_n_chunks(w3, axis), dtype=jnp.int32))
    lse = m + jnp.log(s)
    ent = lse - u / s if entropy else zeros
    return (z - lse, ent), (h, w3, targets, lse, ent)


def _backward(axis, vocab, entropy, residuals, cotangents):
    """Recomputes each chunk's logits: d logp / d l = onehot - p; d entropy / d l = -p (l - lse + H)."""
    h, w3, targets, lse, ent = residuals
    g_logp, g_ent = cotangents
    h_spec, w_spec = ("btv,dv->btd", "btd,btv->dv") if axis == 1 else ("btv,vd->btd", "btd,btv->vd")

    def body(carry, c):
        dh, dw3 = carry
        logits, ids, valid = _chunk_logits(h, w3, axis, c, vocab)
        p = jnp.exp(logits - lse[..., None])
        factor = g_logp[..., None] + (g_ent[..., None] * (logits - lse[..., None] + ent[..., None]) if entropy else 0.0)
        g = jnp.where(ids == targets[..., None], g_logp[..., None], 0.0) - p * factor
        g = g if valid is None else jnp.where(valid, g, 0.0)
        w_c = _chunk_of(w3, axis, c)
        dh = dh + jnp.einsum(h_spec, g.astype(w_c.dtype), w_c, preferred_element_type=jnp.float32)
        dw_c = jnp.einsum(w_spec, h, g.astype(h.dtype), preferred_element_type=jnp.float32).astype(w3.dtype)
        dw3 = jax.lax.dynamic_update_index_in_dim(dw3, dw_c, c, axis=2 if axis == 1 else 1)
        return (dh, dw3), None

    init = (jnp.zeros(h.shape, jnp.float32), jnp.zeros_like(w3))
    (dh, dw3), _ = jax.lax.scan(body, init, jnp.arange(_n_chunks(w3, axis), dtype=jnp.int32))
    return dh.astype(h.dtype), dw3, np.zeros(targets.shape, jax.dtypes.float0)


_chunked.defvjp(lambda h, w3, targets, axis, vocab, entropy: _forward(h, w3, targets, axis, vocab, entropy),
                _backward)
