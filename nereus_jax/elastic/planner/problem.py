"""The planning problem: the job's topology (which model-stages a step runs, phase by phase, and which
ride on another's units), the models, the workload, the device pool with its nodes, the cost model and
the usable bytes per device; and every unit model-stage's priced candidates (``Problem.options``), its
riders' calls folded in."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs.candidates import Pricer, StageOptions, fold_riders, price
from nereus_jax.elastic.costs.counts import layout_problem
from nereus_jax.elastic.costs.model import CostModel
from nereus_jax.elastic.costs.stage import StageChoice
from nereus_jax.elastic.topology import SKIPPABLE, Topology
from nereus_jax.elastic.workload import Workload
from nereus_jax.model_stage import split_stage

__all__ = ["SKIPPABLE", "InfeasiblePlanError", "Problem", "check_fixed", "phases_for"]


def check_fixed(problem: Problem, stage: str, c: StageChoice) -> None:
    """A pinned choice must be one the planner could have made (ValueError naming the stage otherwise)."""
    kind, cfg = split_stage(stage)[1], problem.model_for(stage)
    total = problem.workload.generated_sequences if kind == "gen" else problem.workload.sequences
    why = layout_problem(cfg, c.tp, c.pp, c.ep)
    if why is None and problem.hardware.devices_per_node % c.tp:
        why = f"tp={c.tp} does not divide the {problem.hardware.devices_per_node} devices of a node"
    if why is None and kind == "gen" and (c.pp != 1 or c.ep != 1):
        why = "generation runs with pp=1 and ep=1"
    if why is None and c.ep > 1 and problem.topology is not None and not problem.topology.expert_parallel:
        why = "this topology runs every model-stage with ep=1 (Topology.expert_parallel is off)"
    if why is None and c.devices > problem.tp_capacity(c.tp):
        why = f"{c.devices} devices in whole tp={c.tp} groups exceed the pool's {problem.tp_capacity(c.tp)}"
    if why is None and (total % c.dp or (total // c.dp) % c.micro_batch):
        why = f"dp={c.dp} x micro-batch={c.micro_batch} does not split the {total} sequences evenly"
    if why is not None:
        raise ValueError(f"fixed {stage} ({c}): {why}")


class InfeasiblePlanError(ValueError):
    """No plan fits: the message names the model-stage and the bytes per device it is short."""


def phases_for(algorithm: str) -> tuple[tuple[str, ...], ...]:
    """The model-stages of one step, phase by phase (every model-stage its own units)."""
    return Topology.separate(algorithm).phases


@dataclass(frozen=True)
class Problem:
    """Everything a search needs: models per role, the topology, workload, pool, cost model, usable bytes.
    ``phases`` and ``stages`` are the unit model-stages the search places (riders are priced inside their
    host's options)."""

    models: Mapping[str, ModelConfig]
    phases: tuple[tuple[str, ...], ...]
    workload: Workload
    pool: tuple[int, ...]
    cost_model: CostModel
    usable_bytes: float
    fixed: Mapping[str, StageChoice] = field(default_factory=dict)
    allow_concurrency: bool = True
    topology: Topology | None = None  # None: every model-stage of ``phases`` its own units

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(s for phase in self.phases for s in phase)

    @property
    def hardware(self):
        return self.cost_model.hardware

    @property
    def concurrent(self) -> bool:
        """Whether groups of a phase may overlap (never on shared-compute hardware)."""
        return self.allow_concurrency and not self.hardware.shared_compute

    def model_for(self, stage: str) -> ModelConfig:
        return self.models[split_stage(stage)[0]]

    @functools.cached_property
    def _tp_capacity(self) -> dict[int, int]:
        node = self.hardware.devices_per_node
        per_node: dict[int, int] = {}
        for d in self.pool:
            per_node[d // node] = per_node.get(d // node, 0) + 1
        return {tp: tp * sum(n // tp for n in per_node.values()) for tp in range(1, node + 1)}

    def tp_capacity(self, tp: int) -> int:
        """Devices usable at tensor degree ``tp``: whole tp groups inside each node of the pool."""
        return self._tp_capacity[tp]

    def options(self, pricer: Pricer | None = None) -> dict[str, StageOptions]:
        """Every unit model-stage's candidates that fit on their own (a fixed stage: just its choice), with
        its riders' calls at the same layout folded in; with the topology's ``batching``, only the calls the
        job makes."""
        pricer = pricer or Pricer(self.cost_model, self.workload)
        topo = self.topology
        batching = topo.batching if topo is not None else None
        out = {}
        for s in self.stages:
            out[s] = self._stage_options(pricer, s, batching)
            riders = topo.riders_of(s) if topo is not None else ()
            if riders:
                out[s] = fold_riders(out[s], [self._stage_options(pricer, r, batching, rider=True) for r in riders],
                                     self.usable_bytes, exact=batching is not None)
        return out

    def _stage_options(self, pricer: Pricer, s: str, batching, rider: bool = False) -> StageOptions:
        cfg = self.model_for(s)
        if s in self.fixed:
            return StageOptions.build(s, [price(cfg, s, self.fixed[s], self.workload, self.cost_model)])
        split = self.topology is None or self.topology.expert_parallel
        if batching is not None:
            return pricer.rule_options(cfg, s, self.tp_capacity, self.usable_bytes, batching, rider=rider,
                                       expert_parallel=split)
        return pricer.options(cfg, s, self.tp_capacity, self.usable_bytes, rider=rider, expert_parallel=split)
