"""The engine's model path: the decoder of ``nereus_jax.models`` with per-layer weights and per-layer KV
caches, the arrangement XLA:CPU decodes fastest.

The parameter tree is the model's, except that ``layers`` is a tuple of per-layer dicts (the stacked
arrays sliced once, in :func:`unstack_layers`), so the unrolled layer loop never slices stacked weights
inside the step. Each layer's cache is a pair ``(k, v)`` of ``[batch, kv_heads, length, head_dim]``
arrays updated in place (under buffer donation by the caller); :func:`run_paged` is the decode step over
paged caches (``nereus_jax.engine.paged``), with the same projections. Built only from
``nereus_jax.models.layers``; tests prove it equals ``nereus_jax.models.forward``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.engine import paged
from nereus_jax.models.decoder import mlp
from nereus_jax.models.layers import apply_rope, attention, constrain, project_heads, rms_norm, rope_inv_freq

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # as nereus_jax.models.layers
LayerCaches = tuple[tuple[jax.Array, jax.Array], ...]  # per layer (k, v) [batch, kv_heads, length, head_dim]


def unstack_layers(params: dict) -> dict:
    """The model's parameter tree with ``layers`` as a tuple of per-layer dicts (traceable)."""
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    per_layer = tuple(jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers))
    return {**params, "layers": per_layer}


def empty_caches(cfg: ModelConfig, batch: int, length: int, kv_heads: int, dtype) -> LayerCaches:
    """Zeroed per-layer caches."""
    shape = (batch, kv_heads, length, cfg.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))


def run(params: dict, cfg: ModelConfig, tokens_bt: jax.Array, start_b: jax.Array, caches: LayerCaches,
        only_b: jax.Array | None = None, *, record_routes: bool = False, span: jax.Array | None = None):
    """Runs row b's tokens at positions ``start_b[b] + 0..t-1``: writes their keys and values into the
    caches there and attends to cache entries at or before each token's position. Returns the final
    (normed) hidden states [b, t, embed] and the updated caches. The caller keeps positions in range.

    With ``only_b`` (an index into t per row) the result is that token's hidden state alone, [b, 1,
    embed]: the last layer then computes keys and values for every token but the rest only for that one
    (a prefill needs nothing else; it saves most of a layer).

    ``record_routes`` (mixture-of-experts models) also returns every token's routes, the router's top-k per
    layer ``[b, t, layers, k]`` int32 (the last layer then runs on every token, ``only_b`` or not).

    With ``span`` (traced) attention reads only the caches' first ``span`` positions, in blocks (a loop whose
    trip count is ``span`` over the block), so a cache much wider than the sequences costs what they hold; the
    caches' length must be a multiple of :func:`span_block` of it. Tokens attending past ``span`` see only
    what lies before it (give the longest row's length + tokens)."""
    positions_bt = start_b[:, None] + jnp.arange(tokens_bt.shape[1], dtype=jnp.int32)[None, :]
    length = caches[0][0].shape[2]
    mask_bts = jnp.arange(length, dtype=jnp.int32)[None, None, :] <= positions_bt[:, :, None]
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    x = constrain(jnp.take(params["embed"]["embedding"], tokens_bt, axis=0), ("batch", "length", "embed"))
    out, routes = [], []
    last = len(params["layers"]) - 1
    for i, (lp, (k_cache, v_cache)) in enumerate(zip(params["layers"], caches, strict=True)):
        x, k_cache, v_cache, routed = _layer(x, lp, cfg, positions_bt, start_b, inv_freq, mask_bts, k_cache,
                                             v_cache, only_b if i == last and not record_routes else None, span)
        out.append((k_cache, v_cache))
        routes.append(routed)
    if record_routes and only_b is not None:
        x = _pick(x, only_b)
    hidden = rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps)
    if not record_routes:
        return hidden, tuple(out)
    return hidden, tuple(out), stack_routes(routes)


def stack_routes(routed: list) -> jax.Array:
    """The layers' own top-k choices as ``[b, t, layers, k]`` int32 (a dense model has none to record)."""
    if routed[0] is None:
        raise ValueError("recording routes needs a mixture-of-experts model (model.num_experts > 0)")
    return jnp.stack([r.own for r in routed], axis=2)


