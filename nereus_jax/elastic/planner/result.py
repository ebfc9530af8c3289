"""From a search solution to a plan: device sets (placement), the execution-overlap graph and its
critical path, exact peak memory per device, and ``PlanResult``."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nereus_jax.elastic.costs.stage import StageChoice
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.elastic.planner.problem import Problem
from nereus_jax.elastic.planner.search import PhaseSolution, memory_need, picked
from nereus_jax.elastic.topology import critical_path
from nereus_jax.layout import Layout
from nereus_jax.model_stage import ModelStage


def _tp_slots(devices: Sequence[int], tp: int, node: int) -> list[tuple[int, ...]]:
    """Consecutive runs of ``tp`` devices that lie in one node, in device order."""
    first = devices[0] if devices else 0
    if devices and devices[-1] - first == len(devices) - 1 and first % tp == 0 and node % tp == 0:
        return [tuple(range(a, a + tp)) for a in range(first, first + len(devices) - tp + 1, tp)]  # contiguous
    slots, run = [], []
    for d in devices:
        if run and (d // node != run[-1] // node or d != run[-1] + 1):
            run = []
        run.append(d)
        if len(run) == tp:
            slots.append(tuple(run))
            run = []
    return slots


def _stage_plan(devices: Sequence[int], choice: StageChoice, node: int) -> StagePlan | None:
    """dp replicas, each pp x ep consecutive tp groups."""
    slots = _tp_slots(devices, choice.tp, node)
    groups = choice.pp * choice.ep
    if len(slots) < choice.dp * groups:
        return None
    replicas = tuple(tuple(d for slot in slots[r * groups:(r + 1) * groups] for d in slot) for r in range(choice.dp))
    return StagePlan(Layout(choice.tp, choice.pp, choice.ep), replicas)


def place(problem: Problem, opts, sols: Sequence[PhaseSolution]) -> dict[str, StagePlan] | None:
    """Device sets: per phase, groups side by side from the first device (largest tp first, so tp groups
    stay inside nodes), each model-stage on its group's first devices. None if a tp group can't be formed."""
    pool, node = sorted(problem.pool), problem.hardware.devices_per_node
    out: dict[str, StagePlan] = {}
    for sol in sols:
        members = [[opts[s].choice(i) for s, i in zip(names, picks, strict=True)]
                   for names, picks in zip(sol.stages, sol.picks, strict=True)]
        order = sorted(range(len(members)), key=lambda g: (-max(c.tp for c in members[g]), g))
        offset = 0
        for g in order:
            size = max(c.devices for c in members[g])
            devices, offset = pool[offset:offset + size], offset + size
            for stage, choice in zip(sol.stages[g], members[g], strict=True):
                sp = _stage_plan(devices, choice, node)
                if sp is None:
                    return None
                out[stage] = sp
    return out


def overlap_edges(phases: Sequence[Sequence[str]], placed: Mapping[str, StagePlan],
                  order: Sequence[str]) -> set[tuple[str, str]]:
    """Edges of the execution-overlap graph: data dependencies (every model-stage of a phase feeds every
    one of the next) and serialisation of model-stages of a phase that share a device (in ``order``)."""
    edges = {(a, b) for p, q in itertools.pairwise(phases) for a in p for b in q}
    for phase in phases:
        ranked = sorted(phase, key=order.index)
        devices = {s: set(placed[s].devices) for s in ranked}
        for i, a in enumerate(ranked):
            for b in ranked[i + 1:]:
                if devices[a] & devices[b]:
                    edges.add((a, b))
    return edges


def device_memory(placed: Mapping[str, StagePlan], resident: Mapping[str, float],
                  working: Mapping[str, float]) -> dict[int, float]:
    """Exact peak bytes per device: the resident state of every model-stage on it + its largest working set."""
    devices = {stage: np.array(sp.devices, dtype=np.int64) for stage, sp in placed.items()}
    ids = np.unique(np.concatenate(list(devices.values())))
    res, work = np.zeros(len(ids)), np.zeros(len(ids))
    for stage, devs in devices.items():
        idx = np.searchsorted(ids, devs)
        res[idx] += resident[stage]
        work[idx] = np.maximum(work[idx], working[stage])
    return dict(zip(ids.tolist(), (res + work).tolist(), strict=True))


# ------------------------------------------------------------------------------------------ results
@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """A chosen plan, what the cost model predicts for it, and the runners-up (fastest first)."""

    plan: ExecutionPlan
    choices: Mapping[str, StageChoice]
    stage_latency_s: Mapping[str, float]
    step_latency_s: float
    groups: tuple[tuple[tuple[str, ...], ...], ...]  # per phase: groups on disjoint devices, in run order
    memory_per_device_bytes: Mapping[int, float]  # exact peak per device of the placed plan
    memory_bound_bytes: float  # the planner's rule: sum(resident) + max(working)
    usable_bytes: float
    hardware: str
    gap: float = 0.0  # proven bound on (this plan's latency - optimum) / this plan's latency
    decision_ms: float = 0.0
    hosts: Mapping[str, str] = field(default_factory=dict)  # rider -> the model-stage whose units run it
    pending: Callable[[], Sequence[PlanResult]] | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def runners_up(self) -> tuple[PlanResult, ...]:
        """The next-best distinct plans (other group structures, other plans the search met), fastest first.
        The search keeps their solutions; they are placed on device ids on first use."""
        return tuple(self.pending()) if self.pending is not None else ()

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.memory_per_device_bytes.values())

    def table(self) -> str:
        """The plan as a table: per model-stage its choice, devices and predicted seconds."""
        rows = [("model-stage", "tp", "pp", "ep", "dp", "micro-batch", "remat", "devices", "latency s")]
        riders = {h: [r for r, hh in self.hosts.items() if hh == h] for h in set(self.hosts.values())}
        for stage in (r for phase in self.groups for group in phase for s in group for r in [*riders.get(s, []), s]):
            c, devs = self.choices[stage], self.plan[ModelStage.parse(self.hosts.get(stage, stage))].devices
            span = f"{min(devs)}-{max(devs)}" if len(devs) > 1 else str(devs[0])
            rows.append((stage, str(c.tp), str(c.pp), str(c.ep), str(c.dp), str(c.micro_batch),
                         "yes" if c.remat else "no", f"{len(devs)} [{span}]", f"{self.stage_latency_s[stage]:.3f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        order = " -> ".join(" | ".join("+".join(g) for g in phase) for phase in self.groups)
        if self.hosts:
            order += "; " + ", ".join(f"{r} runs on {h}'s units" for r, h in self.hosts.items())
        gib = 2**30
        return "\n".join(lines + [
            f"run order: {order}  ('|': disjoint devices, at the same time; '+': one after another)",
            f"step latency {self.step_latency_s:.3f} s (critical path); peak memory per device "
            f"{self.peak_memory_bytes / gib:.2f} GiB of {self.usable_bytes / gib:.2f} GiB usable ({self.hardware})",
        ])

    def to_json(self) -> dict:
        """Plain data: the plan, per-stage predictions, memory per device, decision time, runners-up."""
        plan = {}
        for ms, sp in self.plan.items():
            c = self.choices[str(ms)]
            plan[str(ms)] = {"tp": c.tp, "pp": c.pp, "ep": c.ep, "dp": c.dp, "micro_batch": c.micro_batch,
                             "remat": c.remat, "replicas": [list(r) for r in sp.replicas]}
        return {
            "plan": plan,
            "groups": [[list(g) for g in phase] for phase in self.groups],
            "step_latency_s": self.step_latency_s,
            "stage_latency_s": dict(self.stage_latency_s),
            "memory_per_device_bytes": {str(d): b for d, b in self.memory_per_device_bytes.items()},
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_bound_bytes": self.memory_bound_bytes,
            "usable_bytes": self.usable_bytes,
            "hardware": self.hardware,
            "optimality_gap": self.gap,
            "decision_ms": self.decision_ms,
            "runners_up": [{"step_latency_s": r.step_latency_s, "choices": {s: str(c) for s, c in r.choices.items()},
                            "groups": [[list(g) for g in phase] for phase in r.groups]} for r in self.runners_up],
        }


def make_result(problem: Problem, opts, sols: Sequence[PhaseSolution], gap: float = 0.0) -> PlanResult | None:
    """Place a solution and price it; None if it cannot be placed (tp groups across a hole in the pool)."""
    placed = place(problem, opts, sols)
    if placed is None:
        return None
    picks = picked(sols)
    latency = {s: float(opts[s].latency[picks[s]]) for s in problem.stages}  # riders folded in
    resident = {s: float(opts[s].resident[picks[s]]) for s in problem.stages}
    working = {s: float(opts[s].working[picks[s]]) for s in problem.stages}
    step = critical_path(latency, overlap_edges(problem.phases, placed, problem.stages))
    plan = ExecutionPlan({ModelStage.parse(s): sp for s, sp in placed.items()})
    choices = {s: opts[s].choice(picks[s]) for s in problem.stages}
    hosts = {}
    for s in problem.stages:
        latency[s] = opts[s].own_latency(picks[s])
        for r in opts[s].riders:
            choices[r.stage], latency[r.stage], hosts[r.stage] = r.choice(picks[s]), float(r.latency[picks[s]]), s
    order = problem.topology.stages if problem.topology is not None else problem.stages
    return PlanResult(plan=plan, choices={s: choices[s] for s in order}, stage_latency_s={s: latency[s] for s in order},
                      step_latency_s=step, groups=tuple(sol.stages for sol in sols),
                      memory_per_device_bytes=device_memory(placed, resident, working),
                      memory_bound_bytes=memory_need(opts, picks), usable_bytes=problem.usable_bytes,
                      hardware=problem.hardware.name, gap=gap, hosts=hosts)
