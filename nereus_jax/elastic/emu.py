"""The Elastic Model Unit: one replica of one model-stage on its own devices, with its arrays.

An EMU holds the parameters (and, for a training stage, the optax state laid out like the parameters,
not sharded across DP replicas, as in the paper) of one replica with layout ``(tp, pp)`` on the mesh
``make_mesh(devices, layout)``. DP is not inside a unit: dp = the number of live EMUs of a model-stage.
Training over replicas runs as one SPMD program: :func:`assemble_replicas` views the replicas' buffers
as arrays on the mesh (dp, pp, tp) without copying and :func:`split_replicas` splits results back.

    unit = EMU.create(ModelStage("actor", "train"), spec, Layout(tp=2), devices[:2], {"params": p, "opt": o})
    unit.bytes_per_device()   # {0: ..., 1: ...} from the shardings
    unit.to_host()            # canonical numpy copy, bit for bit (kv copies dropped)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nereus_jax.model_stage import ModelStage
from nereus_jax.sharding import Layout, bytes_per_device, device_index, make_mesh, to_numpy

from .plan import DEVICE
from .spec import StateSpec, move_bits, spec_on_mesh


@dataclasses.dataclass(eq=False)
class EMU:
    """One replica of one model-stage: layout, ordered devices, state leaves (see StateSpec), memory kind."""

    stage: ModelStage
    layout: Layout
    devices: tuple[jax.Device, ...]
    leaves: list[jax.Array]
    spec: StateSpec
    memory: str = DEVICE
    shard: int = 0  # with an optimizer split over the replicas (StateSpec.for_dp): which block this one holds

    @classmethod
    def create(cls, stage: ModelStage, spec: StateSpec, layout: Layout, devices: Sequence[jax.Device],
               state: Mapping[str, Any], memory: str = DEVICE) -> EMU:
        """Lays a canonical state ({"params": tree, "opt": optax state}) out on ``devices``."""
        spec.check(layout)
        devices = tuple(devices)
        host = spec.expand([np.asarray(x) for x in spec.flatten(state)], spec.repeat(layout))
        mesh = make_mesh(devices, layout)
        leaves = jax.device_put(host, spec.shardings(mesh, memory))
        return cls(stage, layout, devices, leaves, spec, memory)

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(device_index(d) for d in self.devices)

    @property
    def mesh(self) -> Mesh:
        return make_mesh(self.devices, self.layout)

    @property
    def state(self) -> dict[str, Any]:
        return self.spec.unflatten(self.leaves)

    @property
    def params(self) -> Any:
        return self.state["params"]

    @property
    def opt_state(self) -> Any:
        return self.state.get("opt")

    def bytes_per_device(self) -> dict[int, int]:
        """Bytes each device holds for this unit, from the arrays' shardings."""
        return bytes_per_device(self.leaves)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_per_device().values())

    def to_host(self) -> dict[str, Any]:
        """A canonical numpy copy of the state (kv copies dropped), bit for bit. With several processes,
        on every one (a collective when the unit spans processes)."""
        host = self.spec.collapse([to_numpy(x) for x in self.leaves], self.spec.repeat(self.layout))
        return self.spec.unflatten(host)

    def checksum(self) -> np.ndarray:
        """Per leaf, [hash, hash, disagreeing devices] (uint32): two position-keyed hashes of the canonical
        state's raw bits (a kv copy counts as its head), read from every device, and how many devices hold a
        block that differs from another device's copy of the same canonical block (replicas and kv copies
        must agree bit for bit). Equal across layouts, device orders and memory kinds for equal states; a
        changed bit anywhere changes it."""
        leaves = self.leaves
        if self.memory != DEVICE:
            leaves = jax.device_put(leaves, self.spec.shardings(self.mesh, DEVICE))
        return leaves_checksum(leaves, self.mesh, self.spec.leaves, self.spec.repeat(self.layout))

    def __repr__(self) -> str:
        part = f" optimizer block {self.shard}/{self.spec.shards}" if self.spec.shards > 1 else ""
        return f"EMU({self.stage} {self.layout} {self.memory}{part} on {list(self.device_ids)})"

    def __getattr__(self, name: str) -> Any:
        """Only for attributes not set: a unit from :func:`split_replicas` builds its ``leaves`` (views of the
        whole state's buffers, which take host time to build) on first use, so a training step that assembles its units
        again without reading them pays nothing."""
        lazy = self.__dict__.get("_lazy")
        if name == "leaves" and lazy is not None:
            leaves = self.__dict__.setdefault("leaves", lazy())  # two threads at once: both get the first
            self.__dict__.pop("_lazy", None)
            return leaves
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def leaves_checksum(leaves: Sequence[jax.Array], mesh: Mesh, meta: Sequence[Any], rep: int) -> np.ndarray:
    """:meth:`EMU.checksum` of ``leaves`` laid out on ``mesh`` as ``meta`` (StateSpec leaves: partition spec
    and kv axis) says, with ``rep`` copies of each kv head. Each device hashes its own block (one program:
    no value is moved or combined before it is hashed, so nothing can be normalised on the way)."""
    kv = tuple((spec_on_mesh(leaf.spec, mesh.axis_names), leaf.kv_axis if rep > 1 else None) for leaf in meta)
    shapes = tuple(tuple(x.shape) for x in leaves)
    parts = np.asarray(_device_hashes(list(leaves), mesh, kv, rep))  # [device position, leaf, lane]
    out = np.zeros((len(leaves), 3), np.uint32)
    for i, (shape, (spec, axis)) in enumerate(zip(shapes, kv, strict=True)):
        holder = _block_holders(mesh, shape, spec, axis, rep)
        reps = np.unique(holder)
        out[i, :2] = parts[reps, i].sum(axis=0, dtype=np.uint32)
        out[i, 2] = np.count_nonzero((parts[:, i] != parts[holder, i]).any(axis=1))
    return out


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _device_hashes(leaves: list[jax.Array], mesh: Mesh, kv: tuple, rep: int) -> jax.Array:
    """[mesh.size, leaves, 2]: per device (in ``mesh.devices.flat`` order) the hashes of its blocks."""
    shapes = [tuple(x.shape) for x in leaves]

    def body(*blocks):
        rows = [_block_hash(b, shape, spec, axis, rep)
                for b, shape, (spec, axis) in zip(blocks, shapes, kv, strict=True)]
        return jax.lax.all_gather(jnp.stack(rows), mesh.axis_names)

    specs = tuple(spec for spec, _ in kv)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=PartitionSpec(), check_vma=False)(*leaves)


