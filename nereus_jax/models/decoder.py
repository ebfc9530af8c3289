"""The Llama/Qwen2/Qwen3-family decoder: a Flax NNX module over a pure, jit-friendly forward.

Layers are stacked along a leading ``layers`` axis and run under ``lax.scan``. Every parameter carries
its logical axis names as NNX metadata (``logical_axes``); no mesh axis name appears in this package.
The parameter tree (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``) is::

    embed/embedding            [vocab, embed]
    layers/attn_norm/scale     [layers, embed]
    layers/attn/wq             [layers, embed, heads, head_dim]      (+ bq [layers, heads, head_dim])
    layers/attn/wk, wv         [layers, embed, kv_heads, head_dim]   (+ bk, bv)
    layers/attn/wo             [layers, heads, head_dim, embed]
    layers/attn/q_norm/scale   [layers, head_dim]   (+ k_norm: per-head RMSNorm of q and k, Qwen3's qk_norm)
    layers/mlp_norm/scale      [layers, embed]
    layers/mlp/w_gate, w_up    [layers, embed, mlp];  layers/mlp/w_down [layers, mlp, embed]
    layers/moe/router          [layers, embed, router_experts]  (instead of layers/mlp with model.num_experts > 0)
    layers/moe/w_gate, w_up    [layers, experts, embed, mlp];  layers/moe/w_down [layers, experts, mlp, embed]
    final_norm/scale           [embed]
    lm_head/kernel             [embed, vocab]    (language-model head, absent when embeddings are tied)
    value_head/kernel          [embed, labels]   (value/score head for critic and reward models)
    layers/{attn,mlp}/<w>_lora_a, <w>_lora_b        (LoRA adapters when model.lora_rank > 0: models/lora.py)

Usage::

    model = Decoder(cfg, rngs=nnx.Rngs(0))                 # or head="value" for a critic
    logits_btv = model(tokens_bt, attention_mask_bt=mask)  # or: forward(params, cfg, tokens_bt, ...)
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nereus_jax.config import ModelConfig
from nereus_jax.models import lora
from nereus_jax.models.layers import (
    Routed,
    apply_rope,
    attention,
    constrain,
    current_replication,
    project_heads,
    rms_norm,
    rope_inv_freq,
    route,
    routed_experts,
    swiglu,
)
from nereus_jax.models.routing import RouterStats, layer_stats, with_mismatch

Head = Literal["lm", "value"]
_INIT_STD = 0.02


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, dtype, init: str = "normal") -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "lora_a":  # PEFT's Kaiming-uniform (a = sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        bound = 1.0 / math.sqrt(math.prod(shape[1:-1]))
        value = jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound).astype(dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


class _Norm(nnx.Module):
    def __init__(self, shape: tuple[int, ...], axes: tuple, dtype, rngs: nnx.Rngs):
        self.scale = _param(rngs, shape, axes, dtype, "ones")


class _Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        n, d, h, k, e = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = _param(rngs, (n, d, h, e), ("layers", "embed", "heads", "head_dim"), dtype)
        self.wk = _param(rngs, (n, d, k, e), ("layers", "embed", "kv_heads", "head_dim"), dtype)
        self.wv = _param(rngs, (n, d, k, e), ("layers", "embed", "kv_heads", "head_dim"), dtype)
        self.wo = _param(rngs, (n, h, e, d), ("layers", "heads", "head_dim", "embed"), dtype)
        if cfg.qkv_bias:
            self.bq = _param(rngs, (n, h, e), ("layers", "heads", "head_dim"), dtype, "zeros")
            self.bk = _param(rngs, (n, k, e), ("layers", "kv_heads", "head_dim"), dtype, "zeros")
            self.bv = _param(rngs, (n, k, e), ("layers", "kv_heads", "head_dim"), dtype, "zeros")
        if cfg.qk_norm:
            self.q_norm = _Norm((n, e), ("layers", "head_dim"), dtype, rngs)
            self.k_norm = _Norm((n, e), ("layers", "head_dim"), dtype, rngs)


class _Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        n, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        self.w_gate = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), dtype)
        self.w_up = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), dtype)
        self.w_down = _param(rngs, (n, f, d), ("layers", "mlp", "embed"), dtype)


class _Moe(nnx.Module):
    """Qwen3-MoE's sparse block: a router over ``num_experts`` SwiGLU experts stacked on an ``experts`` axis."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        n, d, e, f = cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        # the router's expert axis is its own logical axis: expert parallelism splits the experts' weights, the
        # router (small, and its softmax and top-k read every expert) stays whole on every device
        self.router = _param(rngs, (n, d, e), ("layers", "embed", "router_experts"), dtype)
        self.w_gate = _param(rngs, (n, e, d, f), ("layers", "experts", "embed", "mlp"), dtype)
        self.w_up = _param(rngs, (n, e, d, f), ("layers", "experts", "embed", "mlp"), dtype)
        self.w_down = _param(rngs, (n, e, f, d), ("layers", "experts", "mlp", "embed"), dtype)


