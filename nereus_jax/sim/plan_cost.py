"""Plans as the simulator handles them, and the two things done to every plan: its step latency (the
critical path of the execution-overlap graph, from any per-stage seconds) and the price of moving to it
(the scheduled transition graph, priced by ``elastic.graph.transition_seconds`` with a link-time function).

Both the controller's predictions (cost model) and the ground truth (sim.truth) go through the same
functions here with their own per-stage seconds / link times, so they differ only in their models.

Expert parallelism: the simulator prices a move between (tp, pp, ep) layouts as the transition graph of the
same devices with ep folded into tp (``fold_experts``: a replica's state splits over tp x ep devices either
way, so the bytes each device sends and receives are those of a tp re-split); ranks of such plans are not
re-aligned (the runtime's recipe orders an expert group's ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs import StageChoice, state_bytes
from nereus_jax.elastic.graph import TransitionError, TransitionGraph
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.elastic.planner import PlanResult
from nereus_jax.elastic.recipe import align_ranks
from nereus_jax.elastic.schedule import Infeasible
from nereus_jax.elastic.state_bytes import ByteSpec
from nereus_jax.elastic.topology import Topology, critical_path
from nereus_jax.layout import Layout
from nereus_jax.model_stage import ModelStage, split_stage


@dataclass(frozen=True)
class SimPlan:
    """An execution plan with every priced model-stage's choice (riders too); hashable, compared by choices
    and devices."""

    choices: tuple[tuple[str, StageChoice], ...]  # run order
    plan: ExecutionPlan
    topology: Topology = field(compare=False)
    edges: frozenset[tuple[str, str]] = field(compare=False, repr=False)
    device_set: frozenset[int] = field(compare=False, repr=False, default=frozenset())
    overlapped: bool = False  # async: actor-gen on its own devices, beside scoring + training (no edge to them)

    @classmethod
    def of(cls, result: PlanResult, topology: Topology, overlapped: bool = False) -> SimPlan:
        return cls.build(dict(result.choices), result.plan, topology, overlapped)

    @classmethod
    def build(cls, choices: Mapping[str, StageChoice], plan: ExecutionPlan, topology: Topology,
              overlapped: bool = False) -> SimPlan:
        """``overlapped``: actor-gen gets no edge to the others, so the critical path is max(actor-gen,
        scoring + training): one-step-off async on disjoint devices (``sim.asynchronous``)."""
        placed = topology.placed(plan)
        edges = frozenset(topology.edges(placed, overlapped))
        return cls(tuple((s, choices[s]) for s in topology.stages), plan, topology, edges,
                   frozenset(plan.devices), overlapped)

    @property
    def phases(self) -> tuple[tuple[str, ...], ...]:
        return self.topology.phases

    @property
    def devices(self) -> frozenset[int]:
        return self.device_set

    def choice(self, stage: str) -> StageChoice:
        return dict(self.choices)[stage]

    def layouts(self) -> tuple[tuple[str, int, int, int], ...]:
        """(stage, tp, pp, ep) per model-stage: what "fixed TP/PP" keeps (its ep too)."""
        return tuple((s, c.tp, c.pp, c.ep) for s, c in self.choices)

    def aligned_to(self, current: SimPlan) -> SimPlan:
        """This plan with its replicas' ranks ordered to match ``current`` (less data moves); as it is when
        either splits experts."""
        if expert_parallel(current.plan) or expert_parallel(self.plan):
            return self
        plan = align_ranks(current.plan, self.plan)
        return self if plan == self.plan else SimPlan(self.choices, plan, self.topology, self.edges,
                                                      self.device_set, self.overlapped)

    def latency(self, stage_seconds: Mapping[str, float], sync_s: float = 0.0) -> float:
        """Step latency: the critical path through this plan's overlap graph (+ ``sync_s``, the weight sync
        that closes an async step)."""
        return critical_path(stage_seconds, set(self.edges)) + sync_s

    def describe(self) -> str:
        return ", ".join(f"{s} {c}" for s, c in self.choices)


def state_specs(models: Mapping[str, ModelConfig], stages: Sequence[str]) -> dict[ModelStage, ByteSpec]:
    """A replica's state of each model-stage as bytes (weights; + Adam state for training)."""
    return {ModelStage.parse(s): ByteSpec(int(state_bytes(models[split_stage(s)[0]], s, 1, 1))) for s in stages}


def expert_parallel(plan: ExecutionPlan) -> bool:
    """Whether some model-stage of ``plan`` splits experts (ep > 1)."""
    return any(sp.layout.ep > 1 for sp in plan.values())


def fold_experts(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with every (tp, pp, ep) layout as (tp x ep, pp) on the same devices (``plan`` itself without
    ep > 1): what the simulator builds transition graphs of."""
    if not expert_parallel(plan):
        return plan
    return ExecutionPlan({ms: dataclasses.replace(sp, layout=Layout(sp.layout.tp * sp.layout.ep, sp.layout.pp))
                          for ms, sp in plan.items()})


def build_graph(old: SimPlan, new: SimPlan, specs: Mapping[ModelStage, ByteSpec], cap: int) -> TransitionGraph | None:
    """The scheduled transition graph old -> new (ep folded into tp: :func:`fold_experts`), or None when no live
    transition reaches ``new``."""
    try:
        return TransitionGraph.build(fold_experts(old.plan), fold_experts(new.plan), specs, caps=cap)
    except (Infeasible, TransitionError):
        return None


def changed_stages(old: SimPlan, new: SimPlan) -> dict[str, bool]:
    """Model-stages whose plan changes -> whether their (tp, pp, ep) layout changes."""
    out = {}
    for ms, sp in new.plan.items():
        before = old.plan[ms]
        if sp != before:
            out[str(ms)] = sp.layout != before.layout
    return out