def _block_hash(block: jax.Array, shape: tuple[int, ...], spec: PartitionSpec, kv_axis: int | None, rep: int
                ) -> jax.Array:
    """Two uint32 sums over ``block`` (one device's part of an array of ``shape``): each element's bits
    mixed with its canonical flat index, bijectively in the bits, so one changed element always shows."""
    if block.dtype.itemsize > 4:
        raise TypeError(f"checksums cover dtypes up to 32 bits, got {block.dtype}")
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[block.dtype.itemsize]
    bits = block if block.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(block, width)
    bits = bits.astype(jnp.uint32)
    index, stride = jnp.zeros(block.shape, jnp.uint32), 1
    entries = tuple(spec) + (None,) * (block.ndim - len(spec))
    for d in reversed(range(block.ndim)):
        coord = jax.lax.broadcasted_iota(jnp.uint32, block.shape, d)
        if entries[d] is not None:
            coord = coord + jax.lax.axis_index(entries[d]).astype(jnp.uint32) * jnp.uint32(block.shape[d])
        size = shape[d]
        if d == kv_axis:
            coord, size = coord // jnp.uint32(rep), size // rep
        index = index + coord * jnp.uint32(stride)
        stride = stride * size % 2**32
    key = _mix(index * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15))
    a, b = _mix(bits ^ key), _mix((bits + key) * jnp.uint32(0xC2B2AE3D))
    zero = jnp.uint32(0)  # one variadic reduce for both sums: half the fusions to compile
    sums = jax.lax.reduce((a, b), (zero, zero), lambda x, y: (x[0] + y[0], x[1] + y[1]), tuple(range(block.ndim)))
    return jnp.stack(sums)


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 in which every input bit reaches every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@functools.lru_cache(maxsize=4096)
def _block_holders(mesh: Mesh, shape: tuple[int, ...], spec: PartitionSpec, kv_axis: int | None, rep: int
                   ) -> np.ndarray:
    """Per device position, the first position holding the same canonical block (replicas, kv copies)."""
    index = NamedSharding(mesh, spec).devices_indices_map(shape)
    first: dict[tuple, int] = {}
    out = []
    for pos, device in enumerate(mesh.devices.flat):
        box = []
        for d, (sl, n) in enumerate(zip(index[device], shape, strict=True)):
            start, stop, _ = sl.indices(n)
            if d == kv_axis:
                assert stop - start == 1, f"a block holds {stop - start} kv copies; checksums expect one per device"
                start, stop = start // rep, start // rep + 1
            box.append((start, stop))
        out.append(first.setdefault(tuple(box), pos))
    return np.asarray(out)


