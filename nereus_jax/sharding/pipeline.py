"""Pipeline parallelism: the stacked ``layers`` axis split over ``pp``, run as a GPipe or a 1F1B schedule.

The rules table decides: the mesh axis that a stage kind's rules map ``layers`` to (``pp``) is the
pipeline axis. With that axis absent or of size 1 every function here is exactly the plain model code
(:func:`~nereus_jax.models.forward`); with pp > 1 the
layer stack runs inside ``jax.shard_map`` that is manual over ``pp``, so tp (and, in GPipe, dp) stay with the
SPMD partitioner and tp-sharded weights inside a stage work unchanged.

GPipe (forward: scoring, generation, and training by ``jax.grad``): the batch is cut into ``m`` micro-batches
(micro-batch i = rows i, i+m, ..., so a dp split of the batch stays a dp split of every micro-batch). At
tick t stage s runs its layers on micro-batch t - s, then hands its output to stage s + 1 with
``ppermute``; m + pp - 1 ticks in all, so each stage idles (pp - 1) of them: bubble fraction
(pp - 1) / (m + pp - 1). Training differentiates through the schedule; the backward is its transpose
(reverse ppermute, same tick table reversed), so the same bubble applies, and the backward keeps every
tick's activations (all m micro-batches, and the bubble ticks') until it runs. A bubble tick computes on
zeros (branch-free, cheap to differentiate).

1F1B (training: :func:`pipeline_value_and_grad`, an explicit value-and-gradient function the job's train
step calls instead of ``jax.value_and_grad`` when ``trainer.pipeline_schedule`` is ``1f1b``): the backward
is written into the schedule. Each tick, stage s runs the forward of micro-batch t - s and stashes its input,
then the backward of micro-batch t - 2 (pp - 1) + s: ``jax.vjp`` of its layers, recomputing their forward
from the stashed input, gradients added to the stage's sums; then outputs go to s + 1 and input
cotangents to s - 1 (``ppermute``). The last stage also runs the output head and the loss on each
micro-batch as it arrives, and their backward, so a micro-batch's backward starts as soon as its forward
leaves the stack. A device holds at most min(m, 2 pp - 1) stashed stage inputs (:func:`stash_slots`) and one
micro-batch's layer activations, instead of GPipe's every micro-batch; the price is one more forward per
micro-batch (the recompute). Idle halves of ticks are skipped, so the timeline is (pp - 1) forwards,
m forward+backward ticks and (pp - 1) backwards: bubble (pp - 1) / (m + pp - 1), as GPipe. The loss must be
a sum over micro-batches and over dp replicas' rows (normalised by the whole batch's counts), since each
piece's loss is computed on its own; dp is manual inside the 1F1B ``shard_map`` too (each replica runs the
schedule on its rows; gradients are summed over dp once, after it), which also keeps the loss's gathers
over a tp-sharded vocabulary out of the partitioner's partially-manual corner cases.

Embedding and output head run outside the pipelined stack in the forward: the rules table stores them
replicated over pp (they have no ``layers`` axis), so no stage owns them, tied embeddings need nothing
special and their gradients come out laid out like the parameters. The embedding lookup (no FLOPs) runs
replicated; in GPipe the output head (a large matmul for real vocabularies) runs data-parallel over pp,
every stage taking 1/pp of the rows, instead of on the last stage alone; in 1F1B it runs on the last stage,
one micro-batch at a time.

Generation stays pp = 1: the planner proposes no other layout for actor-gen, and the engine's cached decode
(``nereus_jax.engine.decode``) has no pipelined variant.

Example::

    mesh = make_mesh(jax.devices()[:4], Layout(tp=2, pp=2))
    sharded = shard_params(params, cfg, Layout(tp=2, pp=2), mesh)
    logits = jax.jit(pipeline_forward_fn(mesh, microbatches=4), static_argnums=1)(sharded, cfg, tokens)
    make_loss = functools.partial(actor_loss, cfg, algo, prompt_len)          # forward_fn -> loss(params, mb)
    (values, metrics), grads = pipeline_value_and_grad(make_loss, sharded, pieces, mesh=mesh)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nereus_jax.config import PIPELINE_SCHEDULES, ModelConfig
from nereus_jax.models import lora
from nereus_jax.models.decoder import (
    apply_layers,
    causal_mask,
    default_positions,
    embed_tokens,
    forward,
    output_head,
    routing_inputs,
)
from nereus_jax.models.layers import activation_constraints, replication
from nereus_jax.models.routing import with_mismatch
from nereus_jax.sharding.experts import expert_degree, expert_parallel_layer
from nereus_jax.sharding.layout import LayoutError, logical_to_spec
from nereus_jax.sharding.rules import rules_for

ForwardFn = Callable[..., jax.Array]


class PipelineError(LayoutError):
    """A pipeline the layout or batch cannot run (pp not dividing layers, micro-batches not dividing rows)."""


def pipeline_axis(mesh: Mesh, kind: str = "train") -> str | None:
    """The mesh axis the stage kind's rules put ``layers`` on, or None when the mesh does not pipeline."""
    axis = rules_for(kind).get("layers")
    return axis if axis in mesh.axis_names and mesh.shape[axis] > 1 else None


