"""Where a model-stage's first state comes from, read straight into a unit's shardings.

A *parameter source* answers one question: the values of a slice of one parameter of the canonical tree
(kv heads stored once), ``source.read(path, index, dtype) -> np.ndarray``. A Hugging Face checkpoint
(:class:`nereus_jax.models.hf.HFCheckpoint`) answers it from the safetensors files, reading only the
bytes of that slice; :class:`HostSource` answers it from a numpy tree (a warm start, tests). Each device
of a new unit asks for exactly its own shard (``jax.make_array_from_callback``), so laying a model out
never holds a whole extra host copy of it; the optimizer state of a training stage is initialised on the
devices. Further replicas of a stage copy the first one device to device.

    units = units_from_source(ACTOR_TRAIN, spec, Layout(tp=2), replicas, HFCheckpoint(path))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from nereus_jax.model_stage import ModelStage
from nereus_jax.models.lora import split_trainable
from nereus_jax.sharding import Layout, make_mesh

from .emu import EMU, assemble_replicas, split_replicas
from .plan import DEVICE
from .spec import Leaf, StateSpec

Path = tuple[str, ...]


class ParamSource(Protocol):
    """The canonical parameter tree, readable slice by slice."""

    def read(self, path: Path, index: tuple[slice, ...] | None = None, dtype: Any = None) -> np.ndarray: ...


class HostSource:
    """A canonical numpy (or any array) tree as a source."""

    def __init__(self, tree: Mapping[str, Any]):
        self.tree = tree

    def read(self, path: Path, index: tuple[slice, ...] | None = None, dtype: Any = None) -> np.ndarray:
        x = self.tree
        for key in path:
            x = x[key]
        x = np.asarray(x) if index is None else np.asarray(x[index])
        return x if dtype is None else x.astype(dtype)


class ValueHeadSource:
    """A critic that starts from a language model's trunk: every parameter from ``trunk`` but the value
    head, which is zero (values start at 0)."""

    def __init__(self, trunk: ParamSource, hidden_size: int, num_labels: int = 1):
        self.trunk, self.shape = trunk, (hidden_size, num_labels)

    def read(self, path: Path, index: tuple[slice, ...] | None = None, dtype: Any = None) -> np.ndarray:
        if path[0] != "value_head":
            return self.trunk.read(path, index, dtype)
        zeros = np.zeros(self.shape, dtype or np.float32)
        return zeros if index is None else zeros[index]


class ZeroSource:
    """All-zero parameters of the given canonical shapes (a job about to restore a checkpoint)."""

    def __init__(self, shapes: Mapping[str, Any]):
        self.shapes = shapes

    def read(self, path: Path, index: tuple[slice, ...] | None = None, dtype: Any = None) -> np.ndarray:
        shape = self.shapes
        for key in path:
            shape = shape[key]
        shape = tuple(getattr(shape, "shape", shape))
        if index is not None:
            shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
        return np.zeros(shape, dtype or np.float32)


def param_paths(spec: StateSpec) -> list[Path]:
    """The tree path of every parameter leaf of ``spec``, in its leaf order."""
    tree = jax.tree.unflatten(spec.params_def, list(range(spec.n_params)))
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [tuple(k.key for k in keys) for keys, _ in flat]


def read_stored(source: ParamSource, path: Path, leaf: Leaf, rep: int, index: tuple[slice, ...]) -> np.ndarray:
    """The slice ``index`` of a leaf as a layout stores it (each kv head ``rep`` times) in ``leaf.dtype``."""
    shape = leaf.stored_shape(rep)
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
    canonical = [slice(a, b) for a, b in bounds]
    axis = leaf.kv_axis if rep > 1 else None
    if axis is not None:
        a, b = bounds[axis]
        canonical[axis] = slice(a // rep, (b - 1) // rep + 1) if b > a else slice(a // rep, a // rep)
    x = source.read(path, tuple(canonical), leaf.dtype)
    if axis is not None:
        a, b = bounds[axis]
        offset = canonical[axis].start * rep
        x = np.take(np.repeat(x, rep, axis=axis), np.arange(a - offset, b - offset), axis=axis)
    return np.ascontiguousarray(x, dtype=leaf.dtype)


def unit_from_source(stage: ModelStage, spec: StateSpec, layout: Layout, devices: Sequence[jax.Device],
                     source: ParamSource) -> EMU:
    """One replica laid out on ``devices``: every device reads its own shard of each parameter from
    ``source``; a training stage's optimizer state is initialised on the devices."""
    spec.check(layout)
    devices = tuple(devices)
    mesh = make_mesh(devices, layout)
    shardings = spec.shardings(mesh)
    rep = spec.repeat(layout)
    params = []
    for leaf, path, sharding in zip(spec.leaves, param_paths(spec), shardings, strict=False):
        def callback(index, leaf=leaf, path=path):
            return read_stored(source, path, leaf, rep, index)

        # dtype: a process holding none of a replica's devices makes its (empty) part without a callback
        params.append(jax.make_array_from_callback(leaf.stored_shape(rep), sharding, callback, dtype=leaf.dtype))
    leaves = params
    if spec.opt_def is not None:
        leaves = params + _init_optimizer(spec, shardings)(params)
    return EMU(stage, layout, devices, leaves, spec, DEVICE)


def units_from_source(stage: ModelStage, spec: StateSpec, layout: Layout,
                      replicas: Sequence[Sequence[jax.Device]], source: ParamSource) -> list[EMU]:
    """Every replica of a model-stage. With one process the first replica is read from ``source`` and the
    others copy it device to device (the same shard layout, so one copy per shard); with several processes
    each replica reads its own shards (a process reads only the shards on its own devices)."""
    if spec.shards > 1:
        return _units_with_split_optimizer(stage, spec, layout, replicas, source)
    first = unit_from_source(stage, spec, layout, replicas[0], source)
    units = [first]
    for devices in replicas[1:]:
        if jax.process_count() > 1:
            units.append(unit_from_source(stage, spec, layout, devices, source))
            continue
        mesh = make_mesh(tuple(devices), layout)
        leaves = jax.device_put(first.leaves, spec.shardings(mesh))
        units.append(EMU(stage, layout, tuple(devices), list(leaves), spec, DEVICE))
    return units


def _units_with_split_optimizer(stage: ModelStage, spec: StateSpec, layout: Layout,
                                replicas: Sequence[Sequence[jax.Device]], source: ParamSource) -> list[EMU]:
    """Replicas whose optimizer state is split over them (``spec = StateSpec.for_dp(len(replicas))``): the
    parameters as :func:`units_from_source` lays them out, the optimizer state initialised on the replicas'
    SPMD mesh straight into its blocks (no device ever holds the whole of it)."""
    params_only = StateSpec(spec.model, spec.kind, head=spec.head, num_labels=spec.num_labels, dtype=spec.dtype)
    units = units_from_source(stage, params_only, layout, replicas, source)
    leaves, mesh = assemble_replicas(units)
    opt = _init_optimizer(spec, spec.shardings(mesh))(leaves)
    return split_replicas(list(leaves) + list(opt), mesh, stage, spec)


def _init_optimizer(spec: StateSpec, shardings: Sequence[Any]):
    n = spec.n_params
    out = list(shardings[n:])

    def init(params: list) -> list:
        tree = jax.tree.unflatten(spec.params_def, params)
        return jax.tree.leaves(spec.optimizer.init(split_trainable(tree, spec.model)[0]))

    return jax.jit(init, out_shardings=out)
