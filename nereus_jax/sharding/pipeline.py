"""Pipeline parallelism: the stacked ``layers`` axis split over ``pp``, run as a GPipe schedule.

The rules table decides: the mesh axis that a stage kind's rules map ``layers`` to (``pp``) is the
pipeline axis. With that axis absent or of size 1 every function here is exactly the plain model code
(:func:`~nereus_jax.models.forward`, :func:`~nereus_jax.models.forward_with_cache`); with pp > 1 the
layer stack runs inside ``jax.shard_map`` that is manual over ``pp`` only, so tp (and dp) stay with the
SPMD partitioner and tp-sharded weights inside a stage work unchanged.

Schedule (GPipe): the batch is cut into ``m`` micro-batches (micro-batch i = rows i, i+m, ..., so a dp
split of the batch stays a dp split of every micro-batch). At tick t stage s runs its layers on
micro-batch t - s, then hands its output to stage s + 1 with ``ppermute``; m + pp - 1 ticks in all, so
each stage idles (pp - 1) of them: bubble fraction (pp - 1) / (m + pp - 1). Training differentiates
through the schedule; the backward is its transpose (reverse ppermute, same tick table reversed), so
the same bubble applies. In the uncached forward a bubble tick computes on zeros (branch-free, cheap to
differentiate); in the cached path a bubble tick is skipped (``lax.cond``), since it must not write
garbage keys/values into the stage's slice of the KV cache.

Embedding and output head run outside the pipelined stack: the rules table stores them replicated over
pp (they have no ``layers`` axis), so no stage owns them, tied embeddings need nothing special and their
gradients come out laid out like the parameters. The embedding lookup (no FLOPs) runs replicated; the
output head (a large matmul for real vocabularies) runs data-parallel over pp, every stage taking
1/pp of the rows, instead of on the last stage alone.

Example::

    mesh = make_mesh(jax.devices()[:4], Layout(tp=2, pp=2))
    sharded = shard_params(params, cfg, Layout(tp=2, pp=2), mesh)
    logits = jax.jit(pipeline_forward_fn(mesh, microbatches=4), static_argnums=1)(sharded, cfg, tokens)
    cache = jax.device_put(init_cache(cfg, batch, max_len), cache_sharding(mesh))
    logits, cache = pipeline_forward_with_cache(sharded, cfg, tokens, positions, cache, mesh=mesh)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nereus_jax.config import ModelConfig
from nereus_jax.models.decoder import (
    KVCache,
    apply_layers,
    apply_layers_cached,
    causal_mask,
    default_positions,
    embed_tokens,
    forward,
    forward_with_cache,
    output_head,
)
from nereus_jax.models.layers import activation_constraints
from nereus_jax.sharding.layout import LayoutError, logical_to_spec
from nereus_jax.sharding.rules import rules_for

ForwardFn = Callable[..., jax.Array]
_CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


class PipelineError(LayoutError):
    """A pipeline the layout or batch cannot run (pp not dividing layers, micro-batches not dividing rows)."""


def pipeline_axis(mesh: Mesh, kind: str = "train") -> str | None:
    """The mesh axis the stage kind's rules put ``layers`` on, or None when the mesh does not pipeline."""
    axis = rules_for(kind).get("layers")
    return axis if axis in mesh.axis_names and mesh.shape[axis] > 1 else None


def bubble_fraction(pp: int, microbatches: int) -> float:
    """Idle fraction of the GPipe schedule: (pp - 1) / (m + pp - 1)."""
    return (pp - 1) / (microbatches + pp - 1)


def gpipe_schedule(pp: int, microbatches: int) -> np.ndarray:
    """[ticks, pp]: the micro-batch each stage runs at each tick, -1 where it idles (the bubble)."""
    i = np.arange(microbatches + pp - 1)[:, None] - np.arange(pp)[None, :]
    return np.where((i >= 0) & (i < microbatches), i, -1)


def cache_sharding(mesh: Mesh, kind: str = "gen") -> KVCache:
    """Shardings of a :class:`KVCache` on ``mesh``: each stage holds its layers' slice (kv heads over tp)."""
    spec = logical_to_spec(_CACHE_AXES, kind, mesh.axis_names)
    return KVCache(NamedSharding(mesh, spec), NamedSharding(mesh, spec))