def bubble_fraction(pp: int, microbatches: int) -> float:
    """Idle fraction of either schedule, GPipe or 1F1B: (pp - 1) / (m + pp - 1)."""
    return (pp - 1) / (microbatches + pp - 1)


def check_schedule(name: str) -> str:
    """``name`` if it is a training schedule this module runs, else a PipelineError naming the valid ones."""
    if name not in PIPELINE_SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {name!r}; valid: {', '.join(PIPELINE_SCHEDULES)}")
    return name


def gpipe_schedule(pp: int, microbatches: int) -> np.ndarray:
    """[ticks, pp]: the micro-batch each stage runs at each tick, -1 where it idles (the bubble)."""
    i = np.arange(microbatches + pp - 1)[:, None] - np.arange(pp)[None, :]
    return np.where((i >= 0) & (i < microbatches), i, -1)


def pipeline_forward(params: dict, cfg: ModelConfig, tokens_bt: jax.Array, positions_bt: jax.Array | None = None,
                     attention_mask_bt: jax.Array | None = None, *, mesh: Mesh, microbatches: int,
                     kind: str = "train", return_hidden: bool = False,
                     segment_ids_bt: jax.Array | None = None, routes_btlk: jax.Array | None = None,
                     replay: bool = False, return_routing: bool = False, dropout_key: jax.Array | None = None):
    """:func:`~nereus_jax.models.forward` with the layer stack pipelined over the mesh's pp axis.

    Same outputs (logits, values, or hidden states); differentiable, so a loss built on it trains. Packed rows
    pass ``segment_ids_bt`` (and their positions) as to ``forward``. Mixture-of-experts routing
    (``routes_btlk``, ``replay``, ``return_routing``) works as in ``forward``: each stage reads its layers'
    recorded routes, and the router statistics are summed over the micro-batches (each stage's layers, the
    mismatch over every stage's), so they equal the unpipelined call's. LoRA dropout (``dropout_key``): each stage
    reads its layers' and its micro-batch rows' keys (``lora.row_keys``), so it draws the unpipelined call's masks.
    """
    axis = _checked_axis(params, tokens_bt.shape[0], mesh, microbatches, kind)
    if axis is None:
        return forward(params, cfg, tokens_bt, positions_bt, attention_mask_bt, return_hidden=return_hidden,
                       segment_ids_bt=segment_ids_bt, routes_btlk=routes_btlk, replay=replay,
                       return_routing=return_routing, dropout_key=dropout_key)
    call = _model_call(tokens_bt, positions_bt, attention_mask_bt, segment_ids_bt)
    routing = routing_inputs(cfg, tokens_bt, attention_mask_bt, segment_ids_bt, routes_btlk, replay, return_routing)
    if dropout_key is not None and cfg.lora_dropout and lora.has_adapters(params["layers"]):
        routing["dropout_lbk"] = lora.row_keys(dropout_key, cfg.num_layers, tokens_bt.shape[0])
    hidden, _, stats = _run_uncached(params["layers"], cfg, embed_tokens(params, tokens_bt), call.positions,
                                     call.mask, call.segments, mesh=mesh, axis=axis, m=microbatches, kind=kind,
                                     routing=routing)
    out = _head(params, cfg, hidden, mesh, kind, axis, microbatches, return_hidden)
    return (out, stats) if return_routing else out