class _Layers(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        shape, axes = (cfg.num_layers, cfg.hidden_size), ("layers", "embed")
        self.attn_norm = _Norm(shape, axes, dtype, rngs)
        self.attn = _Attention(cfg, dtype, rngs)
        self.mlp_norm = _Norm(shape, axes, dtype, rngs)
        if cfg.num_experts:
            self.moe = _Moe(cfg, dtype, rngs)
        else:
            self.mlp = _Mlp(cfg, dtype, rngs)
        for t in lora.targets(cfg):
            group = getattr(self, t.group)
            weight = getattr(group, t.weight)
            (shape_a, shape_b), (axes_a, axes_b) = (lora.adapter_shapes(cfg, weight.shape, t),
                                                    lora.adapter_axes(weight.get_metadata()["logical_axes"], t))
            setattr(group, t.a, _param(rngs, shape_a, axes_a, dtype, "lora_a"))
            setattr(group, t.b, _param(rngs, shape_b, axes_b, dtype, "zeros"))


class _Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)


class _Dense(nnx.Module):
    def __init__(self, shape: tuple[int, int], axes: tuple, dtype, rngs: nnx.Rngs):
        self.kernel = _param(rngs, shape, axes, dtype)


class Decoder(nnx.Module):
    """Llama/Qwen2/Qwen3 decoder with a language-model head (``head="lm"``) or a value head (``head="value"``)."""

    def __init__(self, cfg: ModelConfig, *, head: Head = "lm", num_labels: int = 1, rngs: nnx.Rngs,
                 dtype: str | None = None):
        if head not in ("lm", "value"):
            raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
        dtype = jnp.dtype(dtype or cfg.param_dtype)
        self.cfg = cfg
        self.embed = _Embed(cfg, dtype, rngs)
        self.layers = _Layers(cfg, dtype, rngs)
        self.final_norm = _Norm((cfg.hidden_size,), ("embed",), dtype, rngs)
        if head == "lm" and not cfg.tie_embeddings:
            self.lm_head = _Dense((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype, rngs)
        if head == "value":
            self.value_head = _Dense((cfg.hidden_size, num_labels), ("embed", "labels"), dtype, rngs)

    def params(self) -> dict:
        """The parameters as a plain nested dict of arrays (the tree :func:`forward` takes)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def __call__(self, tokens_bt, positions_bt=None, attention_mask_bt=None) -> jax.Array:
        return forward(self.params(), self.cfg, tokens_bt, positions_bt, attention_mask_bt)


def init_params(cfg: ModelConfig, seed: int = 0, *, head: Head = "lm", num_labels: int = 1) -> dict:
    """Fresh random parameters as a plain dict (float32 master weights unless cfg says otherwise)."""
    return Decoder(cfg, head=head, num_labels=num_labels, rngs=nnx.Rngs(seed)).params()


def abstract_params(cfg: ModelConfig, *, head: Head = "lm", num_labels: int = 1) -> dict:
    """Parameter shapes and dtypes (``jax.ShapeDtypeStruct``) without allocating anything."""
    model = nnx.eval_shape(lambda: Decoder(cfg, head=head, num_labels=num_labels, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def param_axes(cfg: ModelConfig, *, head: Head = "lm", num_labels: int = 1) -> dict:
    """The logical axis names of every parameter, as a dict shaped like the parameter tree."""
    model = nnx.eval_shape(lambda: Decoder(cfg, head=head, num_labels=num_labels, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state, is_leaf=is_var))


def count_params(params: dict) -> int:
    """Number of scalars in a parameter tree (arrays or ShapeDtypeStructs)."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def default_positions(tokens_bt: jax.Array, attention_mask_bt: jax.Array | None) -> jax.Array:
    """Positions counting only real tokens (left padding gets position 0), as HF generation does."""
    if attention_mask_bt is None:
        return jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
    return jnp.maximum(jnp.cumsum(attention_mask_bt.astype(jnp.int32), axis=1) - 1, 0)


def forward(params: dict, cfg: ModelConfig, tokens_bt: jax.Array, positions_bt: jax.Array | None = None,
            attention_mask_bt: jax.Array | None = None, *, return_hidden: bool = False,
            segment_ids_bt: jax.Array | None = None, routes_btlk: jax.Array | None = None, replay: bool = False,
            return_routing: bool = False, dropout_key: jax.Array | None = None
            ) -> jax.Array | tuple[jax.Array, RouterStats]:
    """Full (uncached) forward. Returns logits [b, t, vocab] (float32), or values [b, t, labels] for a
    value-head model, or the final hidden states [b, t, embed] with ``return_hidden``.

    ``attention_mask_bt`` (1 = real token) masks padding keys; attention is causal by index. Packed rows
    (:mod:`nereus_jax.rl.packing`) pass ``segment_ids_bt`` (1, 2, ... per sequence, 0 on padding: attention
    stays inside a segment) and their ``positions_bt`` (restarting per segment).

    Mixture-of-experts models: ``routes_btlk`` are recorded routes (the engine's top-k per token and layer, -1
    where none was recorded); with ``replay`` every recorded token uses them instead of the router's own choice.
    ``return_routing`` returns ``(output, RouterStats)`` (:mod:`nereus_jax.models.routing`), counted over the
    real tokens, with the own-vs-recorded mismatch when routes were given.

    ``dropout_key`` (a training forward's, uint32 [2]): applies ``model.lora_dropout`` to the adapters' inputs
    (:func:`nereus_jax.models.lora.dropout`); None, or no adapters, or a rate of 0: no dropout.
    """
    if positions_bt is None:
        positions_bt = default_positions(tokens_bt, attention_mask_bt)
    mask_bts = causal_mask(tokens_bt.shape[1], attention_mask_bt, segment_ids_bt)
    routing = routing_inputs(cfg, tokens_bt, attention_mask_bt, segment_ids_bt, routes_btlk, replay, return_routing)
    if dropout_key is not None and cfg.lora_dropout and lora.has_adapters(params["layers"]):
        n = jax.tree.leaves(params["layers"])[0].shape[0]
        routing["dropout_lbk"] = lora.row_keys(dropout_key, n, tokens_bt.shape[0])
    out = apply_layers(params["layers"], cfg, embed_tokens(params, tokens_bt), positions_bt, mask_bts, **routing)
    if not return_routing:
        return output_head(params, cfg, out, return_hidden=return_hidden)
    x, stats = out
    return output_head(params, cfg, x, return_hidden=return_hidden), stats


def routing_inputs(cfg: ModelConfig, tokens_bt: jax.Array, attention_mask_bt: jax.Array | None,
                   segment_ids_bt: jax.Array | None, routes_btlk: jax.Array | None, replay: bool,
                   return_routing: bool) -> dict:
    """The routing keywords of :func:`apply_layers` for a model call (empty for a plain call): the recorded
    routes layer-major, whether to replay them, and (``return_routing``) the tokens the statistics count."""
    if routes_btlk is None and not return_routing:
        if replay:
            raise ValueError("replay=True needs routes_btlk (the recorded routes)")
        return {}
    if not cfg.num_experts:
        raise ValueError(f"routing statistics and replay need a mixture-of-experts model (model.family="
                         f"{cfg.family} has num_experts=0)")
    routes = None if routes_btlk is None else jnp.moveaxis(routes_btlk, 2, 0)
    if not return_routing:
        return {"routes_lbtk": routes, "replay": replay}
    if segment_ids_bt is not None:
        counted = segment_ids_bt > 0
    elif attention_mask_bt is not None:
        counted = attention_mask_bt > 0
    else:
        counted = jnp.ones(tokens_bt.shape, bool)
    return {"routes_lbtk": routes, "replay": replay, "token_mask_bt": counted}


def embed_tokens(params: dict, tokens_bt: jax.Array) -> jax.Array:
    """Token embeddings [b, t, embed]."""
    # the replication hook is read now: the backward rule is traced later, outside its context
    return constrain(_lookup(params["embed"]["embedding"], tokens_bt, current_replication()),
                     ("batch", "length", "embed"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table_vd: jax.Array, ids_bt: jax.Array, replicate) -> jax.Array:
    # mode="clip": an id past the vocabulary reads the last row instead of jnp.take's NaN fill, which would
    # poison every later position through attention (the job also checks ids against vocabularies up front)
    return jnp.take(table_vd, ids_bt, axis=0, mode="clip")


def _lookup_fwd(table_vd, ids_bt, replicate):
    return _lookup(table_vd, ids_bt, replicate), (table_vd, ids_bt)  # the table: a reference, not a copy


def _lookup_bwd(replicate, residuals, g_btd):
    """The table's gradient: the rows' cotangents scatter-added at their ids. With fewer tokens in the
    (global) batch than vocabulary rows, the ids and cotangents are first made whole on every data-parallel
    replica (an all-gather of tokens x embed values), so the scatter yields the summed gradient directly:
    no table-sized partial sum to all-reduce, and XLA folds the scatter into the output head's gradient of
    a tied embedding (one table-sized buffer in the backward instead of three). With more tokens than rows
    the scatter stays on each replica's tokens and the partitioner all-reduces its table-sized result."""
    table_vd, ids_bt = residuals
    vocab = table_vd.shape[0]
    if replicate is not None and ids_bt.size < vocab:
        ids_bt, g_btd = replicate(ids_bt), replicate(g_btd)
    grad = jnp.zeros_like(table_vd).at[jnp.clip(ids_bt, 0, vocab - 1)].add(g_btd.astype(table_vd.dtype))
    return grad, np.zeros(ids_bt.shape, jax.dtypes.float0)


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def causal_mask(t: int, attention_mask_bt: jax.Array | None, segment_ids_bt: jax.Array | None = None) -> jax.Array:
    """[b or 1, t, t] boolean: causal by index, padding keys (attention_mask 0, segment 0) masked, and with
    segment ids, keys of another segment masked."""
    mask_bts = jnp.tril(jnp.ones((t, t), dtype=bool))[None]
    if attention_mask_bt is not None:
        mask_bts = mask_bts & attention_mask_bt.astype(bool)[:, None, :]
    if segment_ids_bt is not None:
        same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
        mask_bts = mask_bts & same & (segment_ids_bt > 0)[:, None, :]
    return mask_bts


def apply_layers(layers: dict, cfg: ModelConfig, x_btd: jax.Array, positions_bt: jax.Array,
                 mask_bts: jax.Array, *, routes_lbtk: jax.Array | None = None, replay: bool = False,
                 token_mask_bt: jax.Array | None = None, dropout_lbk: jax.Array | None = None
                 ) -> jax.Array | tuple[jax.Array, RouterStats]:
    """Runs a stack of layers (any number: a pipeline stage passes its slice of the ``layers`` axis).
    ``dropout_lbk``: LoRA dropout, a key per layer and row ([layers, rows, 2], :func:`lora.row_keys`; a pipeline
    stage passes its layers' and its micro-batch's rows').

    With ``token_mask_bt`` (mixture-of-experts models) returns ``(x, RouterStats)`` of these layers, counted
    over the tokens it marks; ``routes_lbtk`` (recorded routes, layer-major) are compared with the router's own
    choice and, with ``replay``, used instead of it."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    stats = token_mask_bt is not None

    def body(x, xs):
        layer, recorded, key = xs
        x, routed = _block(x, layer, cfg, positions_bt, inv_freq, mask_bts, recorded if replay else None, key)
        return x, layer_stats(routed, token_mask_bt, recorded) if stats else None

    if cfg.remat:
        body = jax.checkpoint(body)
    x, per_layer = jax.lax.scan(body, x_btd, (layers, routes_lbtk, dropout_lbk))
    if not stats:
        return x
    counts, probs, mismatch = per_layer
    tokens = jnp.sum(token_mask_bt.astype(jnp.float32))
    return x, with_mismatch(counts, probs, tokens, None if mismatch is None else jnp.any(mismatch, axis=0))


def output_head(params: dict, cfg: ModelConfig, x_btd: jax.Array, *, return_hidden: bool = False) -> jax.Array:
    """Final norm, then the language-model head (float32 logits) or the value head."""
    x_btd = rms_norm(x_btd, params["final_norm"]["scale"], cfg.rms_norm_eps)
    if return_hidden:
        return x_btd
    if "value_head" in params:
        return jnp.einsum("btd,dl->btl", x_btd, params["value_head"]["kernel"]).astype(jnp.float32)
    if "lm_head" in params:
        logits = jnp.einsum("btd,dv->btv", x_btd, params["lm_head"]["kernel"])
    else:
        logits = jnp.einsum("btd,vd->btv", x_btd, params["embed"]["embedding"])
    return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))


def _block(x, lp, cfg, positions_bt, inv_freq, mask_bts, forced_btk=None, dropout_key=None):
    """One decoder layer; returns (x, the MLP's :class:`Routed` or None for a dense MLP)."""
    if lora.has_adapters(lp):
        return _lora_block(x, lp, cfg, positions_bt, inv_freq, mask_bts, forced_btk, dropout_key)
    a = lp["attn"]
    h = rms_norm(x, lp["attn_norm"]["scale"], cfg.rms_norm_eps)
    q_norm, k_norm = (a["q_norm"]["scale"], a["k_norm"]["scale"]) if cfg.qk_norm else (None, None)
    q = project_heads(h, a["wq"], a.get("bq"), q_norm, cfg.rms_norm_eps)
    k = project_heads(h, a["wk"], a.get("bk"), k_norm, cfg.rms_norm_eps)
    v = project_heads(h, a["wv"], a.get("bv"))
    q = constrain(apply_rope(q, positions_bt, inv_freq), ("batch", "length", "heads", "head_dim"))
    k = apply_rope(k, positions_bt, inv_freq)
    out = attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask_bts)
    x = x + jnp.einsum("bthe,hed->btd", out, a["wo"])
    x = constrain(x, ("batch", "length", "embed"))
    h = rms_norm(x, lp["mlp_norm"]["scale"], cfg.rms_norm_eps)
    y, routed = mlp(h, lp, cfg, forced_btk)
    return x + y, routed


def mlp(h_btd: jax.Array, lp: dict, cfg: ModelConfig, forced_btk: jax.Array | None = None
        ) -> tuple[jax.Array, Routed | None]:
    """One layer's MLP on its normed input: SwiGLU, or Qwen3-MoE's routed experts (``lp["moe"]``, on the
    ``forced_btk`` routes where given). Returns (output, the routing or None for a dense MLP)."""
    if "moe" in lp:
        m = lp["moe"]
        routed = route(h_btd, m["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob, forced_btk)
        return routed_experts(h_btd, routed, m["w_gate"], m["w_up"], m["w_down"]), routed
    m = lp["mlp"]
    return swiglu(h_btd, m["w_gate"], m["w_up"], m["w_down"]), None


def _lora_block(x, lp, cfg, positions_bt, inv_freq, mask_bts, forced_btk=None, dropout_key=None):
    """:func:`_block` with each adapted projection plus its low-rank update, unmerged (the adapters' own
    gradients, no merged weight copy per layer); with ``dropout_key`` (this layer's, one per row: [rows, 2]) the
    update reads its input through LoRA dropout, the base projection reads it whole."""
    a, m = lp["attn"], lp.get("mlp")

    def proj(h, group, weight, n_in, spec):
        y = jnp.einsum(spec, h, group[weight])
        adapted = h if dropout_key is None or weight + lora.SUFFIX_A not in group else \
            lora.dropout(h, dropout_key, weight, cfg)
        d = lora.delta(adapted, group, weight, n_in, cfg)
        # the adapter's update kept out of the base projection's fusion: XLA:CPU (jax 0.12.1) otherwise fuses it
        # into the layer scan's matmuls and rounds them differently, so B = 0 would not give the base bit for bit
        return y if d is None else y + jax.lax.optimization_barrier(d)

    def heads(h, name, norm):
        y = proj(h, a, f"w{name}", 1, "btd,dhe->bthe")
        if f"b{name}" in a:
            y = y + a[f"b{name}"]
        return y if norm is None else rms_norm(y, norm, cfg.rms_norm_eps)

    h = rms_norm(x, lp["attn_norm"]["scale"], cfg.rms_norm_eps)
    q_norm, k_norm = (a["q_norm"]["scale"], a["k_norm"]["scale"]) if cfg.qk_norm else (None, None)
    q, k, v = heads(h, "q", q_norm), heads(h, "k", k_norm), heads(h, "v", None)
    q = constrain(apply_rope(q, positions_bt, inv_freq), ("batch", "length", "heads", "head_dim"))
    k = apply_rope(k, positions_bt, inv_freq)
    out = attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask_bts)
    x = constrain(x + proj(out, a, "wo", 2, "bthe,hed->btd"), ("batch", "length", "embed"))
    h = rms_norm(x, lp["mlp_norm"]["scale"], cfg.rms_norm_eps)
    if "moe" in lp:  # experts carry no adapters (config refuses MLP targets with experts)
        y, routed = mlp(h, lp, cfg, forced_btk)
        return x + y, routed
    gate, up = proj(h, m, "w_gate", 1, "btd,df->btf"), proj(h, m, "w_up", 1, "btd,df->btf")
    hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
    return x + proj(hidden, m, "w_down", 1, "btf,fd->btd"), None
