"""What one replica of a model-stage holds, as metadata: per layout, the stored shapes, partition specs,
bytes per device, and how to convert between layouts that store kv heads a different number of times.

The state of a replica is a flat list of leaves: the parameters (in ``jax.tree`` order), then the
optimizer state for training stages (optax, laid out like the parameters; its scalars replicated).
Everything here comes from the parameter tree and ``nereus_jax.sharding``; nothing allocates. The same contract
from a byte count alone, for simulations, is ``elastic.state_bytes.ByteSpec``.

    spec = StateSpec(model_cfg, "train", optimizer=optax.adamw(1e-5))
    spec.bytes_per_device(Layout(tp=2))     # what one device of a tp=2 replica holds
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nereus_jax.config import ModelConfig
from nereus_jax.models import abstract_params, param_axes
from nereus_jax.models.lora import split_trainable
from nereus_jax.sharding import Layout, check_layout, kv_repeat, logical_to_spec, make_mesh, stored_shapes
from nereus_jax.sharding.layout import layout_sizes
from nereus_jax.sharding.rules import OPTIMIZER_DP_AXES

from .plan import DEVICE, ExecutionPlan


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of a replica's state in canonical form (kv heads stored once)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    # over mesh axes "pp"/"expert"/"tp" (and "dp": a sharded optimizer's leaf in the whole state); an axis a mesh
    # lacks ("expert" with ep = 1) is dropped when the spec meets a mesh (:meth:`StateSpec.shardings`)
    spec: PartitionSpec
    kv_axis: int | None  # the axis a layout with tp > num_kv_heads stores repeated
    axes: tuple[str | None, ...] | None = None  # logical axis names (a parameter's, or the one it mirrors)

    def stored_shape(self, rep: int) -> tuple[int, ...]:
        if self.kv_axis is None or rep == 1:
            return self.shape
        s = list(self.shape)
        s[self.kv_axis] *= rep
        return tuple(s)


class StateSpec:
    """The state of one replica of a model-stage (params, plus optimizer state when ``optimizer``)."""

    def __init__(self, model: ModelConfig, kind: str, *, head: str = "lm", num_labels: int = 1,
                 dtype: Any = None, optimizer: optax.GradientTransformation | None = None,
                 shard_optimizer: bool = False):
        self.model, self.kind, self.head, self.num_labels = model, kind, head, num_labels
        self.dtype = np.dtype(dtype or model.param_dtype)
        self.optimizer = optimizer
        self.shard_optimizer = shard_optimizer and optimizer is not None
        self.shards = 1  # replicas the optimizer state is split over (see for_dp)
        params = abstract_params(model, head=head, num_labels=num_labels)
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, self.dtype), params)
        axes = param_axes(model, head=head, num_labels=num_labels)
        specs = jax.tree.map(lambda a: logical_to_spec(a, kind, ("pp", "expert", "tp")), axes,
                             is_leaf=lambda x: isinstance(x, tuple))
        repeated = stored_shapes(model, Layout(tp=2 * model.num_kv_heads), head=head, num_labels=num_labels)
        p_leaves, self.params_def = jax.tree.flatten(params)
        kv_axes = [_kv_axis(s.shape, r) for s, r in zip(p_leaves, _shape_leaves(repeated), strict=True)]
        names = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
        self.leaves = [Leaf(s.shape, np.dtype(s.dtype), sp, kv, tuple(a))
                       for s, sp, kv, a in zip(p_leaves, jax.tree.leaves(specs), kv_axes, names, strict=True)]
        self.n_params = len(self.leaves)
        self.opt_def = None
        if optimizer is not None:
            self._add_optimizer(optimizer, params)
        self.global_leaves = self.leaves  # the leaves of the state of all replicas together (see for_dp)
        self._bytes: dict[Layout, int] = {}
        self._converters: dict[tuple, Callable[[list], list]] = {}
        self._per_dp: dict[int, StateSpec] = {}

    def _add_optimizer(self, optimizer: optax.GradientTransformation, params: Any) -> None:
        # the optimizer sees the trainable leaves only (all, or LoRA's adapters and a value head)
        params = split_trainable(params, self.model)[0]
        opt = jax.eval_shape(optimizer.init, params)
        index = split_trainable(jax.tree.unflatten(self.params_def, list(range(self.n_params))), self.model)[0]
        which = optax.tree_map_params(optimizer, lambda p, i: i, opt, index, transform_non_params=lambda _: -1)
        o_leaves, self.opt_def = jax.tree.flatten(opt)
        for s, i in zip(o_leaves, jax.tree.leaves(which), strict=True):
            if i >= 0:
                p = self.leaves[i]
                if tuple(s.shape) != p.shape:
                    raise ValueError(f"optimizer state leaf {s.shape} mirrors a parameter of shape {p.shape}; "
                                     "only optimizers whose state is laid out like the parameters are supported")
                self.leaves.append(Leaf(p.shape, np.dtype(s.dtype), p.spec, p.kv_axis, p.axes))
            else:
                self.leaves.append(Leaf(tuple(s.shape), np.dtype(s.dtype), PartitionSpec(), None))

    def subset(self, indices: Sequence[int]) -> StateSpec:
        """A params-only spec of some of this spec's parameter leaves (in ``indices`` order), e.g. LoRA's
        adapters: what a weight sync that moves only them schedules and converts. Its state is a flat list."""
        out = object.__new__(StateSpec)
        out.__dict__.update(self.__dict__)
        out.leaves = [self.leaves[i] for i in indices]
        out.n_params, out.opt_def, out.optimizer = len(out.leaves), None, None
        out.params_def = jax.tree.structure(list(range(len(out.leaves))))
        out.global_leaves, out.shards, out.shard_optimizer = out.leaves, 1, False
        out._bytes, out._converters, out._per_dp = {}, {}, {}
        return out

    def for_dp(self, dp: int) -> StateSpec:
        """The spec of one of ``dp`` replicas. With ``shard_optimizer`` (ZeRO-1) and dp > 1 each replica holds the
        whole parameters and 1/dp of the optimizer state: replica i the i-th block of every optimizer leaf along
        one of its replicated axes (``sharding.rules.OPTIMIZER_DP_AXES``, the first that dp divides; a leaf with
        none stays whole on every replica). ``leaves`` then describe one replica's arrays and ``global_leaves``
        the state of all replicas together, whose optimizer leaves are split over the mesh axis "dp". Otherwise
        this spec itself."""
        if dp == 1 or not self.shard_optimizer or self.shards != 1:
            return self
        out = self._per_dp.get(dp)
        if out is None:
            out = self._per_dp[dp] = self._split_optimizer(dp)
        return out

    @property
    def whole(self) -> StateSpec:
        """The spec whose replicas each hold the whole optimizer state (this one unless it is split)."""
        return self.__dict__.get("_whole", self)

    def _split_optimizer(self, dp: int) -> StateSpec:
        out = object.__new__(StateSpec)
        out.__dict__.update(self.__dict__)
        leaves, whole = list(self.leaves[: self.n_params]), list(self.leaves[: self.n_params])
        for leaf in self.leaves[self.n_params:]:
            axis = optimizer_dp_axis(leaf, dp)
            if axis is None:
                leaves.append(leaf)
                whole.append(leaf)
                continue
            shape = list(leaf.shape)
            shape[axis] //= dp
            entries = list(leaf.spec) + [None] * (len(shape) - len(leaf.spec))
            entries[axis] = "dp"
            leaves.append(dataclasses.replace(leaf, shape=tuple(shape)))
            whole.append(dataclasses.replace(leaf, spec=PartitionSpec(*entries)))
        out.leaves, out.global_leaves, out.shards, out._whole = leaves, whole, dp, self
        out._bytes, out._converters, out._per_dp = {}, {}, {}
        return out

    # ------------------------------------------------------------------------------------- per layout
    def repeat(self, layout: Layout) -> int:
        """How many times ``layout`` stores each kv head."""
        return kv_repeat(self.model, layout)

    @functools.cache  # noqa: B019 - specs live as long as the job
    def check(self, layout: Layout) -> None:
        """Raises LayoutError when ``layout`` cannot divide some dimension of the model."""
        check_layout(self.model, layout, kind=self.kind, head=self.head, num_labels=self.num_labels)

    def bytes_per_device(self, layout: Layout) -> int:
        """Bytes each device of a replica with ``layout`` holds (the same on every device)."""
        cached = self._bytes.get(layout)
        if cached is None:
            rep, sizes = self.repeat(layout), layout_sizes(layout)
            cached = sum(_shard_bytes(leaf, rep, sizes) for leaf in self.leaves)
            self._bytes[layout] = cached
        return cached

    def abstract(self, layout: Layout) -> list[jax.ShapeDtypeStruct]:
        """One replica's leaves with ``layout``, as shapes and dtypes."""
        rep = self.repeat(layout)
        return [jax.ShapeDtypeStruct(leaf.stored_shape(rep), leaf.dtype) for leaf in self.leaves]

    def global_abstract(self, layout: Layout) -> list[jax.ShapeDtypeStruct]:
        """The leaves of all replicas' state together (on the mesh (dp, pp, tp)), as shapes and dtypes: one
        replica's, but for an optimizer split over dp (:meth:`for_dp`), whose leaves are whole here."""
        rep = self.repeat(layout)
        return [jax.ShapeDtypeStruct(leaf.stored_shape(rep), leaf.dtype) for leaf in self.global_leaves]

    def shardings(self, mesh: Mesh, memory_kind: str = DEVICE) -> list[NamedSharding]:
        """NamedShardings of every leaf on ``mesh``: one replica's (a mesh with "pp" and "tp" axes, and "expert"
        with ep > 1) or, on a mesh with a "dp" axis, those of all replicas' state together (replicated over dp,
        but for an optimizer split over dp)."""
        leaves = self.global_leaves if "dp" in mesh.axis_names else self.leaves
        return _shardings(tuple(leaf.spec for leaf in leaves), mesh, memory_kind)

    def param_bytes_per_device(self, layout: Layout) -> int:
        """The parameters' part of :meth:`bytes_per_device`."""
        rep, sizes = self.repeat(layout), layout_sizes(layout)
        return sum(_shard_bytes(leaf, rep, sizes) for leaf in self.leaves[: self.n_params])

    # -------------------------------------------------------------------------------------- trees
    def unflatten(self, leaves: Sequence[Any]) -> dict[str, Any]:
        """{"params": tree} (and "opt" for training stages) from the flat leaf list."""
        out = {"params": jax.tree.unflatten(self.params_def, list(leaves[: self.n_params]))}
        if self.opt_def is not None:
            out["opt"] = jax.tree.unflatten(self.opt_def, list(leaves[self.n_params:]))
        return out

    def flatten(self, state: Mapping[str, Any]) -> list[Any]:
        leaves = jax.tree.leaves(state["params"])
        if self.opt_def is not None:
            leaves += jax.tree.leaves(state["opt"])
        assert len(leaves) == len(self.leaves), f"state has {len(leaves)} leaves, spec {len(self.leaves)}"
        return leaves

    def expand(self, host_leaves: Sequence[np.ndarray], rep: int) -> list[np.ndarray]:
        """Canonical host leaves -> as stored with each kv head repeated ``rep`` times."""
        return [x if leaf.kv_axis is None or rep == 1 else np.repeat(x, rep, axis=leaf.kv_axis)
                for x, leaf in zip(host_leaves, self.leaves, strict=True)]

    def collapse(self, host_leaves: Sequence[np.ndarray], rep: int) -> list[np.ndarray]:
        """Inverse of :meth:`expand`: keeps the first stored copy of each kv head."""
        return [x if leaf.kv_axis is None or rep == 1 else np.take(x, np.arange(0, x.shape[leaf.kv_axis], rep),
                                                                   axis=leaf.kv_axis)
                for x, leaf in zip(host_leaves, self.leaves, strict=True)]

    def converter(self, rep_in: int, rep_out: int, source: StateSpec | None = None) -> Callable[..., list]:
        """A traceable ``convert(leaves, shardings=None, sources=None)`` from stored leaves (``rep_in``
        copies of each kv head) to leaves stored with ``rep_out`` copies. With ``source``: it reads a
        ``source`` state and keeps its parameters, cast to this spec's dtypes (the weight-sync derivation).

        Every value keeps its bits (-0.0, subnormals, NaN payloads, signalling NaNs), except where a cast to
        another dtype is asked for (that cast rounds as XLA's convert does). ``shardings`` (per output leaf,
        as the jit's ``out_shardings``) and ``sources`` (per input leaf, the arguments' shardings) pin
        where the data moves: each leaf is resharded once, between the two pins, by collectives and copies
        only, and a kv-repeat change is local reshapes and slices around that reshard (never a reduction,
        which XLA uses to slice a sharded axis and which turns -0.0 into +0.0 and flushes subnormals).
        Floats narrower than 32 bits move as unsigned integers of their width: XLA:CPU runs their
        collectives in float32, which rewrites NaN payloads. Without the pins the partitioner places the
        moves itself and may reduce or widen."""
        cached = self._converters.get((rep_in, rep_out, id(source)))
        if cached is not None:
            return cached
        src = source or self
        if source is not None:
            check_derivable(source, self)

        def convert(leaves: list, shardings: Sequence[Any] | None = None,
                    sources: Sequence[Any] | None = None) -> list:
            leaves = list(leaves[: self.n_params]) if source is not None else list(leaves)
            out = []
            for i, (x, s_leaf, leaf) in enumerate(zip(leaves, src.leaves, self.leaves, strict=False)):
                if x.dtype != leaf.dtype:  # elementwise, so it commutes with the move (of fewer bytes, after it)
                    x = x.astype(leaf.dtype)
                pins = (None if sources is None else sources[i], None if shardings is None else shardings[i])
                kv = s_leaf.kv_axis if rep_in != rep_out else None
                out.append(move_bits(x, kv, rep_in, rep_out, *pins))
            return out

        self._converters[(rep_in, rep_out, id(source))] = convert
        return convert