def pipeline_forward(params: dict, cfg: ModelConfig, tokens_bt: jax.Array, positions_bt: jax.Array | None = None,
                     attention_mask_bt: jax.Array | None = None, *, mesh: Mesh, microbatches: int,
                     kind: str = "train", return_hidden: bool = False,
                     segment_ids_bt: jax.Array | None = None) -> jax.Array:
    """:func:`~nereus_jax.models.forward` with the layer stack pipelined over the mesh's pp axis.

    Same outputs (logits, values, or hidden states); differentiable, so a loss built on it trains. Packed rows
    pass ``segment_ids_bt`` (and their positions) as to ``forward``.
    """
    axis = _checked_axis(params, tokens_bt.shape[0], mesh, microbatches, kind)
    if axis is None:
        return forward(params, cfg, tokens_bt, positions_bt, attention_mask_bt, return_hidden=return_hidden,
                       segment_ids_bt=segment_ids_bt)
    if attention_mask_bt is None:
        attention_mask_bt = jnp.ones(tokens_bt.shape, jnp.int32) if segment_ids_bt is None else \
            (segment_ids_bt > 0).astype(jnp.int32)
    if positions_bt is None:
        positions_bt = default_positions(tokens_bt, attention_mask_bt)
    segments = jnp.ones(tokens_bt.shape, jnp.int32) if segment_ids_bt is None else segment_ids_bt  # one segment
    hidden, _ = _run_uncached(params["layers"], cfg, embed_tokens(params, tokens_bt), positions_bt,
                              attention_mask_bt, segments, mesh=mesh, axis=axis, m=microbatches, kind=kind)
    return _head(params, cfg, hidden, mesh, kind, axis, microbatches, return_hidden)


def pipeline_forward_with_cache(params: dict, cfg: ModelConfig, tokens_bt: jax.Array, positions_bt: jax.Array,
                                cache: KVCache, *, mesh: Mesh, microbatches: int = 1, kind: str = "gen",
                                return_hidden: bool = False) -> tuple[jax.Array, KVCache]:
    """:func:`~nereus_jax.models.forward_with_cache` (prefill or decode) through the pipeline stages;
    each stage reads and writes only its slice of the cache's ``layers`` axis."""
    axis = _checked_axis(params, tokens_bt.shape[0], mesh, microbatches, kind)
    if axis is None:
        return forward_with_cache(params, cfg, tokens_bt, positions_bt, cache, return_hidden=return_hidden)
    if cache.k.shape[0] != params["layers"]["attn"]["wq"].shape[0]:
        raise PipelineError(f"cache has {cache.k.shape[0]} layers, the model {params['layers']['attn']['wq'].shape[0]}")
    hidden, cache = _run_cached(params["layers"], cfg, embed_tokens(params, tokens_bt), positions_bt, cache,
                                mesh=mesh, axis=axis, m=microbatches, kind=kind)
    return _head(params, cfg, hidden, mesh, kind, axis, microbatches, return_hidden), cache


