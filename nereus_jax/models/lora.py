"""Low-rank adapters (LoRA) on the decoder's projections, as extra leaves of the canonical parameter tree.

With ``model.lora_rank = r > 0`` every targeted projection ``W`` (stacked over layers) gets two leaves beside it,
``<w>_lora_a`` [layers, *in, r] and ``<w>_lora_b`` [layers, r, *out], and the layer computes
``x @ W + (lora_alpha / r) * (x @ A) @ B``: PEFT's LoRA, unmerged. ``B`` starts at zero, so at init the model is
the base bit for bit. The base is frozen: training differentiates and updates (and keeps optimizer state for)
the adapters alone, plus a value head where there is one (:func:`is_trainable`, :func:`split_trainable`; the
train step never accumulates the base's gradients, so XLA drops their computation).

Names follow Hugging Face's modules (``model.lora_targets``)::

    q_proj, k_proj, v_proj  -> layers/attn/w{q,k,v}_lora_{a,b}   A [n, embed, r]          B [n, r, heads, head_dim]
    o_proj                  -> layers/attn/wo_lora_{a,b}         A [n, heads, head_dim, r] B [n, r, embed]
    gate_proj, up_proj      -> layers/mlp/w_{gate,up}_lora_{a,b} A [n, embed, r]          B [n, r, mlp]
    down_proj               -> layers/mlp/w_down_lora_{a,b}      A [n, mlp, r]            B [n, r, embed]

``model.lora_dropout = p`` drops each element of an adapter's input with probability p (kept ones scaled by
1 / (1 - p), as ``torch.nn.Dropout`` in PEFT) in training forwards only: the train step hands the forward a key
(:func:`dropout_keys`), scoring, the reference and generation never do, so they run the adapters undropped.
Every layer and projection draws its own mask from that key (:func:`dropout`).

``merge_lora`` folds the adapters into the weights (the engine's generation weights, the merged HF export);
``nereus_jax.models.peft`` reads and writes PEFT's adapter files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nereus_jax.config import LORA_TARGETS, ModelConfig

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
RANK_AXIS = "lora_rank"


@dataclasses.dataclass(frozen=True)
class Target:
    """One adaptable projection: its HF module name, where its weight sits, and how many of the weight's
    leading axes (after ``layers``) are its input."""

    hf: str          # q_proj ...
    group: str       # attn | mlp
    weight: str      # wq ...
    n_in: int        # number of input axes of the weight (after the layers axis)

    @property
    def a(self) -> str:
        return self.weight + SUFFIX_A

    @property
    def b(self) -> str:
        return self.weight + SUFFIX_B

    @property
    def hf_module(self) -> str:
        return ("self_attn." if self.group == "attn" else "mlp.") + self.hf


TARGETS: dict[str, Target] = {t.hf: t for t in (
    Target("q_proj", "attn", "wq", 1), Target("k_proj", "attn", "wk", 1), Target("v_proj", "attn", "wv", 1),
    Target("o_proj", "attn", "wo", 2), Target("gate_proj", "mlp", "w_gate", 1), Target("up_proj", "mlp", "w_up", 1),
    Target("down_proj", "mlp", "w_down", 1))}
ALL_TARGETS = LORA_TARGETS
_TARGET_INDEX = {t.weight: i for i, t in enumerate(TARGETS.values())}
assert tuple(TARGETS) == LORA_TARGETS


def targets(cfg: ModelConfig) -> list[Target]:
    """The projections ``cfg`` adapts (none without a rank)."""
    return [TARGETS[name] for name in cfg.lora_targets] if cfg.lora_rank else []


def base_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` without adapters: the frozen base's architecture (the reference model, the engine's weights)."""
    return dataclasses.replace(cfg, lora_rank=0, lora_path=None, lora_dropout=0.0) if cfg.lora_rank else cfg


def scale(cfg: ModelConfig) -> float:
    """PEFT's scaling, lora_alpha / r."""
    return float(cfg.lora_alpha) / float(cfg.lora_rank)


def adapter_shapes(cfg: ModelConfig, weight_shape: tuple[int, ...], target: Target) -> tuple[tuple, tuple]:
    """Shapes of (A, B) for a stacked weight of ``weight_shape`` ([layers, *in, *out])."""
    n, rest = weight_shape[0], weight_shape[1:]
    ins, outs = rest[:target.n_in], rest[target.n_in:]
    return (n, *ins, cfg.lora_rank), (n, cfg.lora_rank, *outs)