def optimizer_dp_axis(leaf: Leaf, dp: int) -> int | None:
    """The axis of an optimizer leaf that ZeRO-1 splits over ``dp`` replicas: the first of its logical axes in
    ``OPTIMIZER_DP_AXES`` order that the replica layout leaves whole and ``dp`` divides (None: none does)."""
    if leaf.axes is None:
        return None
    entries = tuple(leaf.spec) + (None,) * (len(leaf.shape) - len(leaf.spec))
    for name in OPTIMIZER_DP_AXES:
        for axis, (logical, mesh_axis) in enumerate(zip(leaf.axes, entries, strict=True)):
            if logical == name and mesh_axis is None and axis != leaf.kv_axis and leaf.shape[axis] % dp == 0:
                return axis
    return None


def check_derivable(source: StateSpec, target: StateSpec) -> None:
    """A target whose parameters are the source's (possibly in another dtype), e.g. actor-train -> -gen."""
    src = [(leaf.shape, leaf.kv_axis) for leaf in source.leaves[: source.n_params]]
    dst = [(leaf.shape, leaf.kv_axis) for leaf in target.leaves]
    if src != dst or target.opt_def is not None:
        raise ValueError("weight sync needs a params-only target with the source's parameter shapes")


def move_bits(x: jax.Array, kv_axis: int | None, rep_in: int, rep_out: int, source: Any, sharding: Any
               ) -> jax.Array:
    """``x`` (laid out as ``source``) with its kv repeat changed (``kv_axis`` not None) and moved to
    ``sharding``. A float narrower than 32 bits moves as an unsigned integer; pinning those bits to
    ``source`` keeps the partitioner from moving the float before the bitcast (it would, since a bitcast
    keeps its operand's sharding). Wider floats move as themselves: a bitcast fused into XLA:CPU's
    layout copies makes them several times slower, and their collectives and copies keep every bit."""
    floating = jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4
    bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]) if floating else x
    if source is not None:
        bits = jax.lax.with_sharding_constraint(bits, source)
    if kv_axis is not None:
        bits = _convert_repeat(bits, kv_axis, rep_in, rep_out, sharding)
    elif sharding is not None:
        bits = jax.lax.with_sharding_constraint(bits, sharding)
    return jax.lax.bitcast_convert_type(bits, x.dtype) if floating else bits