def pipeline_forward_fn(mesh: Mesh, microbatches: int | Callable[[int, int], int],
                        kind: str = "train") -> ForwardFn:
    """A drop-in for :func:`~nereus_jax.models.forward` (same signature) that pipelines over ``mesh``;
    ``forward`` itself when the mesh does not pipeline. Hand it to losses that take a forward function.
    ``microbatches`` may be a function of (rows per replica of the call, pp), evaluated at trace time, for
    programs whose batch size varies (packed rows)."""
    axis = pipeline_axis(mesh, kind)
    if axis is None:
        return forward
    if not callable(microbatches):
        return functools.partial(pipeline_forward, mesh=mesh, microbatches=microbatches, kind=kind)
    dp, pp = _batch_degree(mesh, kind), mesh.shape[axis]

    def fn(params, cfg, tokens_bt, *args, **kwargs):
        m = microbatches(tokens_bt.shape[0] // dp, pp)
        return pipeline_forward(params, cfg, tokens_bt, *args, mesh=mesh, microbatches=m, kind=kind, **kwargs)

    return fn


def executed_schedule(params: dict, cfg: ModelConfig, tokens_bt: jax.Array, *, mesh: Mesh, microbatches: int,
                      kind: str = "train") -> np.ndarray:
    """Runs the pipelined layer stack once and returns, as recorded by the running program, the
    micro-batch each stage processed at each tick ([ticks, pp], -1 = bubble). For benchmarks and tests."""
    axis = _checked_axis(params, tokens_bt.shape[0], mesh, microbatches, kind)
    if axis is None:
        return gpipe_schedule(1, microbatches)
    mask_bt = jnp.ones(tokens_bt.shape, jnp.int32)

    @jax.jit
    def run(params, tokens_bt):
        x = embed_tokens(params, tokens_bt)
        return _run_uncached(params["layers"], cfg, x, default_positions(tokens_bt, None), mask_bt, mask_bt,
                             mesh=mesh, axis=axis, m=microbatches, kind=kind)[1]

    return np.asarray(run(params, tokens_bt))


def _checked_axis(params: dict, batch: int, mesh: Mesh, microbatches: int, kind: str) -> str | None:
    if microbatches < 1 or batch % microbatches:
        raise PipelineError(f"microbatches={microbatches} does not divide the batch of {batch} rows; "
                            f"choose a divisor of {batch}")
    axis = pipeline_axis(mesh, kind)
    if axis is None:
        return None
    pp, layers = mesh.shape[axis], params["layers"]["attn"]["wq"].shape[0]
    if layers % pp:
        raise PipelineError(f"{axis}={pp} does not divide the model's {layers} layers; choose {axis} dividing {layers}")
    dp = _batch_degree(mesh, kind)
    if (batch // microbatches) % dp:
        raise PipelineError(f"micro-batches of {batch // microbatches} rows do not split over dp={dp}; "
                            f"choose microbatches so that batch / microbatches is a multiple of {dp}")
    return axis


def _batch_degree(mesh: Mesh, kind: str) -> int:
    axis = rules_for(kind).get("batch")
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def _split(x: jax.Array, m: int, axis: int = 0) -> jax.Array:
    """[..., B, ...] -> [m, ..., B/m, ...]: micro-batch i holds rows i, i+m, ... (a dp split stays a dp split)."""
    x = x.reshape(*x.shape[:axis], x.shape[axis] // m, m, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis + 1, 0)


def _merge(x_m: jax.Array, axis: int = 0) -> jax.Array:
    """Inverse of :func:`_split`."""
    x = jnp.moveaxis(x_m, 0, axis + 1)
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def _stage_constraints(mesh: Mesh, kind: str, manual_axis: str):
    """Activation annotations inside a stage: the rules table over the axes the partitioner still owns
    (a bare PartitionSpec resolves against the shard_map's mesh, where ``manual_axis`` is manual)."""
    auto_axes = tuple(a for a in mesh.axis_names if a != manual_axis)

    def fn(x, axes):
        return lax.with_sharding_constraint(x, logical_to_spec(axes, kind, auto_axes))

    return activation_constraints(fn)


def _run_uncached(layers, cfg, x_btd, positions_bt, mask_bt, segments_bt, *, mesh, axis, m, kind):
    t, hand_off = x_btd.shape[1], _HandOff(mesh, kind, axis, x_btd.shape[0] // m)

    def body(layers, x_m, pos_m, mask_m, seg_m):
        def stage(x, ic, valid, state):
            return apply_layers(layers, cfg, x, pos_m[ic], causal_mask(t, mask_m[ic], seg_m[ic])), state

        with _stage_constraints(mesh, kind, axis):
            out, _, record = _gpipe(stage, x_m, None, axis, mesh.shape[axis])
        return hand_off.inside(out), record[None]

    specs = (_layer_specs(layers, axis), PartitionSpec(), PartitionSpec(), PartitionSpec(), PartitionSpec())
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(hand_off.spec, PartitionSpec(axis)),
                       axis_names={axis})
    out, record = fn(layers, _split(x_btd, m), _split(positions_bt, m), _split(mask_bt, m), _split(segments_bt, m))
    return hand_off.outside(out), record.T


def _run_cached(layers, cfg, x_btd, positions_bt, cache, *, mesh, axis, m, kind):
    hand_off = _HandOff(mesh, kind, axis, x_btd.shape[0] // m)

    def body(layers, x_m, pos_m, cache):
        def stage(x, ic, valid, cache):
            def run(x, cache):
                y, rows = apply_layers_cached(layers, cfg, x, pos_m[ic], _take_rows(cache, ic, m))
                return y, _put_rows(cache, rows, ic, m)

            return lax.cond(valid, run, lambda x, cache: (x, cache), x, cache)

        with _stage_constraints(mesh, kind, axis):
            out, cache, _ = _gpipe(stage, x_m, cache, axis, mesh.shape[axis])
        return hand_off.inside(out), cache

    cache_spec = KVCache(PartitionSpec(axis), PartitionSpec(axis))
    specs = (_layer_specs(layers, axis), PartitionSpec(), PartitionSpec(), cache_spec)
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(hand_off.spec, cache_spec), axis_names={axis})
    out, cache = fn(layers, _split(x_btd, m), _split(positions_bt, m), cache)
    return hand_off.outside(out), cache


class _HandOff:
    """How the last stage's outputs [m, rows, ...] leave the pipeline for the output head.

    When every micro-batch's rows divide by dp * pp, a reduce-scatter over pp (zeros from the other
    stages; exact) leaves each stage 1/pp of every micro-batch, so the head runs data-parallel over pp
    and the merged batch comes out split over (dp, pp) in that order without further movement.
    Otherwise the outputs leave stacked per stage and the head reads the last stage's copy."""

    def __init__(self, mesh: Mesh, kind: str, axis: str, rows: int):
        self.axis, self.pp, self.dp = axis, mesh.shape[axis], _batch_degree(mesh, kind)
        self.split = rows % (self.dp * self.pp) == 0
        self.spec = PartitionSpec(None, None, axis) if self.split else PartitionSpec(axis)

    def inside(self, out_m: jax.Array) -> jax.Array:
        if not self.split:
            return out_m[None]
        last = lax.axis_index(self.axis) == self.pp - 1
        out = jnp.where(last, out_m, 0).reshape(out_m.shape[0], self.dp, -1, *out_m.shape[2:])
        return lax.psum_scatter(out, self.axis, scatter_dimension=2, tiled=True)

    def outside(self, out: jax.Array) -> jax.Array:
        out_m = out.reshape(out.shape[0], -1, *out.shape[3:]) if self.split else out[-1]
        return _merge(out_m)


def _gpipe(stage_fn, x_mbtd, state, axis: str, pp: int):
    """The GPipe forward schedule, inside shard_map (manual over ``axis``). ``stage_fn(x, i, valid, state)
    -> (y, state)`` runs this stage's layers on micro-batch i. Returns (the last stage's outputs [m, ...],
    state, the micro-batch processed per tick, -1 in the bubble)."""
    m = x_mbtd.shape[0]
    s = lax.axis_index(axis)

    def tick(carry, t):
        incoming, out, state = carry
        i = t - s
        valid = (i >= 0) & (i < m)
        ic = jnp.clip(i, 0, m - 1)
        y, state = stage_fn(jnp.where(s == 0, x_mbtd[ic], incoming), ic, valid, state)
        done = valid & (s == pp - 1)
        out = lax.dynamic_update_index_in_dim(out, jnp.where(done, y, out[ic]), ic, 0)
        incoming = lax.ppermute(y, axis, [(j, j + 1) for j in range(pp - 1)])
        return (incoming, out, state), jnp.where(valid, i, -1)

    init = (_varying(jnp.zeros_like(x_mbtd[0]), axis), _varying(jnp.zeros_like(x_mbtd), axis), state)
    (_, out, state), record = lax.scan(tick, init, jnp.arange(m + pp - 1))
    return out, state, record


def _varying(x: jax.Array, axis: str) -> jax.Array:
    return lax.pcast(x, axis, to="varying")


def _layer_specs(layers: dict, axis: str) -> dict:
    return jax.tree.map(lambda _: PartitionSpec(axis), layers)


def _take_rows(cache: KVCache, i: jax.Array, m: int) -> KVCache:
    if m == 1:
        return cache
    return KVCache(*(lax.dynamic_index_in_dim(_split(c, m, axis=1), i, 0, keepdims=False) for c in cache))


def _put_rows(cache: KVCache, rows: KVCache, i: jax.Array, m: int) -> KVCache:
    if m == 1:
        return rows
    return KVCache(*(_merge(lax.dynamic_update_index_in_dim(_split(c, m, axis=1), r, i, 0), axis=1)
                     for c, r in zip(cache, rows, strict=True)))


def _head(params: dict, cfg: ModelConfig, hidden_btd: jax.Array, mesh: Mesh, kind: str, axis: str, m: int,
          return_hidden: bool) -> jax.Array:
    """The output head; data-parallel over the pipeline axis too when the hand-off split the rows."""
    if not _HandOff(mesh, kind, axis, hidden_btd.shape[0] // m).split:
        return output_head(params, cfg, hidden_btd, return_hidden=return_hidden)
    batch_axes = tuple(a for a in (rules_for(kind).get("batch"), axis) if a in mesh.axis_names)

    def fn(x, axes):
        spec = logical_to_spec(axes, kind, mesh.axis_names)
        spec = PartitionSpec(*(batch_axes if name == "batch" else a for name, a in zip(axes, spec, strict=True)))
        return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    with activation_constraints(fn):
        return output_head(params, cfg, fn(hidden_btd, ("batch", "length", "embed")), return_hidden=return_hidden)