def _pick(y: jax.Array, only_b: jax.Array) -> jax.Array:
    """Row b's entry ``only_b[b]`` along axis 1, keeping the axis."""
    return jnp.take_along_axis(y, only_b.reshape((-1, 1) + (1,) * (y.ndim - 2)), axis=1)


def logits(params: dict, x_bd: jax.Array) -> jax.Array:
    """float32 logits [b, vocab] of hidden states [b, embed]."""
    if "lm_head" in params:
        out = jnp.einsum("bd,dv->bv", x_bd, params["lm_head"]["kernel"])
    else:
        out = jnp.einsum("bd,vd->bv", x_bd, params["embed"]["embedding"])
    return constrain(out.astype(jnp.float32), ("batch", "vocab"))


def _layer(x, lp, cfg, positions_bt, start_b, inv_freq, mask_bts, k_cache, v_cache, only_b=None, span=None):
    a = lp["attn"]
    h = rms_norm(x, lp["attn_norm"]["scale"], cfg.rms_norm_eps)
    k, v = _keys_values(h, a, cfg, positions_bt, inv_freq)
    k_cache = _write_rows(k_cache, k, start_b)
    v_cache = _write_rows(v_cache, v, start_b)
    if only_b is not None:  # from here on, only the selected token of each row
        x, h, positions_bt, mask_bts = (_pick(y, only_b) for y in (x, h, positions_bt, mask_bts))
    q = _queries(h, a, cfg, positions_bt, inv_freq)
    if span is not None:
        out = _attend_span(q, k_cache, v_cache, positions_bt, span)
    elif q.shape[1] > 1:
        out = attention(q, k_cache, v_cache, mask_bts)
    else:
        out = _attend_one(q, k_cache, v_cache, mask_bts)
    x, routed = _finish(x, out, lp, cfg)
    return x, k_cache, v_cache, routed


def run_paged(params: dict, cfg: ModelConfig, tokens_b: jax.Array, positions_b: jax.Array, pools: LayerCaches,
              write_page_b: jax.Array, items: paged.Items, *, record_routes: bool = False):
    """One decode step over paged caches: slot b's token at ``positions_b[b]`` stores its keys and values
    in page ``write_page_b[b]`` (a page id past the pool: not stored) and attends to the pages ``items``
    lists (:func:`nereus_jax.engine.paged.work_items`). Returns the final hidden states [b, 1, embed] and
    the pools (and with ``record_routes`` the routes ``[b, 1, layers, k]``, as :func:`run`). The projections
    are :func:`run`'s; only where keys live and how they are read differ."""
    positions_bt = positions_b[:, None]
    offset_b = positions_b % pools[0][0].shape[2]
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    x = constrain(jnp.take(params["embed"]["embedding"], tokens_b[:, None], axis=0), ("batch", "length", "embed"))
    out, routes = [], []
    for lp, (k_pool, v_pool) in zip(params["layers"], pools, strict=True):
        a = lp["attn"]
        h = rms_norm(x, lp["attn_norm"]["scale"], cfg.rms_norm_eps)
        k, v = _keys_values(h, a, cfg, positions_bt, inv_freq)
        k_pool = paged.write(k_pool, k[:, 0], write_page_b, offset_b)
        v_pool = paged.write(v_pool, v[:, 0], write_page_b, offset_b)
        q = _queries(h, a, cfg, positions_bt, inv_freq)
        x, routed = _finish(x, paged.attend(q[:, 0], k_pool, v_pool, items)[:, None], lp, cfg)
        out.append((k_pool, v_pool))
        routes.append(routed)
    hidden = rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps)
    return (hidden, tuple(out), stack_routes(routes)) if record_routes else (hidden, tuple(out))


def _keys_values(h, a, cfg, positions_bt, inv_freq):
    k_norm = a["k_norm"]["scale"] if cfg.qk_norm else None
    k = apply_rope(project_heads(h, a["wk"], a.get("bk"), k_norm, cfg.rms_norm_eps), positions_bt, inv_freq)
    return k, project_heads(h, a["wv"], a.get("bv"))