# ------------------------------------------------------------------------------------- DP replicas
def shards_by_device(x: jax.Array) -> dict[jax.Device, jax.Array]:
    """The single-device arrays of ``x``, keyed by device (no copies)."""
    return {s.device: s.data for s in x.addressable_shards}


def view(x_shards: Mapping[jax.Device, jax.Array], shape: tuple[int, ...], sharding: jax.sharding.Sharding,
         devices: Sequence[jax.Device], dtype=None) -> jax.Array:
    """An array with ``sharding`` over ``devices`` made of existing single-device buffers (zero-copy).
    With several processes each holds only its own devices' buffers (``dtype`` is needed where it holds
    none of them)."""
    me = jax.process_index()
    local = [x_shards[d] for d in devices if d.process_index == me]
    return jax.make_array_from_single_device_arrays(shape, sharding, local, dtype=dtype)


@dataclasses.dataclass(eq=False)
class _Split:
    """The whole state a :func:`split_replicas` call split: assembling exactly its units again is free."""

    leaves: list[jax.Array]
    mesh: Mesh
    units: list[EMU]


def assemble_replicas(units: Sequence[EMU]) -> tuple[list[jax.Array], Mesh]:
    """The replicas' buffers as one state on the mesh (dp, pp, tp), without copying: replicated over dp, but
    for an optimizer split over the replicas (``StateSpec.for_dp``), whose leaves are whole here, split over dp
    (the units must then come in block order)."""
    first = units[0]
    split = first.__dict__.get("_split")
    if split is not None and len(split.units) == len(units) and all(
            a is b for a, b in zip(split.units, units, strict=True)):
        return list(split.leaves), split.mesh  # the arrays these units were split from (same buffers)
    for u in units:
        if (u.stage, u.layout, u.spec, u.memory) != (first.stage, first.layout, first.spec, first.memory):
            raise ValueError(f"cannot assemble {u} with {first}: replicas must share stage, layout and memory")
    spec = first.spec
    if spec.shards > 1 and [u.shard for u in units] != list(range(spec.shards)):
        raise ValueError(f"cannot assemble {list(units)}: a state whose optimizer is split over {spec.shards} "
                         f"replicas needs all of them, in block order (got blocks {[u.shard for u in units]})")
    devices = [d for u in units for d in u.devices]
    mesh = make_mesh(devices, first.layout, dp=len(units))
    leaves = []
    whole = spec.global_abstract(first.layout)
    for i, sharding in enumerate(spec.shardings(mesh, first.memory)):
        shards: dict[jax.Device, jax.Array] = {}
        for u in units:
            shards.update(shards_by_device(u.leaves[i]))
        leaves.append(view(shards, whole[i].shape, sharding, devices, whole[i].dtype))
    return leaves, mesh


