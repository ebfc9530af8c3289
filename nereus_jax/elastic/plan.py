"""Execution plans: for every model-stage (:class:`nereus_jax.model_stage.ModelStage`) a layout, its replicas'
device sets, and where its state lives.

Pure metadata (device ids, no arrays), so the planner, the simulator and the transition graph can work
on plans for clusters that are not there. A replica is an ordered tuple of device ids: position
``p * tp + t`` holds pipeline rank ``p`` and tensor rank ``t`` (the order of ``make_mesh``).

    plan = ExecutionPlan({
        ModelStage("actor", "train"): StagePlan(Layout(tp=2), ((0, 1), (2, 3))),
        ModelStage("actor", "gen"): StagePlan(Layout(tp=1), ((0,), (1,), (2,), (3,))),
    })
    print(plan)        # a table; plans are hashable and compare by value
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

from nereus_jax.layout import Layout
from nereus_jax.model_stage import ModelStage

DEVICE = "device"
HOST = "pinned_host"
MEMORY_KINDS = (DEVICE, HOST)

DeviceIds = tuple[int, ...]


class PlanError(ValueError):
    """A plan that cannot describe a job: a replica of the wrong size, a device used twice, ..."""


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One model-stage's layout, replicas (dp = their number) and memory kind (``pinned_host`` = parked)."""

    layout: Layout
    replicas: tuple[DeviceIds, ...]
    memory: str = DEVICE

    def __post_init__(self) -> None:
        replicas = tuple(tuple(int(d) for d in r) for r in self.replicas)
        object.__setattr__(self, "replicas", replicas)
        if not replicas:
            raise PlanError("a stage plan needs at least one replica")
        if self.memory not in MEMORY_KINDS:
            raise PlanError(f"memory must be one of {MEMORY_KINDS}, got {self.memory!r}")
        for r in replicas:
            if len(r) != self.layout.size:
                raise PlanError(f"replica {list(r)} has {len(r)} devices; {self.layout} needs {self.layout.size}")
        seen = [d for r in replicas for d in r]
        if len(set(seen)) != len(seen):
            dup = sorted({d for d in seen if seen.count(d) > 1})
            raise PlanError(f"devices {dup} appear in more than one replica of the same model-stage")

    @classmethod
    def contiguous(cls, layout: Layout, dp: int, first: int = 0, memory: str = DEVICE) -> StagePlan:
        """``dp`` replicas on consecutive device ids from ``first``."""
        n = layout.size
        return cls(layout, tuple(tuple(range(first + i * n, first + (i + 1) * n)) for i in range(dp)), memory)

    @property
    def dp(self) -> int:
        return len(self.replicas)

    @property
    def devices(self) -> DeviceIds:
        """Every device of every replica, replica by replica."""
        return tuple(d for r in self.replicas for d in r)

    def describe(self) -> str:
        groups = " ".join("[" + ",".join(map(str, r)) + "]" for r in self.replicas)
        return f"{self.layout} dp={self.dp} {self.memory}: {groups}"


class ExecutionPlan(Mapping[ModelStage, StagePlan]):
    """Model-stage -> StagePlan; immutable, hashable, printable as a table."""

    __slots__ = ("_items", "_map", "_hash")

    def __init__(self, stages: Mapping[ModelStage, StagePlan] | Sequence[tuple[ModelStage, StagePlan]] = ()):
        pairs = stages.items() if isinstance(stages, Mapping) else stages
        items = []
        for ms, sp in pairs:
            ms = ModelStage.parse(ms) if isinstance(ms, str) else ms
            if not isinstance(sp, StagePlan):
                raise PlanError(f"{ms}: expected a StagePlan, got {type(sp).__name__}")
            items.append((ms, sp))
        self._items = tuple(sorted(items, key=lambda kv: (kv[0].rank, kv[0].role)))
        self._map = dict(self._items)
        if len(self._map) != len(self._items):
            raise PlanError("a model-stage appears twice in the plan")
        self._hash = hash(self._items)

    def __getitem__(self, ms: ModelStage) -> StagePlan:
        return self._map[ms]

    def __iter__(self) -> Iterator[ModelStage]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExecutionPlan) and self._items == other._items

    def replace(self, ms: ModelStage, sp: StagePlan) -> ExecutionPlan:
        """A copy with one model-stage's plan changed (or added)."""
        return ExecutionPlan({**self._map, ms: sp})

    @property
    def devices(self) -> DeviceIds:
        """Every device some model-stage uses, sorted."""
        return tuple(sorted({d for sp in self._map.values() for d in sp.devices}))

    def table(self) -> str:
        """One row per model-stage: layout, dp, memory and replicas' devices."""
        rows = [("model-stage", "layout", "dp", "memory", "replicas")]
        for ms, sp in self._items:
            groups = " ".join("[" + ",".join(map(str, r)) + "]" for r in sp.replicas)
            rows.append((str(ms), str(sp.layout), str(sp.dp), sp.memory, groups))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
                         for r in rows)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        inner = ", ".join(f"{ms}: {sp.describe()}" for ms, sp in self._items)
        return f"ExecutionPlan({inner})"
