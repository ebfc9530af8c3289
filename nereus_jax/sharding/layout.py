"""Layouts, meshes from device lists, and laying a model's state out for a layout.

A replica of a model-stage has a ``Layout(tp, pp)`` and lives on ``Mesh(devices.reshape(pp, tp),
("pp", "tp"))``; ``dp`` replicas run as one SPMD program on ``Mesh(devices.reshape(dp, pp, tp),
("dp", "pp", "tp"))``. A mixture-of-experts layout with ep > 1 has an ``expert`` axis between pp and tp:
``Mesh(devices.reshape(pp, ep, tp), ("pp", "expert", "tp"))`` (and dp in front); with ep = 1 the mesh has no
``expert`` axis at all, so dense layouts are exactly as before. Dimensions a layout cannot divide are rejected
with :class:`LayoutError`.

One explicit exception, as serving engines do: when tp exceeds the number of kv heads, each kv head is
stored ``tp // num_kv_heads`` times (tp must be a multiple), so every tp rank holds one kv head. The
copies are real arrays, so memory accounting counts them; :func:`gather_params` drops them again.

Example::

    layout = Layout(tp=2)
    mesh = make_mesh(jax.devices()[:4], layout, dp=2)
    sharded = shard_params(params, cfg, layout, mesh, kind="train")
    host = gather_params(sharded, cfg)      # bit-exact numpy copy of ``params``
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nereus_jax.config import ModelConfig
from nereus_jax.layout import Layout, LayoutError
from nereus_jax.models.decoder import abstract_params, param_axes
from nereus_jax.models.layers import activation_constraints
from nereus_jax.sharding.experts import expert_parallel_layer
from nereus_jax.sharding.rules import rules_for

# parameter name -> its kv_heads axis (LoRA's B of k/v_proj: [layers, rank, kv_heads, head_dim])
_KV_PARAMS = {"wk": 2, "wv": 2, "bk": 1, "bv": 1, "wk_lora_b": 2, "wv_lora_b": 2}

_POSITIONS: dict[jax.Device, int] = {}


def device_index(device: jax.Device) -> int:
    """The device's position in ``jax.devices()``: the id execution plans use. ``Device.id`` is not that:
    with several processes it is not dense (a second CPU process's devices start at 2048)."""
    try:
        return _POSITIONS[device]
    except KeyError:
        _POSITIONS.clear()
        _POSITIONS.update({d: i for i, d in enumerate(jax.devices())})
        if device not in _POSITIONS:
            raise ValueError(f"{device} is not one of jax.devices()") from None
        return _POSITIONS[device]


def device_at(index: int) -> jax.Device:
    """Inverse of :func:`device_index`."""
    return jax.devices()[index]


def is_local(device: jax.Device) -> bool:
    """True for a device this process can address (always, with one process)."""
    return device.process_index == jax.process_index()


def to_numpy(x) -> np.ndarray:
    """A (possibly global) array as numpy, the same on every process. With several processes this is a
    collective whatever the array (every process must call it, in the same order): the processes holding
    its shards broadcast them, so a process holding none of it gets it too."""
    return tree_to_numpy([x])[0]


def tree_to_numpy(tree):
    """:func:`to_numpy` of every leaf of a pytree at once: one transfer with one process; with several, one
    broadcast per process holding any of the arrays (not one per array). A collective, like ``to_numpy``."""
    leaves, treedef = jax.tree.flatten(tree)
    if jax.process_count() == 1:
        return treedef.unflatten([np.asarray(v) for v in jax.device_get(leaves)])
    from jax.experimental import multihost_utils

    me = jax.process_index()
    arrays = {i: x for i, x in enumerate(leaves) if isinstance(x, jax.Array)}
    out = [np.asarray(x) if i not in arrays else np.zeros(x.shape, x.dtype) for i, x in enumerate(leaves)]
    have = {i: np.zeros(x.shape, bool) for i, x in arrays.items()}
    owners = {i: {d.process_index for d in x.sharding.device_set} for i, x in arrays.items()}
    for p in sorted(set().union(*owners.values())):  # each holder's shards in turn (shapes are known everywhere)
        held = [i for i in arrays if p in owners[i] and not have[i].all()]
        if not held:
            continue
        parts = [np.zeros(arrays[i].shape, arrays[i].dtype) for i in held]
        masks = [np.zeros(arrays[i].shape, np.uint8) for i in held]
        if me == p:
            for i, part, mask in zip(held, parts, masks, strict=True):
                for shard in arrays[i].addressable_shards:
                    part[shard.index], mask[shard.index] = np.asarray(shard.data), 1
        parts, masks = multihost_utils.broadcast_one_to_all((parts, masks), is_source=me == p)
        for i, part, mask in zip(held, parts, masks, strict=True):
            mask = np.asarray(mask) > 0
            out[i], have[i] = np.where(mask, np.asarray(part), out[i]), have[i] | mask
    return treedef.unflatten(out)


def make_mesh(devices: Sequence[jax.Device], layout: Layout, dp: int | None = None) -> Mesh:
    """A mesh over ``devices`` (in order): ("pp", "tp") for one replica, ("dp", "pp", "tp") with ``dp``; with
    ep > 1 an "expert" axis between pp and tp (tensor ranks stay adjacent devices, the fastest links)."""
    devices = list(devices)
    want = layout.size * (dp or 1)
    if len(devices) != want:
        raise LayoutError(f"{layout} x dp={dp or 1} needs {want} devices, got {len(devices)}")
    if len(set(devices)) != len(devices):
        raise LayoutError(f"device list has duplicates: {[device_index(d) for d in devices]}")
    arr = np.array(devices, dtype=object)
    names = replica_axes(layout)
    shape = tuple(layout_sizes(layout)[a] for a in names)
    if dp is None:
        return Mesh(arr.reshape(shape), names)
    return Mesh(arr.reshape(dp, *shape), ("dp", *names))


def replica_axes(layout: Layout) -> tuple[str, ...]:
    """The mesh axes of one replica of ``layout``: ("pp", "tp"), with "expert" between them when ep > 1."""
    return ("pp", "expert", "tp") if layout.ep > 1 else ("pp", "tp")


def layout_sizes(layout: Layout) -> dict[str, int]:
    """Each replica mesh axis's size under ``layout`` ("expert" included, 1 when the mesh lacks it)."""
    return {"tp": layout.tp, "pp": layout.pp, "expert": layout.ep}


def kv_repeat(cfg: ModelConfig, layout: Layout) -> int:
    """How many copies of each kv head a layout stores (1 unless tp > num_kv_heads)."""
    if layout.tp <= cfg.num_kv_heads:
        return 1
    if layout.tp % cfg.num_kv_heads:
        raise LayoutError(
            f"{layout}: tp={layout.tp} exceeds model.num_kv_heads={cfg.num_kv_heads} and is not a multiple "
            f"of it; choose tp dividing {cfg.num_kv_heads} or a multiple of it")
    return layout.tp // cfg.num_kv_heads


def logical_to_spec(axes: Sequence[str | None], kind: str, mesh_axes: Sequence[str]) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec through a stage kind's rules table."""
    rules = rules_for(kind)
    out = []
    for name in axes:
        mesh_axis = rules.get(name) if name is not None else None
        out.append(mesh_axis if mesh_axis in mesh_axes else None)
    return PartitionSpec(*out)


def stored_shapes(cfg: ModelConfig, layout: Layout, *, head: str = "lm", num_labels: int = 1) -> dict:
    """Parameter shapes as a layout stores them (kv heads repeated where tp > num_kv_heads)."""
    rep = kv_repeat(cfg, layout)
    shapes = jax.tree.map(lambda s: s.shape, abstract_params(cfg, head=head, num_labels=num_labels))
    for name, axis in _KV_PARAMS.items():
        if name in shapes["layers"]["attn"]:
            s = list(shapes["layers"]["attn"][name])
            s[axis] *= rep
            shapes["layers"]["attn"][name] = tuple(s)
    return shapes


def check_layout(cfg: ModelConfig, layout: Layout, *, kind: str = "train", head: str = "lm",
                 num_labels: int = 1) -> None:
    """Raises LayoutError naming the parameter and dimension a layout cannot divide."""
    if layout.ep > 1 and not cfg.num_experts:
        raise LayoutError(f"{layout}: expert parallelism (ep={layout.ep}) needs a mixture-of-experts model "
                          f"(model.family={cfg.family} has no experts); use ep=1")
    if layout.ep > 1 and layout.pp > 1:
        # the expert layer's shard_map nested in a pipeline stage's (manual over pp) fails to lower under
        # autodiff on jax 0.12 (its residuals name the parent's manual axis); see sharding/experts.py
        raise LayoutError(f"{layout}: expert parallelism with pipeline parallelism is not supported; use pp=1 "
                          f"with ep={layout.ep}, or ep=1 with pp={layout.pp}")
    shapes = stored_shapes(cfg, layout, head=head, num_labels=num_labels)
    axes = param_axes(cfg, head=head, num_labels=num_labels)
    sizes = layout_sizes(layout)
    for path, shape in _flatten(shapes):
        spec = logical_to_spec(_lookup(axes, path), kind, replica_axes(layout))
        for dim, (n, mesh_axis) in enumerate(zip(shape, spec, strict=True)):
            if mesh_axis is not None and n % sizes[mesh_axis]:
                logical = _lookup(axes, path)[dim]
                key = "ep" if mesh_axis == "expert" else mesh_axis
                raise LayoutError(
                    f"{layout} cannot split parameter {'/'.join(path)} dimension {dim} ('{logical}', size {n}) "
                    f"over {key}={sizes[mesh_axis]}; choose {key} dividing {n}")


def param_shardings(cfg: ModelConfig, layout: Layout, mesh: Mesh, *, kind: str = "train", head: str = "lm",
                    num_labels: int = 1) -> dict:
    """NamedShardings for every parameter of a model laid out with ``layout`` on ``mesh``."""
    check_layout(cfg, layout, kind=kind, head=head, num_labels=num_labels)
    axes = param_axes(cfg, head=head, num_labels=num_labels)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    return jax.tree.map(lambda a: NamedSharding(mesh, logical_to_spec(a, kind, mesh.axis_names)), axes,
                        is_leaf=is_axes)


def expand_kv(params: dict, rep: int) -> dict:
    """Stores each kv head ``rep`` times, consecutively (query head h then uses copy h // (heads/tp))."""
    return _map_kv(params, lambda x, axis: np.repeat(x, rep, axis=axis) if rep > 1 else x)


def collapse_kv(params: dict, rep: int) -> dict:
    """Inverse of :func:`expand_kv`: keeps the first copy of each kv head."""
    return _map_kv(params, lambda x, axis: np.take(x, np.arange(0, x.shape[axis], rep), axis=axis) if rep > 1 else x)


def shard_params(params: Mapping, cfg: ModelConfig, layout: Layout, mesh: Mesh, *, kind: str = "train") -> dict:
    """Lays a canonical parameter tree out for ``layout`` on ``mesh`` (a device_put; inputs untouched)."""
    head, labels = _head_of(params)
    shardings = param_shardings(cfg, layout, mesh, kind=kind, head=head, num_labels=labels)
    rep = kv_repeat(cfg, layout)
    if rep > 1:
        params = expand_kv(jax.tree.map(np.asarray, dict(params)), rep)
    return jax.device_put(dict(params), shardings)


def gather_params(params: Mapping, cfg: ModelConfig) -> dict:
    """A host (numpy) copy of laid-out parameters in canonical form: bit-exact, kv copies dropped."""
    host = jax.tree.map(np.asarray, dict(params))
    stored_kv = host["layers"]["attn"]["wk"].shape[2]
    return collapse_kv(host, stored_kv // cfg.num_kv_heads)


def sync_kv_grads(grads: dict, cfg: ModelConfig) -> dict:
    """Gradients of a layout with repeated kv heads: every copy gets the sum over its copies (the true
    gradient of the shared head), so optimizer updates keep the copies identical. Traceable under jit."""
    rep = stored_kv_repeat(grads, cfg)
    if rep == 1:
        return grads

    def fn(x, axis):
        shape = x.shape[:axis] + (cfg.num_kv_heads, rep) + x.shape[axis + 1:]
        summed = jnp.sum(jnp.reshape(x, shape), axis=axis + 1, keepdims=True)
        return jnp.reshape(jnp.broadcast_to(summed, shape), x.shape)

    return _map_kv(grads, fn)


def stored_kv_repeat(tree: Mapping, cfg: ModelConfig) -> int:
    """How many copies of each kv head a (possibly pruned: LoRA's trainable leaves) parameter tree stores;
    1 when it holds no kv-head leaf."""
    attn = tree.get("layers", {}).get("attn", {})
    for name, axis in _KV_PARAMS.items():
        if name in attn:
            return attn[name].shape[axis] // cfg.num_kv_heads
    return 1


def bytes_per_device(tree) -> dict[int, int]:
    """Bytes each device holds for a tree of sharded arrays (from shardings; replicas counted per device)."""
    out: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        shard_bytes = math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        for device in x.sharding.device_set:
            i = device_index(device)
            out[i] = out.get(i, 0) + shard_bytes
    return out


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, kind: str = "train") -> Iterator[None]:
    """While tracing inside this context, the model's logical activation annotations become sharding
    constraints on ``mesh`` through ``kind``'s rules table, and a mesh with an ``expert`` axis runs the routed
    experts expert-parallel (:mod:`nereus_jax.sharding.experts`)."""
    def fn(x, axes):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, kind, mesh.axis_names)))

    with activation_constraints(fn), expert_parallel_layer(mesh):
        yield


def _head_of(params: Mapping) -> tuple[str, int]:
    if "value_head" in params:
        return "value", int(params["value_head"]["kernel"].shape[1])
    return "lm", 1


def _map_kv(params: dict, fn) -> dict:
    attn = dict(params["layers"]["attn"])
    for name, axis in _KV_PARAMS.items():
        if name in attn:
            attn[name] = fn(attn[name], axis)
    layers = {**params["layers"], "attn": attn}
    return {**params, "layers": layers}


def _flatten(tree: Mapping, prefix: tuple = ()) -> Iterator[tuple[tuple[str, ...], tuple]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _lookup(tree: Mapping, path: Sequence[str]):
    for key in path:
        tree = tree[key]
    return tree