def _queries(h, a, cfg, positions_bt, inv_freq):
    q_norm = a["q_norm"]["scale"] if cfg.qk_norm else None
    q = apply_rope(project_heads(h, a["wq"], a.get("bq"), q_norm, cfg.rms_norm_eps), positions_bt, inv_freq)
    return constrain(q, ("batch", "length", "heads", "head_dim"))


def _finish(x, out_bthe, lp, cfg):
    """The attention output projection and residual, then the MLP block; returns (x, its routing or None)."""
    x = constrain(x + jnp.einsum("bthe,hed->btd", out_bthe, lp["attn"]["wo"]), ("batch", "length", "embed"))
    h = rms_norm(x, lp["mlp_norm"]["scale"], cfg.rms_norm_eps)
    y, routed = mlp(h, lp, cfg)
    return constrain(x + y, ("batch", "length", "embed")), routed


def _attend_one(q_b1he: jax.Array, k_bkse: jax.Array, v_bkse: jax.Array, mask_b1s: jax.Array) -> jax.Array:
    """``layers.attention`` for one query token per row, without its query-length axis: a layout XLA:CPU
    runs faster."""
    b, _, h, e = q_b1he.shape
    k = k_bkse.shape[1]
    q = q_b1he.reshape(b, k, h // k, e)
    scores = jnp.einsum("bkge,bkse->bkgs", q, k_bkse).astype(jnp.float32) / np.float32(math.sqrt(e))
    scores = jnp.where(mask_b1s[:, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bkse.dtype)
    return jnp.einsum("bkgs,bkse->bkge", probs, v_bkse).reshape(b, 1, h, e)


def span_block(length: int) -> int:
    """Key positions :func:`run` reads a loop step with ``span``: 256 (fewer steps: XLA:CPU pays per step), or all
    of a shorter cache."""
    return min(256, length)


def _attend_span(q_bthe: jax.Array, k_bkse: jax.Array, v_bkse: jax.Array, positions_bt: jax.Array,
                 span: jax.Array) -> jax.Array:
    """``layers.attention`` (causal by ``positions_bt``) over the first ``span`` key positions only, a block at a
    time: one pass for the scores' maximum, one for the softmax's sum and the values it weights (divided at
    the end), so the work follows ``span``, not the caches' length. Returns [b, t, h, e]."""
    b, t, h, e = q_bthe.shape
    kv, g = k_bkse.shape[1], h // k_bkse.shape[1]
    block = span_block(k_bkse.shape[2])
    q = q_bthe.reshape(b, t, kv, g, e)
    steps = (jnp.maximum(span, 1) + block - 1) // block

    def scores(i):  # [b, kv, g, t, block] float32, masked
        keys = jax.lax.dynamic_slice_in_dim(k_bkse, i * block, block, axis=2)
        s = jnp.einsum("btkge,bkse->bkgts", q, keys).astype(jnp.float32) / np.float32(math.sqrt(e))
        place = i * block + jnp.arange(block, dtype=jnp.int32)
        return jnp.where(place[None, None, None, None, :] <= positions_bt[:, None, None, :, None], s, _MASK_VALUE)

    top = jax.lax.fori_loop(0, steps, lambda i, m: jnp.maximum(m, scores(i).max(-1)),
                            jnp.full((b, kv, g, t), _MASK_VALUE, jnp.float32))

    def add(i, carry):
        total, out = carry
        p = jnp.exp(scores(i) - top[..., None])
        values = jax.lax.dynamic_slice_in_dim(v_bkse, i * block, block, axis=2)
        return total + p.sum(-1), out + jnp.einsum("bkgts,bkse->bkgte", p.astype(v_bkse.dtype), values)

    zeros = (jnp.zeros_like(top), jnp.zeros((b, kv, g, t, e), v_bkse.dtype))
    total, out = jax.lax.fori_loop(0, steps, add, zeros)
    out = out / total[..., None].astype(out.dtype)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e)


def _write_rows(cache_bkse: jax.Array, new_btke: jax.Array, start_b: jax.Array) -> jax.Array:
    new_bkte = new_btke.transpose(0, 2, 1, 3).astype(cache_bkse.dtype)
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (0, s, 0)))(cache_bkse, new_bkte, start_b)
