"""The nodes of a transition graph: symbolic units (a replica's state somewhere) and primitive steps.

Metadata only. A :class:`Unit` is one replica of one model-stage's state with a layout, an ordered device
tuple and a memory kind; a :class:`Step` is one primitive (Split, Merge, Extend, Destroy, Offload, Onload,
Relayout = Split and Merge fused on one device list, or Derive for weight sync) with the bytes it
acquires when it starts and releases when it ends, per ledger key (see ledger.key). :class:`Builder`
creates both and keeps the memory arithmetic in one place, including shards handed over zero-copy: an
Extend whose target puts a shard at the same position on the same device as its source reuses that
buffer, so the target does not acquire it and the source's later release does not free it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nereus_jax.layout import Layout
from nereus_jax.model_stage import ModelStage

from .ledger import key
from .plan import DEVICE, HOST

SPLIT, MERGE, EXTEND, DESTROY = "split", "merge", "extend", "destroy"
OFFLOAD, ONLOAD, DERIVE = "offload", "onload", "derive"
RELAYOUT = "relayout"  # Split and Merge fused: old layout -> new layout on the same device list
# A model-stage whose optimizer state is split over its replicas (ZeRO-1): all replicas' blocks gathered into
# whole state on every replica, and whole state split back into one block per replica. Both read and make
# every replica of the stage at once; the parameters are not copied (the new units hold the same buffers).
GATHER, SCATTER = "gather", "scatter"
REGROUPS = (GATHER, SCATTER)
COPIES = (EXTEND, OFFLOAD, ONLOAD)


@dataclasses.dataclass(eq=False, slots=True)
class Unit:
    """One replica's state at one place (symbolic; the executor binds it to an EMU)."""

    uid: int
    stage: ModelStage
    layout: Layout
    devices: tuple[int, ...]
    memory: str
    nbytes: int  # per device
    spec: Any  # StateSpec / ByteSpec
    creator: int | None = None  # step id; None for units of the old plan
    readers: list[int] = dataclasses.field(default_factory=list)
    freed_by: int | None = None
    handed: dict[int, int] = dataclasses.field(default_factory=dict)  # device -> uid now owning that shard
    shares_from: int | None = None  # uid of the unit whose buffers this one reuses
    onloaded: bool = False  # brought back after an offload inserted by the scheduler

    @property
    def total_bytes(self) -> int:
        return self.nbytes * len(self.devices)

    def owned(self) -> list[int]:
        return [d for d in self.devices if d not in self.handed]

    def label(self) -> str:
        where = "host " if self.memory == HOST else ""
        return f"u{self.uid} {self.layout}@{where}[{','.join(map(str, self.devices))}]"


@dataclasses.dataclass(eq=False, slots=True)
class Step:
    """One primitive. ``acquire`` is counted when it starts, ``release`` when it ends."""

    sid: int
    op: str
    stage: ModelStage
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    frees: tuple[int, ...]
    modes: tuple[str, str] | None = None  # factorization of a Split / Merge / Derive
    deps: set[int] = dataclasses.field(default_factory=set)
    rdeps: set[int] = dataclasses.field(default_factory=set)  # resource edges added by the scheduler
    acquire: dict[int, int] = dataclasses.field(default_factory=dict)
    release: dict[int, int] = dataclasses.field(default_factory=dict)
    net: int = 0  # bytes acquired minus bytes released
    start: float = 0.0
    end: float = 0.0

    def all_deps(self) -> set[int]:
        return self.deps | self.rdeps


def copy_op(src_memory: str, dst_memory: str) -> str:
    if src_memory == dst_memory:
        return EXTEND
    return OFFLOAD if dst_memory == HOST else ONLOAD