_UINT = {1: jnp.uint8, 2: jnp.uint16}


def _convert_repeat(x: jax.Array, axis: int, rep_in: int, rep_out: int, sharding: Any = None) -> jax.Array:
    """Stored row ``h * rep_out + c`` of the result is a stored copy of kv head ``h`` of ``x``.

    With ``sharding`` the shape changes where they are local: fewer copies are dropped after ``x`` is
    resharded onto the target's tiling (each device then holds whole groups of copies of its heads and
    keeps one per group: a slice of an unsharded axis), more copies are made before the reshard (a
    broadcast of an unsharded axis). Only a repeat ratio that is not a whole number gathers the kv axis
    whole first. No form slices a sharded axis below its shard count, which XLA would lower to a masked
    all-reduce (an add)."""
    n = x.shape[axis] // rep_in
    pin = (lambda y, s: y) if sharding is None else jax.lax.with_sharding_constraint
    if rep_in % rep_out == 0:  # fewer copies: keep the first of every rep_in / rep_out stored rows
        x = pin(x, sharding)
        grouped = _split_axis(x, axis, n * rep_out, rep_in // rep_out)
        return pin(_merge_axis(jax.lax.slice_in_dim(grouped, 0, 1, axis=axis + 1), axis), sharding)
    if rep_out % rep_in == 0:  # more copies: each stored row becomes rep_out / rep_in rows
        grouped = _split_axis(x, axis, n * rep_in, 1)
        wide = jnp.broadcast_to(grouped, grouped.shape[:axis + 1] + (rep_out // rep_in,) + grouped.shape[axis + 2:])
        return pin(_merge_axis(wide, axis), sharding)
    if sharding is not None:
        spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
        spec[axis] = None
        x = pin(x, sharding.update(spec=PartitionSpec(*spec)))
    return pin(jnp.take(x, np.repeat(np.arange(n) * rep_in, rep_out), axis=axis), sharding)


def _split_axis(x: jax.Array, axis: int, outer: int, inner: int) -> jax.Array:
    return jnp.reshape(x, x.shape[:axis] + (outer, inner) + x.shape[axis + 1:])


def _merge_axis(x: jax.Array, axis: int) -> jax.Array:
    return jnp.reshape(x, x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


@functools.lru_cache(maxsize=4096)
def _shardings(specs: tuple[PartitionSpec, ...], mesh: Mesh, memory_kind: str) -> list[NamedSharding]:
    return [NamedSharding(mesh, spec_on_mesh(s, mesh.axis_names), memory_kind=memory_kind) for s in specs]


def spec_on_mesh(spec: PartitionSpec, names: Sequence[str]) -> PartitionSpec:
    """``spec`` without the mesh axes ``names`` lacks (a layout with ep = 1 has no "expert" axis)."""
    if all(e is None or e in names for e in spec):
        return spec
    return PartitionSpec(*(e if e is None or e in names else None for e in spec))


def _shard_bytes(leaf: Leaf, rep: int, sizes: Mapping[str, int]) -> int:
    shape = leaf.stored_shape(rep)
    n = leaf.dtype.itemsize
    for dim, axes in zip(shape, tuple(leaf.spec) + (None,) * (len(shape) - len(leaf.spec)), strict=True):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        n *= dim // math.prod(sizes[a] for a in names)
    return n


def _kv_axis(shape: tuple[int, ...], repeated: tuple[int, ...]) -> int | None:
    diff = [i for i, (a, b) in enumerate(zip(shape, repeated, strict=True)) if a != b]
    assert len(diff) <= 1, (shape, repeated)
    return diff[0] if diff else None


def _shape_leaves(tree: Any) -> list[tuple[int, ...]]:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))


# ------------------------------------------------------------------------------------------ moved bytes
def transition_bytes(old: ExecutionPlan, new: ExecutionPlan, specs: Mapping[Any, StateSpec],
                     devices: Sequence[jax.Device]) -> dict[str, int]:
    """What a plan change must move, from the old and new shardings alone (not from any executor).

    ``moved_bytes``: bytes of every new shard that does not already sit, as the same shard, on its
    device in the old plan (every such shard must be written into a fresh buffer: the memcpy floor).
    ``cross_device_bytes``: the part of those bytes whose data is on no old shard of that device.
    """
    by_id = dict(enumerate(devices))  # plan ids are positions in the device list
    moved = cross = 0
    for ms, sp_new in new.items():
        spec, sp_old = specs[ms], old[ms]
        old_boxes = _boxes(spec, sp_old, by_id) if sp_old.memory == sp_new.memory else {}
        for dev, boxes in _boxes(spec, sp_new, by_id).items():
            held = old_boxes.get(dev)
            for i, (box, stored, nbytes) in enumerate(boxes):
                if held is None or held[i][:2] != (box, stored):
                    moved += nbytes
                    overlap = 0 if held is None else _volume(_intersect(box, held[i][0]))
                    cross += nbytes - nbytes * overlap // max(_volume(box), 1)
    return {"moved_bytes": moved, "cross_device_bytes": cross}


def _boxes(spec: StateSpec, sp, by_id) -> dict[int, list]:
    """device id -> per leaf (canonical index box, stored shard shape, stored bytes)."""
    rep = spec.repeat(sp.layout)
    out: dict[int, list] = {}
    for replica in sp.replicas:
        mesh = make_mesh([by_id[d] for d in replica], sp.layout)
        ids = {by_id[d]: d for d in replica}
        for leaf, sharding in zip(spec.leaves, spec.shardings(mesh), strict=True):
            shape = leaf.stored_shape(rep)
            for dev, index in sharding.devices_indices_map(shape).items():
                box = tuple(_canonical(sl, n, rep if a == leaf.kv_axis else 1)
                            for a, (sl, n) in enumerate(zip(index, shape, strict=True)))
                stored = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape, strict=True))
                out.setdefault(ids[dev], []).append((box, stored, math.prod(stored) * leaf.dtype.itemsize))
    return out


def _canonical(sl: slice, n: int, rep: int) -> tuple[int, int]:
    start, stop, _ = sl.indices(n)
    return start // rep, (stop - 1) // rep + 1


def _intersect(a, b):
    return tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _volume(box) -> int:
    return math.prod(max(0, hi - lo) for lo, hi in box)