def adapter_axes(weight_axes: tuple, target: Target) -> tuple[tuple, tuple]:
    """Logical axes of (A, B) from the weight's: the rank axis is replicated everywhere."""
    n, rest = weight_axes[0], weight_axes[1:]
    ins, outs = rest[:target.n_in], rest[target.n_in:]
    return (n, *ins, RANK_AXIS), (n, RANK_AXIS, *outs)


def has_adapters(layers: Mapping) -> bool:
    """True when a (stacked or per-layer) ``layers`` tree holds any adapter."""
    return any(k.endswith(SUFFIX_A) for group in layers.values() if isinstance(group, Mapping) for k in group)


def is_adapter(path: tuple[str, ...]) -> bool:
    return path[-1].endswith((SUFFIX_A, SUFFIX_B))


def is_trainable(path: tuple[str, ...], cfg: ModelConfig) -> bool:
    """Whether training updates the leaf at ``path``: every leaf without adapters; with them, the adapters and a
    value head (a critic's or reward model's score layer is new, so it trains)."""
    return not cfg.lora_rank or is_adapter(path) or path[0] == "value_head"


def split_trainable(tree: Mapping, cfg: ModelConfig) -> tuple[dict, dict]:
    """(trainable, frozen): ``tree`` (params, or anything shaped like them) pruned to the leaves training updates
    and to the rest. Without adapters the first is the whole tree and the second empty."""
    if not cfg.lora_rank:
        return dict(tree), {}
    return _prune(tree, cfg, True), _prune(tree, cfg, False)


def join(trainable: Mapping, frozen: Mapping) -> dict:
    """Inverse of :func:`split_trainable`."""
    out = dict(frozen)
    for k, v in trainable.items():
        out[k] = join(v, out[k]) if isinstance(v, Mapping) and k in out else v
    return out


def _prune(tree: Mapping, cfg: ModelConfig, keep: bool, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in tree.items():
        path = (*prefix, k)
        if isinstance(v, Mapping):
            sub = _prune(v, cfg, keep, path)
            if sub:
                out[k] = sub
        elif is_trainable(path, cfg) == keep:
            out[k] = v
    return out


def delta(x: jax.Array, group: Mapping, weight: str, n_in: int, cfg: ModelConfig) -> jax.Array | None:
    """The adapter's contribution ``scale * (x @ A) @ B`` for the projection ``group[weight]`` applied to ``x``
    (its trailing ``n_in`` axes the input), or None when the projection has no adapter."""
    a = group.get(weight + SUFFIX_A)
    if a is None:
        return None
    b = group[weight + SUFFIX_B]
    low = jnp.tensordot(x, a, axes=(tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))))
    return (scale(cfg) * jnp.tensordot(low, b, axes=((low.ndim - 1,), (0,)))).astype(x.dtype)


def dropout(x: jax.Array, keys: jax.Array, weight: str, cfg: ModelConfig) -> jax.Array:
    """``x`` ([rows, ...], the input of the adapted projection ``weight``, e.g. ``wq``, in one layer) with
    ``cfg.lora_dropout`` applied: elements dropped with that probability, the rest scaled by 1 / (1 - p).
    ``keys`` ([rows, 2]) are the layer's per-row keys (:func:`row_keys`), so a row draws the same mask however
    the call's rows are split (data parallelism, pipeline micro-batches); each projection folds in its own
    index, so q, k and v (which read the same input) draw different masks, as PEFT's per-module dropout does."""
    index = _TARGET_INDEX[weight]
    keep = jax.vmap(lambda k: dropout_mask(jax.random.fold_in(k, index), x.shape[1:], cfg.lora_dropout))(keys)
    return jnp.where(keep, x / (1.0 - cfg.lora_dropout), 0.0).astype(x.dtype)