def split_replicas(leaves: Sequence[jax.Array], mesh: Mesh, stage: ModelStage, spec: StateSpec,
                   memory: str = DEVICE) -> list[EMU]:
    """Inverse of :func:`assemble_replicas`: one EMU per dp index, sharing the buffers (zero-copy). Each
    unit's arrays are made when first read; assembling the same units again returns ``leaves``."""
    layout = Layout(tp=mesh.shape["tp"], pp=mesh.shape["pp"], ep=dict(mesh.shape).get("expert", 1))
    leaves = list(leaves)
    by_device: list[dict] = []
    shapes = [a.shape for a in spec.abstract(layout)]  # one replica's (a block of a split optimizer leaf)
    if spec.shards not in (1, len(mesh.devices)):
        raise ValueError(f"a state whose optimizer is split over {spec.shards} replicas cannot split into "
                         f"{len(mesh.devices)}")

    def views(devices: tuple[jax.Device, ...]) -> list[jax.Array]:
        if not by_device:
            by_device.extend(shards_by_device(x) for x in leaves)
        sub = spec.shardings(make_mesh(devices, layout), memory)
        return [view(s, shape, sh, devices, x.dtype)
                for s, x, shape, sh in zip(by_device, leaves, shapes, sub, strict=True)]

    split = _Split(leaves, mesh, [])
    for i, row in enumerate(mesh.devices):
        devices = tuple(row.reshape(-1))
        unit = EMU.__new__(EMU)
        unit.__dict__.update(stage=stage, layout=layout, devices=devices, spec=spec, memory=memory,
                             shard=i if spec.shards > 1 else 0, _lazy=functools.partial(views, devices), _split=split)
        split.units.append(unit)
    return list(split.units)


# ------------------------------------------------------------------------------- a split optimizer
def regroup_optimizer(units: Sequence[EMU], spec: StateSpec) -> list[EMU]:
    """The same replicas with the optimizer state held as ``spec`` says: whole on every replica (gather:
    an all-gather over dp), or split into blocks over them (scatter: each keeps its own block, no
    communication). ``units``: all replicas of one model-stage, on device, in replica (block) order; ``spec``:
    their spec's ``whole`` form or its ``for_dp(len(units))``. The parameters are not copied: the new units
    hold the same buffers, and only the old optimizer leaves may be deleted afterwards."""
    first = units[0]
    assert first.memory == DEVICE, "regroup the optimizer of units in device memory"
    leaves, mesh = assemble_replicas(units)
    n = spec.n_params
    opt = leaves[n:]
    moved = _regroup(tuple(x.sharding for x in opt), tuple(spec.shardings(mesh)[n:]))(opt)
    return split_replicas(leaves[:n] + list(moved), mesh, first.stage, spec)


@functools.lru_cache(maxsize=256)
def _regroup(sources: tuple, targets: tuple) -> Any:
    """Each leaf moved from ``sources`` to ``targets`` by copies and collectives only, keeping every bit
    (``spec.move_bits``)."""
    def move(leaves):
        return [move_bits(x, None, 1, 1, a, b) for x, a, b in zip(leaves, sources, targets, strict=True)]

    return jax.jit(move, out_shardings=list(targets))


def _assembled_on_device(units: Sequence[EMU]):
    """The replicas' blocks (brought to device memory where parked) as one whole state on their joint mesh."""
    on_device = [u if u.memory == DEVICE else dataclasses.replace(
        u, leaves=jax.device_put(u.leaves, u.spec.shardings(u.mesh, DEVICE)), memory=DEVICE) for u in units]
    return assemble_replicas(on_device)


def stage_checksum(units: Sequence[EMU]) -> np.ndarray:
    """:meth:`EMU.checksum` of a model-stage's state: one replica's, or, where the optimizer is split over the
    replicas, that of all of them together (the same value the whole state has on one replica)."""
    first = units[0]
    if first.spec.shards == 1:
        return first.checksum()
    leaves, mesh = _assembled_on_device(units)
    return leaves_checksum(leaves, mesh, first.spec.global_leaves, first.spec.repeat(first.layout))


def stage_to_host(units: Sequence[EMU]) -> dict[str, Any]:
    """:meth:`EMU.to_host` of a model-stage's whole state (the optimizer gathered where it is split over the
    replicas): canonical numpy, bit for bit."""
    first = units[0]
    if first.spec.shards == 1:
        return first.to_host()
    leaves, _ = _assembled_on_device(units)
    spec = first.spec
    return spec.unflatten(spec.whole.collapse([to_numpy(x) for x in leaves], spec.repeat(first.layout)))