def pipeline_forward_fn(mesh: Mesh, microbatches: int | Callable[[int, int], int],
                        kind: str = "train") -> ForwardFn:
    """A drop-in for :func:`~nereus_jax.models.forward` (same signature) that pipelines over ``mesh``;
    ``forward`` itself when the mesh does not pipeline. Hand it to losses that take a forward function.
    ``microbatches`` may be a function of (rows per replica of the call, pp), evaluated at trace time, for
    programs whose batch size varies (packed rows)."""
    axis = pipeline_axis(mesh, kind)
    if axis is None:
        return _with_experts(mesh, _with_replication(mesh, forward))
    if not callable(microbatches):
        return _with_experts(mesh, functools.partial(pipeline_forward, mesh=mesh, microbatches=microbatches,
                                                     kind=kind))
    dp, pp = _batch_degree(mesh, kind), mesh.shape[axis]

    def fn(params, cfg, tokens_bt, *args, **kwargs):
        m = microbatches(tokens_bt.shape[0] // dp, pp)
        return pipeline_forward(params, cfg, tokens_bt, *args, mesh=mesh, microbatches=m, kind=kind, **kwargs)

    return _with_experts(mesh, fn)


def _with_replication(mesh: Mesh, fn: ForwardFn) -> ForwardFn:
    """``fn`` traced with :func:`~nereus_jax.models.layers.replication` making a value whole on all of
    ``mesh`` (the embedding lookup's backward gathers its tokens' cotangents over dp with it, models/decoder.py)."""
    whole = NamedSharding(mesh, PartitionSpec())

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with replication(lambda x: lax.with_sharding_constraint(x, whole)):
            return fn(*args, **kwargs)

    return wrapped


def _with_experts(mesh: Mesh, fn: ForwardFn) -> ForwardFn:
    """``fn`` itself on a mesh without expert parallelism; else ``fn`` traced with the expert-parallel layer
    installed (:func:`~nereus_jax.sharding.experts.expert_parallel_layer`)."""
    if expert_degree(mesh) == 1:
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with expert_parallel_layer(mesh):
            return fn(*args, **kwargs)

    return wrapped


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


def one_f_one_b_schedule(pp: int, microbatches: int) -> np.ndarray:
    """[ticks, pp, 2]: the micro-batch each stage runs forward (``[..., 0]``) and backward (``[..., 1]``) at each
    tick of :func:`pipeline_value_and_grad`, -1 where that half of the tick idles; m + 2 (pp - 1) ticks. Stage s
    runs the forward of micro-batch i at tick i + s and its backward at tick i + 2 (pp - 1) - s (the last
    stage both in one tick)."""
    t, s = np.arange(microbatches + 2 * (pp - 1))[:, None], np.arange(pp)[None, :]
    forward, backward = t - s, t - 2 * (pp - 1) + s
    return np.stack([np.where((i >= 0) & (i < microbatches), i, -1) for i in (forward, backward)], axis=-1)


def stash_slots(pp: int, microbatches: int) -> int:
    """Stage inputs a device keeps at once under 1F1B: min(m, 2 pp - 1). Stage s holds micro-batch i from its
    forward (tick i + s) to its backward (tick i + 2 (pp - 1) - s), and ticks are lock-step (every stage
    forwards, then every stage runs a backward, then both hand-offs), so stage 0 has 2 pp - 1 in flight, not
    the pp of an asynchronous 1F1B whose hand-offs take part of a tick."""
    return min(microbatches, 2 * pp - 1)


def call_microbatches(make_loss: MakeLoss, params: dict, mb, *, mesh: Mesh,
                      microbatches: int | Callable[[int, int], int], kind: str = "train") -> int:
    """The pipeline micro-batch count for the model call ``make_loss(forward)(params, mb)`` makes:
    ``microbatches``, or its value at (the call's rows per replica, pp) when it is a function (as
    :func:`pipeline_forward_fn` evaluates it)."""
    if not callable(microbatches):
        return microbatches
    axis = pipeline_axis(mesh, kind)
    rows = _Probe().run(make_loss, _head_params(params), mb).tokens.shape[0]
    return microbatches(rows // _batch_degree(mesh, kind), mesh.shape[axis] if axis else 1)


def pipeline_value_and_grad(make_loss: MakeLoss, params: dict, mbs, *, mesh: Mesh,
                            kind: str = "train") -> tuple[tuple[jax.Array, dict], dict]:
    """A loss's values and gradients on m micro-batches, the layer stack run as the 1F1B schedule over the
    mesh's pp axis (module docstring).

    ``make_loss(forward_fn)`` builds ``loss(params, mb) -> (value, metrics)`` on a forward function (as
    :func:`~nereus_jax.runtime.step.losses.actor_loss` does); the loss makes exactly one model call through it and
    reads the parameters only through that call. ``mbs``: the loss's inputs as m micro-batches, every leaf
    ``[m, ...]``; a leaf of rank >= 2 holds rows on axis 1, split over dp (as the job places micro-batches).
    Each dp replica runs the loss on its rows of each micro-batch, so the loss must add up over rows (the
    job's losses do, given the whole batch's normalisers). Returns ``((values [dp * m], metrics {name:
    [dp * m]}), grads)``: the loss value and metrics of every (replica, micro-batch) piece, replica-major, and
    the gradient of the values' sum laid out like ``params`` (the layers split over pp)."""
    out, grads, _ = _one_f_one_b(make_loss, params, mbs, mesh=mesh, kind=kind)
    return out, grads


def executed_1f1b_schedule(make_loss: MakeLoss, params: dict, mbs, *, mesh: Mesh, kind: str = "train") -> np.ndarray:
    """Runs :func:`pipeline_value_and_grad` once and returns, as recorded by the running program, the
    micro-batch each stage ran forward and backward at each tick ([ticks, pp, 2], -1 = idle). For benchmarks
    and tests."""
    return np.asarray(jax.jit(lambda p, mbs: _one_f_one_b(make_loss, p, mbs, mesh=mesh, kind=kind)[2])(params, mbs))


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


def _split(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [m, B/m, ...]: micro-batch i holds rows i, i+m, ... (a dp split stays a dp split)."""
    return jnp.moveaxis(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 1, 0)


def _merge(x_m: jax.Array) -> jax.Array:
    """Inverse of :func:`_split`."""
    return jnp.moveaxis(x_m, 0, 1).reshape(-1, *x_m.shape[2:])


def _stage_constraints(mesh: Mesh, kind: str, *manual_axes: str):
    """Activation annotations inside a stage: the rules table over the axes the partitioner still owns
    (a bare PartitionSpec resolves against the shard_map's mesh, where ``manual_axes`` are manual)."""
    auto_axes = tuple(a for a in mesh.axis_names if a not in manual_axes)

    def fn(x, axes):
        return lax.with_sharding_constraint(x, logical_to_spec(axes, kind, auto_axes))

    return activation_constraints(fn)


def _run_uncached(layers, cfg, x_btd, positions_bt, mask_bt, segments_bt, *, mesh, axis, m, kind, routing=None):
    """The GPipe forward of the layer stack: (outputs [B, ...], the executed schedule, and with ``routing``
    (:func:`~nereus_jax.models.decoder.routing_inputs`) the call's RouterStats, else None)."""
    t, hand_off = x_btd.shape[1], _HandOff(mesh, kind, axis, x_btd.shape[0] // m)
    routing = routing or {}
    stats = "token_mask_bt" in routing
    routes = routing.get("routes_lbtk")
    routes_m = None if routes is None else jnp.moveaxis(_split(jnp.moveaxis(routes, 0, 1), m), 2, 0)  # [L, m, ...]
    drop = routing.get("dropout_lbk")
    drop_m = None if drop is None else jnp.moveaxis(_split(jnp.moveaxis(drop, 0, 1), m), 2, 0)  # [L, m, rows, 2]

    def body(layers, x_m, pos_m, mask_m, seg_m, routes_m, counted_m, drop_m):
        def stage(x, ic):
            out = apply_layers(layers, cfg, x, pos_m[ic], causal_mask(t, mask_m[ic], seg_m[ic]),
                               **_stage_routing(routing, routes_m, counted_m, drop_m, ic))
            if not stats:
                return out, None
            y, st = out
            mismatch = None if st.mismatch_bt is None else jnp.stack([st.mismatch_bt, st.own_mismatch_bt], -1)
            return y, (st.counts_le, st.probs_le, mismatch)

        with _stage_constraints(mesh, kind, axis):
            out, record, acc = _gpipe(stage, x_m, axis, mesh.shape[axis])
        if stats and acc[2] is not None:  # a token mismatches when it does in any stage's layers
            acc = (*acc[:2], lax.psum(acc[2].astype(jnp.int32), axis) > 0)
        return hand_off.inside(out), record[None], acc

    counted = routing.get("token_mask_bt")
    acc_specs = (PartitionSpec(axis), PartitionSpec(axis), None if routes is None else PartitionSpec()) \
        if stats else None
    specs = (_layer_specs(layers, axis), PartitionSpec(), PartitionSpec(), PartitionSpec(), PartitionSpec(),
             None if routes is None else PartitionSpec(axis), None if counted is None else PartitionSpec(),
             None if drop is None else PartitionSpec(axis))
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(hand_off.spec, PartitionSpec(axis), acc_specs),
                       axis_names={axis})
    out, record, acc = fn(layers, _split(x_btd, m), _split(positions_bt, m), _split(mask_bt, m),
                          _split(segments_bt, m), routes_m, None if counted is None else _split(counted, m), drop_m)
    if not stats:
        return hand_off.outside(out), record.T, None
    tokens = jnp.sum(counted.astype(jnp.float32))
    return hand_off.outside(out), record.T, with_mismatch(acc[0], acc[1], tokens,
                                                          None if acc[2] is None else _merge(acc[2]))


def _stage_routing(routing: dict, routes_m, counted_m, drop_m, i) -> dict:
    """:func:`apply_layers`' routing keywords for micro-batch ``i`` on a stage (its layers' routes, and with LoRA
    dropout its layers' keys for the micro-batch's rows)."""
    out = {} if drop_m is None else {"dropout_lbk": drop_m[:, i]}
    if "replay" not in routing:  # no routing inputs (routing_inputs gave none)
        return out
    out |= {"routes_lbtk": None if routes_m is None else routes_m[:, i], "replay": routing["replay"]}
    return out if counted_m is None else out | {"token_mask_bt": counted_m[i]}


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


def _gpipe(stage_fn, x_mbtd, axis: str, pp: int):
    """The GPipe forward schedule, inside shard_map (manual over ``axis``). ``stage_fn(x, i) -> (y, extra)``
    runs this stage's layers on micro-batch i (in the bubble on a clipped index; the result is dropped);
    ``extra`` is None or (counts, probability sums, mismatch [rows, t, 2] or None) of its router statistics.
    Returns (the last stage's outputs [m, ...], the micro-batch processed per tick, -1 in the bubble, and the
    extras: counts and probability sums summed over the micro-batches, mismatch per micro-batch [m, ...])."""
    m = x_mbtd.shape[0]
    s = lax.axis_index(axis)
    shapes = jax.eval_shape(stage_fn, _varying(x_mbtd[0], axis), 0)[1]

    def tick(carry, t):
        incoming, out, acc = carry
        i = t - s
        valid = (i >= 0) & (i < m)
        ic = jnp.clip(i, 0, m - 1)
        y, extra = stage_fn(jnp.where(s == 0, x_mbtd[ic], incoming), ic)
        done = valid & (s == pp - 1)
        out = lax.dynamic_update_index_in_dim(out, jnp.where(done, y, out[ic]), ic, 0)
        if extra is not None:
            counts, probs, mismatch = extra
            acc = (acc[0] + jnp.where(valid, counts, 0), acc[1] + jnp.where(valid, probs, 0),
                   None if mismatch is None else _put(acc[2], mismatch, ic, valid))
        incoming = lax.ppermute(y, axis, [(j, j + 1) for j in range(pp - 1)])
        return (incoming, out, acc), jnp.where(valid, i, -1)

    acc = None
    if shapes is not None:
        counts, probs, mismatch = shapes
        acc = (jnp.zeros(counts.shape, counts.dtype), jnp.zeros(probs.shape, probs.dtype),
               None if mismatch is None else jnp.zeros((m, *mismatch.shape), mismatch.dtype))
    init = (_varying(jnp.zeros_like(x_mbtd[0]), axis), _varying(jnp.zeros_like(x_mbtd), axis),
            jax.tree.map(lambda a: _varying(a, axis), acc))
    (_, out, acc), record = lax.scan(tick, init, jnp.arange(m + pp - 1))
    return out, record, acc


def _varying(x: jax.Array, axis: str | tuple[str, ...]) -> jax.Array:
    return lax.pcast(x, axis, to="varying")


def _layer_specs(layers: dict, axis: str) -> dict:
    return jax.tree.map(lambda _: PartitionSpec(axis), layers)


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


# ------------------------------------------------------------------------------------------ 1F1B
MakeLoss = Callable[[ForwardFn], Callable[[dict, dict], tuple[jax.Array, dict]]]


class _ModelCall(NamedTuple):
    """One model call's inputs as the pipeline runs them ([rows, length] each; [m, rows, length] per micro-batch),
    and its replayed routes ([rows, length, layers, k]; None: the routers' own choice)."""

    tokens: jax.Array
    positions: jax.Array
    mask: jax.Array
    segments: jax.Array
    routes: jax.Array | None = None
    dropout: jax.Array | None = None  # LoRA dropout keys [rows, layers, 2] (lora.row_keys, row-major)


def _model_call(tokens_bt, positions_bt=None, attention_mask_bt=None, segment_ids_bt=None) -> _ModelCall:
    """``forward``'s defaults made explicit: every token real (packed: the segments' tokens), positions from the
    mask, one segment per row."""
    if attention_mask_bt is None:
        attention_mask_bt = jnp.ones(tokens_bt.shape, jnp.int32) if segment_ids_bt is None else \
            (segment_ids_bt > 0).astype(jnp.int32)
    if positions_bt is None:
        positions_bt = default_positions(tokens_bt, attention_mask_bt)
    segments = jnp.ones(tokens_bt.shape, jnp.int32) if segment_ids_bt is None else segment_ids_bt
    return _ModelCall(tokens_bt, positions_bt, attention_mask_bt, segments)


class _Probe:
    """A forward function that records the model call a loss makes and returns zeros shaped like its output:
    tracing ``make_loss(probe)(params, mb)`` yields the call's inputs (the loss computed on the zeros is dead
    code), its ``cfg`` and ``return_hidden``."""

    def __init__(self):
        self.call, self.cfg, self.return_hidden = None, None, False

    def run(self, make_loss: MakeLoss, params: dict, mb) -> _ModelCall:
        self.call = None
        make_loss(self)(params, mb)
        if self.call is None:
            raise PipelineError("the loss never called its forward function; 1F1B pipelines the model call it makes")
        return self.call

    def __call__(self, params, cfg, tokens_bt, positions_bt=None, attention_mask_bt=None, *, return_hidden=False,
                 segment_ids_bt=None, routes_btlk=None, replay=False, return_routing=False, dropout_key=None,
                 dropout_rows=None):
        if self.call is not None:
            raise PipelineError("the loss called its forward function twice; 1F1B pipelines one model call per loss")
        if return_routing or (routes_btlk is not None and not replay):
            raise PipelineError("1F1B does not return router statistics (a load-balancing loss needs them): "
                                "train with trainer.pipeline_schedule=gpipe")
        self.call = _model_call(tokens_bt, positions_bt, attention_mask_bt, segment_ids_bt)._replace(routes=routes_btlk)
        if dropout_key is not None:
            raise PipelineError("1F1B takes a LoRA-dropout call's per-row keys (dropout_rows, as "
                                "runtime/step/losses.py pipelined_value_and_grad splits them), not its key")
        if dropout_rows is not None and cfg.lora_dropout and cfg.lora_rank:
            self.call = self.call._replace(dropout=dropout_rows)
        self.cfg, self.return_hidden = cfg, return_hidden
        hidden = jax.ShapeDtypeStruct((*tokens_bt.shape, cfg.hidden_size), params["final_norm"]["scale"].dtype)
        out = jax.eval_shape(lambda p, x: output_head(p, cfg, x, return_hidden=return_hidden), params, hidden)
        return jnp.zeros(out.shape, out.dtype)


def _head_params(params: dict) -> dict:
    """What :func:`~nereus_jax.models.output_head` reads: the final norm and the lm or value head (the
    embedding when tied)."""
    keys = ["final_norm"] + [k for k in ("lm_head", "value_head") if k in params]
    return {k: params[k] for k in (keys if len(keys) > 1 else [*keys, "embed"])}


def _one_f_one_b(make_loss: MakeLoss, params: dict, mbs, *, mesh: Mesh, kind: str):
    """((values [dp * m], metrics), grads, record [ticks, pp, 2]) of the 1F1B schedule. The embedding runs
    outside the pipelined stack as in :func:`pipeline_forward`; its gradient is one backward over the
    cotangents the schedule hands back from stage 0."""
    axis = pipeline_axis(mesh, kind)
    if axis is None:
        raise PipelineError(f"the mesh {dict(mesh.shape)} does not pipeline stage kind {kind!r} (no pp axis over 1); "
                            "differentiate the plain forward instead")
    probe = _Probe()
    head = _head_params(params)
    calls = jax.vmap(lambda mb: probe.run(make_loss, head, mb))(mbs)
    m, rows = calls.tokens.shape[:2]
    _checked_axis(params, m * rows, mesh, m, kind)
    rest = {k: v for k, v in params.items() if k != "layers"}
    tokens = _merge(calls.tokens)
    x, embed_vjp = jax.vjp(lambda rest: embed_tokens(rest, tokens), rest)
    g_layers, g_head, g_x, values, metrics, record = _run_1f1b(
        make_loss, probe, params["layers"], head, _split(x, m), calls, mbs, mesh=mesh, axis=axis, kind=kind)
    (grads,) = embed_vjp(_merge(g_x))
    grads = {k: jax.tree.map(jnp.add, g, g_head[k]) if k in g_head else g for k, g in grads.items()}
    return (values, metrics), {**grads, "layers": g_layers}, jnp.swapaxes(record, 0, 1)


def _run_1f1b(make_loss, probe, layers, head, x_m, calls, mbs, *, mesh, axis, kind):
    """The schedule inside shard_map (manual over ``axis`` and dp). Each tick, on stage s: the forward of
    micro-batch t - s (the last stage adds the output head and the loss, and their backward), its input
    stashed; then the backward of micro-batch t - 2 (pp - 1) + s, recomputing the stage's forward from the
    stashed input under ``jax.vjp``; then the outputs go to stage s + 1 and the input cotangents to stage
    s - 1. Idle halves are skipped (``lax.cond``). Returns the stage's layer gradients (summed over dp), the
    head gradients (over pp and dp), the cotangents of the stack's inputs and each replica's values and
    metrics (over pp), and the stage's record."""
    cfg, pp, m = probe.cfg, mesh.shape[axis], x_m.shape[0]
    slots = stash_slots(pp, m)
    dp = rules_for(kind).get("batch")
    manual = (axis, dp) if dp in mesh.axis_names else (axis,)

    def body(layers, head, x_m, calls, mbs):
        s = lax.axis_index(axis)
        first, last = s == 0, s == pp - 1
        # differentiated as replica-local values: their gradients are summed once after the schedule, not by a
        # psum inside every backward (which would also sit inside the last stage's branch alone)
        layers, head = _vary((layers, head), manual)

        def stage(layers, x, i):
            c = _at(calls, i)
            replay = {} if c.routes is None else {"routes_lbtk": jnp.moveaxis(c.routes, 2, 0), "replay": True}
            if c.dropout is not None:
                replay["dropout_lbk"] = jnp.moveaxis(c.dropout, 1, 0)
            return apply_layers(layers, cfg, x, c.positions, causal_mask(x.shape[1], c.mask, c.segments), **replay)

        def head_loss(y, i):
            def loss(head, y):
                def forward_fn(params, cfg, *args, return_hidden=False, **kwargs):
                    return output_head(params, cfg, y, return_hidden=return_hidden)
                return make_loss(forward_fn)(head, _at(mbs, i))

            value, vjp, metrics = jax.vjp(loss, head, y, has_aux=True)
            return (value, metrics, *vjp(jnp.ones_like(value)))

        def forward(x, i):
            y = stage(layers, x, i)
            return (y, *_cond(last, head_loss, (y, i), manual))

        def backward(x, g, i):
            return jax.vjp(lambda layers, x: stage(layers, x, i), layers, x)[1](g)

        def tick(carry, t):
            fwd_in, bwd_in, stash, g_layers, g_head, g_x, values, metrics = carry
            i_f, i_b = t - s, t - 2 * (pp - 1) + s
            ok_f, ok_b = (i_f >= 0) & (i_f < m), (i_b >= 0) & (i_b < m)
            i_f, i_b = jnp.clip(i_f, 0, m - 1), jnp.clip(i_b, 0, m - 1)
            x = jnp.where(first, x_m[i_f], fwd_in)
            y, value, mets, d_head, d_y = _cond(ok_f, forward, (x, i_f), manual)
            stash = _put(stash, x, i_f % slots, ok_f)
            values, metrics = jax.tree.map(lambda buf, v: _put(buf, v, i_f, ok_f & last), (values, metrics),
                                           (value, mets))
            d_layers, d_x = _cond(ok_b, backward, (stash[i_b % slots], jnp.where(last, d_y, bwd_in), i_b), manual)
            g_layers, g_head = jax.tree.map(jnp.add, (g_layers, g_head), (d_layers, d_head))
            g_x = _put(g_x, d_x, i_b, ok_b & first)
            fwd_in = lax.ppermute(y, axis, [(j, j + 1) for j in range(pp - 1)])
            bwd_in = lax.ppermute(d_x, axis, [(j + 1, j) for j in range(pp - 1)])
            record = jnp.stack([jnp.where(ok_f, i_f, -1), jnp.where(ok_b, i_b, -1)])
            return (fwd_in, bwd_in, stash, g_layers, g_head, g_x, values, metrics), record

        with _stage_constraints(mesh, kind, *manual):
            value, metrics = jax.eval_shape(head_loss, x_m[0], 0)[:2]
            init = (jnp.zeros_like(x_m[0]), jnp.zeros_like(x_m[0]), jnp.zeros((slots, *x_m.shape[1:]), x_m.dtype),
                    jax.tree.map(jnp.zeros_like, layers), jax.tree.map(jnp.zeros_like, head), jnp.zeros_like(x_m),
                    *jax.tree.map(lambda a: jnp.zeros((m, *a.shape), a.dtype), (value, metrics)))
            carry, record = lax.scan(tick, _vary(init, manual), jnp.arange(m + 2 * (pp - 1)))
        g_layers, g_head, g_x, values, metrics = carry[3:]
        g_x, values, metrics = lax.psum((g_x, values, metrics), axis)
        g_layers = lax.psum(g_layers, manual[1:]) if len(manual) > 1 else g_layers
        return g_layers, lax.psum(g_head, manual), g_x, values, metrics, record[None]

    layer_specs, rows = _layer_specs(layers, axis), PartitionSpec(None, *manual[1:])
    per_row = lambda tree: jax.tree.map(lambda a: rows if a.ndim > 1 else PartitionSpec(), tree)  # noqa: E731
    routes = PartitionSpec(None, manual[1] if len(manual) > 1 else None, None, axis)  # a stage reads its layers'
    dropout = PartitionSpec(None, manual[1] if len(manual) > 1 else None, axis)  # a stage: its layers' keys
    call_specs = _ModelCall(rows, rows, rows, rows, None if calls.routes is None else routes,
                            None if calls.dropout is None else dropout)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(layer_specs, PartitionSpec(), rows, call_specs, per_row(mbs)),
                       out_specs=(layer_specs, PartitionSpec(), rows, PartitionSpec(*manual[1:]),
                                  PartitionSpec(*manual[1:]), PartitionSpec(axis)), axis_names=set(manual))
    return fn(layers, head, x_m, calls, mbs)


def _cond(pred: jax.Array, fn, operands: tuple, axes: tuple[str, ...]):
    """``fn(*operands)`` where ``pred``, zeros of its output's shapes elsewhere (only the taken branch runs);
    outputs varying over ``axes``, as ``lax.cond`` needs both branches to agree."""
    shapes = jax.eval_shape(fn, *operands)
    return lax.cond(pred, lambda *a: _vary(fn(*a), axes),
                    lambda *a: _vary(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), axes), *operands)


def _vary(tree, axes: tuple[str, ...]):
    """Every leaf typed as varying over ``axes`` (adding a varying zero leaves values and dtypes as they are)."""
    return jax.tree.map(lambda x: x + _varying(jnp.zeros((), x.dtype), axes), tree)


def _at(tree, i: jax.Array):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _put(buf: jax.Array, value: jax.Array, i: jax.Array, pred: jax.Array) -> jax.Array:
    """``buf`` with entry ``i`` set to ``value`` where ``pred`` (else left as it is)."""
    return lax.dynamic_update_index_in_dim(buf, jnp.where(pred, value, buf[i]), i, 0)