def dropout_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Boolean keep-mask of ``shape``: each element kept with probability 1 - ``rate``."""
    return jax.random.bernoulli(key, 1.0 - rate, shape)


def row_keys(key: jax.Array | None, num_layers: int, rows: int) -> jax.Array | None:
    """The dropout keys of one model call, [num_layers, rows, 2], from its key (None stays None: no dropout):
    one per layer and row of the call, so a pipeline stage and a micro-batch read their layers' and rows' keys."""
    if key is None:
        return None
    per_layer = jax.random.split(key, num_layers)
    return jax.vmap(lambda k: jax.vmap(lambda r: jax.random.fold_in(k, r))(jnp.arange(rows)))(per_layer)


def dropout_keys(seed: jax.Array, epoch: jax.Array, mini: int, accum: int) -> jax.Array:
    """The dropout keys of one pass over a training batch, [mini, accum, 2] (uint32): one per micro-batch,
    a function of the step's ``seed`` (uint32), the ``epoch`` and the micro-batch's place, so a run is
    reproducible for a seed and no two micro-batches or epochs share masks."""
    base = jax.random.fold_in(jax.random.PRNGKey(seed), epoch)
    return jax.vmap(lambda i: jax.random.split(jax.random.fold_in(base, i), accum))(jnp.arange(mini))


def merge_lora(params: Mapping, cfg: ModelConfig) -> dict:
    """``params`` with every adapter folded into its weight (``W + scale * A @ B``, in the weight's dtype, computed
    in float32) and the adapter leaves dropped: the base architecture's tree. Works on numpy or jax arrays."""
    layers = params.get("layers", {})
    if not has_adapters(layers):
        return dict(params)
    xp = np if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(layers)) else jnp
    new_layers = {}
    for gname, group in layers.items():
        if not isinstance(group, Mapping):
            new_layers[gname] = group
            continue
        g = {k: v for k, v in group.items() if not k.endswith((SUFFIX_A, SUFFIX_B))}
        for t in TARGETS.values():
            if t.group == gname and t.a in group:
                w = group[t.weight]
                a = xp.asarray(group[t.a], xp.float32)
                b = xp.asarray(group[t.b], xp.float32)
                d = xp.einsum("nir,nro->nio", a.reshape(a.shape[0], -1, a.shape[-1]),
                              b.reshape(b.shape[0], b.shape[1], -1))
                g[t.weight] = (xp.asarray(w, xp.float32) + scale(cfg) * d.reshape(w.shape)).astype(w.dtype)
        new_layers[gname] = g
    return {**params, "layers": new_layers}


def init_adapter(cfg: ModelConfig, path: tuple[str, ...], shape: tuple[int, ...], seed: int) -> np.ndarray:
    """The starting value of an adapter leaf: A as PEFT initialises it (Kaiming-uniform with a = sqrt(5), i.e.
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) per layer), B zero. Deterministic in (seed, path)."""
    if path[-1].endswith(SUFFIX_B):
        return np.zeros(shape, np.float32)
    fan_in = int(np.prod(shape[1:-1]))
    key = int.from_bytes("/".join(path).encode(), "little") % (2 ** 32)
    rng = np.random.default_rng([seed, key])
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def with_adapters(params: Mapping, cfg: ModelConfig, seed: int = 0) -> dict:
    """A base tree plus freshly initialised adapters for ``cfg`` (adapters already there are kept)."""
    layers = {g: dict(v) if isinstance(v, Mapping) else v for g, v in params["layers"].items()}
    for t in targets(cfg):
        group = layers[t.group]
        shape_a, shape_b = adapter_shapes(cfg, tuple(np.shape(group[t.weight])), t)
        for name, shape in ((t.a, shape_a), (t.b, shape_b)):
            if name not in group:
                group[name] = init_adapter(cfg, ("layers", t.group, name), shape, seed)
    return {**params, "layers": layers}


class AdapterSource:
    """A parameter source (``elastic.sources.ParamSource``) for a model with adapters: the base's leaves from
    ``base``, each adapter from ``adapters`` ({leaf name: stacked array}, e.g. a PEFT file read by
    :func:`nereus_jax.models.peft.read_adapter`) or else freshly initialised (:func:`init_adapter`)."""

    def __init__(self, base: Any, cfg: ModelConfig, seed: int = 0, adapters: Mapping | None = None):
        self.base, self.cfg, self.seed, self.adapters = base, cfg, seed, adapters or {}
        self._shapes = {}
        for t in targets(cfg):
            w = _weight_shape(cfg, t)
            a, b = adapter_shapes(cfg, w, t)
            self._shapes[("layers", t.group, t.a)], self._shapes[("layers", t.group, t.b)] = a, b

    def read(self, path: tuple[str, ...], index: tuple[slice, ...] | None = None, dtype: Any = None) -> np.ndarray:
        if not is_adapter(path):
            return self.base.read(path, index, dtype)
        x = self.adapters.get(path[-1])
        if x is None:
            x = init_adapter(self.cfg, path, self._shapes[tuple(path)], self.seed)
        x = np.asarray(x if index is None else np.asarray(x)[index])
        return x if dtype is None else x.astype(dtype)


def _weight_shape(cfg: ModelConfig, t: Target) -> tuple[int, ...]:
    n, d, h, k, e, f = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size)
    return {"wq": (n, d, h, e), "wk": (n, d, k, e), "wv": (n, d, k, e), "wo": (n, h, e, d),
            "w_gate": (n, d, f), "w_up": (n, d, f), "w_down": (n, f, d)}[t.weight]
