"""One copy of LoRA's frozen base per replica: model-stages that hold it identically share its buffers.

With LoRA (``model.lora_rank``) training never writes the base parameters, and every stage that starts from the
actor's parameters (actor-train, actor-gen, actor-infer, ref-infer: ``StageDecl.state`` "actor" / "base") holds
the same base, as does a critic whose trunk is the actor's. Where two such units hold a base leaf identically
(the same ordered devices, layout, partition, dtype and shape, in device memory) one array serves both:
:func:`share_frozen` points the later unit's leaf at the first one's, so the duplicate's buffers go when nothing
refers to them any more. JAX arrays are immutable, so sharing is safe as long as no program donates a shared
buffer and nothing deletes one that another unit still holds: the training program does not donate frozen
leaves (``runtime/step/stages.py``), and the transition executor deletes a buffer only when no other live unit,
and nothing the caller names in ``keep``, holds it (:meth:`~nereus_jax.elastic.executor.TransitionExecutor.run`).

    units = share_frozen(units, share_groups(cfg.model, critic_from_actor=True))
    held_buffers(units[REF_INFER])           # {(device, pointer), ...}: the same as actor-train's base
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax

from nereus_jax.model_stage import ModelStage, stage_decl
from nereus_jax.models.lora import is_trainable

from .emu import EMU
from .plan import DEVICE
from .spec import StateSpec


def share_groups(stages: Iterable[ModelStage], lora: bool, critic_from_actor: bool) -> dict[ModelStage, str]:
    """Model-stage -> the group of stages that hold one frozen base ({} without LoRA): the actor's base for
    stages that start from the actor's parameters, and for the critic's when its trunk is the actor's
    (``critic_from_actor``: no ``model.critic_hf_path``); a critic from its own checkpoint shares only with the
    other critic stage. A reward model (its own checkpoint, no adapters) shares nothing."""
    if not lora:
        return {}
    out = {}
    for ms in stages:
        state = stage_decl(str(ms)).state
        if state in ("actor", "base"):
            out[ms] = "actor"
        elif state == "critic":
            out[ms] = "actor" if critic_from_actor else "critic"
    return out


@functools.lru_cache(maxsize=64)
def frozen_leaves(spec: StateSpec) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """(leaf index, parameter path) of every frozen parameter leaf of ``spec``: with adapters, the leaves
    training does not update; a spec without adapters (the reference: the base alone) is all base."""
    index = jax.tree.unflatten(spec.params_def, list(range(spec.n_params)))
    out = []
    for path, i in jax.tree_util.tree_flatten_with_path(index)[0]:
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        if not spec.model.lora_rank or not is_trainable(keys, spec.model):
            out.append((i, keys))
    return tuple(out)


def base_keys(group: str, devices: tuple[int, ...], layout, spec: StateSpec) -> list[tuple[int, tuple]]:
    """(leaf index, key) of each frozen leaf a unit of share group ``group`` holds on ``devices`` (ids, in order)
    under ``layout``; keys are equal exactly for units that hold the leaf alike (path, place, partition, dtype,
    stored shape), i.e. could hold one array."""
    rep = spec.repeat(layout)
    return [(i, (group, path, devices, layout, spec.leaves[i].spec, spec.leaves[i].dtype,
                 spec.leaves[i].stored_shape(rep)))
            for i, path in frozen_leaves(spec)]


def share_frozen(units: Mapping[ModelStage, Any], groups: Mapping[ModelStage, str]) -> dict[ModelStage, Any]:
    """``units`` with every frozen leaf that an earlier unit (in ``units``' order) of the same group holds
    identically replaced by that unit's array (new EMUs; the others, and anything not a list of device-memory
    EMUs, e.g. a move's placeholder or a parked stage, as given). The first holder's array stays."""
    first: dict[tuple, jax.Array] = {}
    out: dict[ModelStage, Any] = {}
    for ms, us in units.items():
        group = groups.get(ms)
        if group is None or not isinstance(us, list):
            out[ms] = us
            continue
        new = []
        for u in us:
            if u.memory != DEVICE:
                new.append(u)
                continue
            leaves: list[jax.Array] | None = None
            for i, key in base_keys(group, u.device_ids, u.layout, u.spec):
                x = u.leaves[i]
                held = first.setdefault(key, x)
                if held is not x and array_buffers(held) != array_buffers(x):  # views of one buffer stay
                    leaves = leaves or list(u.leaves)
                    leaves[i] = held
            new.append(u if leaves is None else dataclasses.replace(u, leaves=leaves))
        out[ms] = new
    return out


def held_buffers(units: Iterable[EMU]) -> set[tuple[jax.Device, int]]:
    """The device buffers ``units`` hold, as (device, pointer) pairs (deleted ones left out)."""
    out = set()
    for u in units:
        for x in u.leaves:
            out |= array_buffers(x)
    return out


def array_buffers(x: jax.Array) -> set[tuple[jax.Device, int]]:
    """(device, pointer) of each of ``x``'s local buffers that is not deleted."""
    if x.is_deleted():
        return set()
    return {(s.device, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards if not s.data.is_deleted()}


def unique_bytes(units: Iterable[EMU]) -> dict[int, int]:
    """Bytes per device id that ``units`` hold, each buffer counted once however many units share it."""
    from nereus_jax.sharding import device_index

    seen: set[tuple[jax.Device, int]] = set()
    out: dict[int, int] = {}
    for u in units:
        for x in u.leaves:
            for s in x.addressable_shards:
                if s.data.is_deleted():
                    continue
                key = (s.device, s.data.unsafe_buffer_pointer())
                if key not in seen:
                    seen.add(key)
                    d = device_index(s.device)
                    out[d] = out.get(d, 0) + s.data.nbytes
    return out