class Builder:
    """Creates units and steps, and keeps their memory effects and dependency edges consistent."""

    def __init__(self) -> None:
        self.units: dict[int, Unit] = {}
        self.steps: list[Step] = []

    def unit(self, stage: ModelStage, layout: Layout, devices: tuple[int, ...], memory: str, spec: Any) -> Unit:
        uid = len(self.units)
        u = self.units[uid] = Unit(uid, stage, layout, tuple(devices), memory, spec.bytes_per_device(layout), spec)
        return u

    def add(self, op: str, stage: ModelStage, inputs=(), outputs=(), frees=(), modes=None, deps=()) -> Step:
        sid = len(self.steps)
        dep_set = set(deps)
        for u in inputs:
            u.readers.append(sid)
            if u.creator is not None:
                dep_set.add(u.creator)
        for u in frees:
            assert u.freed_by is None, f"{u.label()} freed twice"
            u.freed_by = sid
            if u.creator is not None:
                dep_set.add(u.creator)
        for u in outputs:
            u.creator = sid
        s = Step(sid, op, stage, tuple([u.uid for u in inputs]), tuple([u.uid for u in outputs]),
                 tuple([u.uid for u in frees]), modes, dep_set)
        self.steps.append(s)
        self.account(s)
        return s

    def copy(self, src: Unit, dst: Unit, *, share: bool) -> Step:
        """Extend / Offload / Onload ``src`` into ``dst`` (same layout); ``share``: reuse buffers that
        already sit at the same position on the same device (``src`` is destroyed later)."""
        if share and src.memory == dst.memory:
            same = [d for d, e in zip(src.devices, dst.devices, strict=True) if d == e and d not in src.handed]
            for d in same:
                src.handed[d] = dst.uid
            if same:
                dst.shares_from = src.uid
        return self.add(copy_op(src.memory, dst.memory), dst.stage, inputs=(src,), outputs=(dst,))

    def destroy(self, u: Unit) -> Step:
        return self.add(DESTROY, u.stage, frees=(u,))

    def account(self, s: Step) -> None:
        """(Re)computes a step's acquire / release from its units."""
        acquire, release, units = {}, {}, self.units
        for uid in s.outputs:
            u = units[uid]
            src = units[u.shares_from] if u.shares_from is not None else None
            devices = u.devices if src is None else [d for d in u.devices if src.handed.get(d) != u.uid]
            _add_bytes(acquire, devices, u.memory, u.nbytes)
        for uid in s.frees:
            u = units[uid]
            _add_bytes(release, u.owned() if u.handed else u.devices, u.memory, u.nbytes)
        if s.op in REGROUPS:  # the parameters stay where they are: only the optimizer state is made and freed
            shared = _param_bytes(units[s.outputs[0]])
            acquire = {k: n - shared for k, n in acquire.items()}
            release = {k: n - shared for k, n in release.items()}
        s.acquire, s.release = acquire, release
        s.net = sum(acquire.values()) - sum(release.values())

    def finish_stage(self, units: list[Unit], finals: list[Unit]) -> None:
        """Destroys every unit of a stage that is neither final nor freed, after its readers; every
        step that frees a unit waits for the unit's readers, and for the release of buffers it shares."""
        final_ids = {u.uid for u in finals}
        for u in units:
            if u.uid not in final_ids and u.freed_by is None:
                self.destroy(u)
        for u in units:
            if u.freed_by is not None:
                freer = self.steps[u.freed_by]
                freer.deps.update(r for r in u.readers if r != freer.sid)
        for u in units:
            if u.shares_from is not None and u.freed_by is not None:
                src = self.units[u.shares_from]
                if src.freed_by is not None:
                    self.steps[u.freed_by].deps.add(src.freed_by)


def _param_bytes(u: Unit) -> int:
    """The parameters' bytes per device of a unit's state (specs without the split: all of it counts)."""
    per_device = getattr(u.spec, "param_bytes_per_device", None)
    return per_device(u.layout) if per_device is not None else 0


def for_dp(spec: Any, dp: int) -> Any:
    """``spec`` as one of ``dp`` replicas holds it (``StateSpec.for_dp``: an optimizer split over them)."""
    split = getattr(spec, "for_dp", None)
    return spec if split is None else split(dp)


def _add_bytes(table: dict[int, int], devices, memory: str, n: int) -> None:
    if not table and memory == DEVICE:  # the common case: one unit, distinct devices
        table.update(dict.fromkeys(devices, n))
        return
    get = table.get
    for d in devices:
        k = d if memory == DEVICE else key(d, memory)
        table[k] = get(k, 0) + n
