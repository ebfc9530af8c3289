"""The planner: for every model-stage a layout, its replicas, a micro-batch and (training) remat, chosen to
minimise the predicted step latency under per-device memory and the device pool (the Nereus paper, Eq. 1).

Search space. A step runs in phases whose data dependencies are complete (every score needs the rollouts,
every update needs every score): actor-gen -> {actor, ref, reward, critic}-infer -> {actor, critic}-train.
In a phase the model-stages split into groups on disjoint devices that run at the same time; inside a
group they run one after another. Step latency = the critical path of that execution-overlap graph = the
sum over phases of the slowest group. Per model-stage the candidates are those of ``costs.candidates``
(tp inside a node, degrees dividing the model's dimensions, ep dividing a mixture's experts for its scoring
and training, dp and micro-batch dividing the batch, remat).
On shared-compute hardware (cpu) groups never overlap: they would time-slice the same cores.

Memory. Every model-stage's resident state (weights; parameters + Adam for training) stays on its devices
while the others run, and a running model-stage adds its working set. The planner keeps
sum(resident) + max(working) <= (1 - headroom) x capacity: exact for a device that hosts a replica of
every model-stage (device 0 of a colocated plan), an upper bound for every device of every plan.
``PlanResult.memory_per_device_bytes`` reports the exact per-device peak of the placed plan.

Search: branch and bound over per-stage ranges of resident size, stopped once the best plan found is
proven within ``gap`` (2%) of the optimum (``PlanResult.gap`` reports the proven bound; 0 = optimal).
- A node's relaxation lets each model-stage count only the smallest resident state the others can still
  have; it separates, and a dynamic program solves it: per model-stage a latency/devices frontier, per
  group the sum of its members' frontiers, per phase the best split of the pool between groups (a
  threshold search over every partition of the phase into groups), summed over phases.
- A second bound keeps the memory coupling: a multiple-choice knapsack over resident sizes minimising
  device-seconds / pool size, a lower bound of any phase's latency (tight for colocated plans).
- First feasible plans, before any branching: knapsack resident caps for a few working-set reserves
  (every option under the caps fits), and a price on resident bytes (a Lagrangian view) that keeps
  concurrent groups in view.
- A node whose relaxed plan fits is feasible; otherwise the model-stage whose resident state the
  relaxation most underestimated is branched on (below / at-or-above its current size).
``tools/bench_planner.py`` checks the result against a brute-force enumeration of the same space.

    planner = Planner("h200")
    result = planner.plan(resolve_model("llama3.1-8b"), "ppo", Workload.fixed(512, 512, 4096), 64)
    print(result.table())
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs.candidates import StageOptions
from nereus_jax.elastic.costs.model import CostModel
from nereus_jax.elastic.costs.stage import StageChoice
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.elastic.planner.problem import (
    SKIPPABLE,
    InfeasiblePlanError,
    Problem,
    check_fixed,
    phases_for,
)
from nereus_jax.elastic.planner.result import (
    PlanResult,
    critical_path,
    device_memory,
    make_result,
    overlap_edges,
    place,
)
from nereus_jax.elastic.planner.search import (
    GAP,
    MAX_NODES,
    REL_TOL,
    PhaseSolution,
    branch_and_bound,
    memory_need,
    picked,
    restrict,
    set_partitions,
    solve_relaxation,
)
from nereus_jax.elastic.topology import Topology, gen_sizes
from nereus_jax.elastic.workload import Workload
from nereus_jax.model_stage import split_stage

__all__ = [
    "GAP",
    "MAX_NODES",
    "SKIPPABLE",
    "InfeasiblePlanError",
    "PlanResult",
    "Planner",
    "Problem",
    "Topology",
    "branch_and_bound",
    "critical_path",
    "device_memory",
    "diagnose",
    "overlap_edges",
    "phases_for",
    "place",
    "set_partitions",
    "solve_relaxation",
]


class Planner:
    """Chooses execution plans with a cost model (an object or a hardware name)."""

    def __init__(self, cost_model: CostModel | str, headroom: float = 0.1, runners_up: int = 3,
                 gap: float = GAP, max_nodes: int = MAX_NODES):
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {headroom}")
        self.cost_model = CostModel(cost_model) if isinstance(cost_model, str) else cost_model
        self.headroom, self.runners_up, self.gap, self.max_nodes = headroom, runners_up, gap, max_nodes

    def problem(self, models: ModelConfig | Mapping[str, ModelConfig], algorithm: str, workload: Workload,
                devices: int | Sequence[int], *, fixed: Mapping[str, StageChoice] | None = None,
                skip: Sequence[str] = (), topology: Topology | None = None) -> Problem:
        """The search problem: ``models`` is one config for every role or role -> config (actor, critic,
        ref, reward); ``devices`` a pool size (ids 0..n-1) or the live device ids; ``topology`` what the
        job runs (default: every model-stage of ``algorithm`` its own units, ``skip`` left out: reward-infer
        with a verifiable reward, ref-infer without a KL term)."""
        if topology is None:
            topology = Topology.separate(algorithm, skip)
        elif skip:
            raise ValueError("skip: give either a topology or the model-stages to skip, not both")
        names = list(topology.stages)
        roles = sorted({split_stage(s)[0] for s in names})
        if isinstance(models, ModelConfig):
            models = {r: models for r in roles}
        missing = [r for r in roles if r not in models]
        if missing:
            raise ValueError(f"no model config for role(s) {missing} of {algorithm}; give one per role: {roles}")
        pool = tuple(range(devices)) if isinstance(devices, int) else tuple(sorted(set(devices)))
        if not pool:
            raise InfeasiblePlanError("the device pool is empty: no model-stage can run")
        for name in fixed or {}:
            if name not in topology.units:
                raise ValueError(f"fixed: '{name}' is not a model-stage of {algorithm} with its own units: "
                                 f"{list(topology.units)}")
        usable = (1 - self.headroom) * self.cost_model.hardware.memory_bytes
        problem = Problem(dict(models), topology.unit_phases, workload, pool, self.cost_model, usable,
                          dict(fixed or {}), allow_concurrency=topology.concurrent, topology=topology)
        for name, choice in problem.fixed.items():
            check_fixed(problem, name, choice)
        return problem

    def plan(self, models: ModelConfig | Mapping[str, ModelConfig], algorithm: str, workload: Workload,
             devices: int | Sequence[int], *, fixed: Mapping[str, StageChoice] | None = None,
             skip: Sequence[str] = (), topology: Topology | None = None,
             options: Callable[[Problem], Mapping[str, StageOptions]] | None = None) -> PlanResult:
        """The fastest plan (Eq. 1) and runners-up; InfeasiblePlanError names the model-stage and bytes short.
        ``fixed`` pins model-stages to a choice (e.g. keep their current layout: a cheaper transition);
        ``options(problem)``: the options to search (default ``problem.options()``; e.g. re-ranked for risk)."""
        start = time.perf_counter()
        problem = self.problem(models, algorithm, workload, devices, fixed=fixed, skip=skip, topology=topology)
        opts = options(problem) if options else problem.options()
        result = self.solve(problem, opts)
        if result is None and problem.concurrent:  # a pool with holes may not place side-by-side groups
            result = self.solve(dataclasses.replace(problem, allow_concurrency=False), opts)
        if result is None:
            raise InfeasiblePlanError(diagnose(problem))
        ms = (time.perf_counter() - start) * 1e3
        return dataclasses.replace(result, decision_ms=ms)

    def split(self, models: ModelConfig | Mapping[str, ModelConfig], algorithm: str, gen_workload: Workload,
              workload: Workload, devices: Sequence[int], topology: Topology,
              options: Callable[[Problem], Mapping[str, StageOptions]] | None = None) -> list[PlanResult]:
        """Plans with actor-gen on its own devices beside everything else (asynchronous training): for each
        split of the pool (``topology.gen_sizes``), actor-gen planned for ``gen_workload`` on the first
        devices and the rest of the step for ``workload`` on the others; one merged result per split that
        fits, in split order. ``options(problem)``: the options to search (default ``problem.options()``)."""
        gen_topo = dataclasses.replace(topology, phases=topology.phases[:1], rides_on=(), overlapped=False)
        rest_topo = dataclasses.replace(topology, phases=topology.phases[1:], overlapped=False)
        pool = tuple(sorted(devices))
        out = []
        for k in gen_sizes(len(pool), self.cost_model.hardware.devices_per_node):
            sides = []
            for topo, wl, part in ((gen_topo, gen_workload, pool[:k]), (rest_topo, workload, pool[k:])):
                try:
                    problem = self.problem(models, algorithm, wl, part, topology=topo)
                except InfeasiblePlanError:
                    break
                result = self.solve(problem, options(problem) if options else problem.options())
                if result is None:
                    break
                sides.append(result)
            if len(sides) == 2:
                out.append(merge_sides(*sides))
        return out

    def solve(self, problem: Problem, opts: Mapping[str, StageOptions]) -> PlanResult | None:
        """Branch and bound on prepared options; None if nothing feasible can be placed."""
        if any(len(o) == 0 for o in opts.values()):
            return None
        found, gap = branch_and_bound(problem, opts, self.gap, self.max_nodes)
        if not found:
            return None
        result = make_result(problem, opts, found[0][1], gap)
        if result is None:
            return None
        candidates = found[1:] + _alternatives(problem, opts, found[0][1])
        others = _distinct(found[0][1], candidates, self.runners_up)
        if len(others) < self.runners_up:
            others = _distinct(found[0][1], candidates + _other_layouts(problem, opts, found[0][1]), self.runners_up)

        def place_others() -> list[PlanResult]:
            return [r for r in (make_result(problem, opts, sols) for sols in others) if r is not None]

        return dataclasses.replace(result, pending=place_others)


def merge_sides(gen: PlanResult, rest: PlanResult) -> PlanResult:
    """One result of two planned on disjoint devices (actor-gen's and the rest's); the step latency is the
    larger of the two (they run side by side), memory per device the union."""
    return dataclasses.replace(
        rest, plan=ExecutionPlan({**gen.plan, **rest.plan}), choices={**gen.choices, **rest.choices},
        stage_latency_s={**gen.stage_latency_s, **rest.stage_latency_s},
        step_latency_s=max(gen.step_latency_s, rest.step_latency_s), groups=gen.groups + rest.groups,
        memory_per_device_bytes={**gen.memory_per_device_bytes, **rest.memory_per_device_bytes},
        memory_bound_bytes=max(gen.memory_bound_bytes, rest.memory_bound_bytes), pending=None)


def _alternatives(problem: Problem, opts, best: list[PhaseSolution]) -> list[tuple[float, list[PhaseSolution]]]:
    """Plans that keep the best plan's options but change one phase's groups (when they fit)."""
    picks = picked(best)
    masks = {s: np.arange(len(o)) == picks[s] for s, o in opts.items()}
    alternatives: list[list[PhaseSolution]] = []
    if solve_relaxation(problem, opts, masks, alternatives) is None:
        return []
    out = []
    for i, alts in enumerate(alternatives):
        for alt in alts:
            if alt.stages != best[i].stages:
                sols = [*best[:i], alt, *best[i + 1:]]
                out.append((sum(p.latency for p in sols), sols))
    return out


def _other_layouts(problem: Problem, opts, best: list[PhaseSolution]) -> list[tuple[float, list[PhaseSolution]]]:
    """For each model-stage, the best plan that fits when that model-stage must leave its (tp, pp, ep)."""
    picks = picked(best)
    lo = {s: 0.0 for s in opts}
    hi = {s: math.inf for s in opts}
    masks, _ = restrict(problem, opts, lo, hi)
    out = []
    for stage, i in picks.items():
        o = opts[stage]
        other = masks[stage] & ((o.raw[:, 0] != o.raw[i, 0]) | (o.raw[:, 1] != o.raw[i, 1])
                                | (o.table[:, 5] != o.table[i, 5]))
        if not other.any():
            continue
        capped = {s: (m if s != stage else other) for s, m in masks.items()}
        caps = {s: float(opts[s].resident[picks[s]]) for s in opts}  # keep the others' memory where it was
        capped = {s: m & (opts[s].resident <= caps[s]) if s != stage else m for s, m in capped.items()}
        sols = solve_relaxation(problem, opts, capped)
        if sols is not None and memory_need(opts, picked(sols)) <= problem.usable_bytes * (1 + REL_TOL):
            out.append((sum(p.latency for p in sols), sols))
    return out


def _distinct(best, others, limit: int) -> list[list[PhaseSolution]]:
    """The fastest ``limit`` solutions that differ from ``best`` and each other (options or groups)."""
    def key(sols):
        return tuple(sorted(picked(sols).items())), tuple(sol.stages for sol in sols)

    seen, out = {key(best)}, []
    for _, sols in sorted(others, key=lambda f: f[0]):
        if key(sols) not in seen and len(out) < limit:
            seen.add(key(sols))
            out.append(sols)
    return out


def diagnose(problem: Problem) -> str:
    """Why nothing fits: the first model-stage short on its own, else the whole plan's shortfall."""
    usable, gib = problem.usable_bytes, 2**30
    where = f"{len(problem.pool)} {problem.hardware.name} device(s) with {usable / gib:.2f} GiB usable each"
    relaxed = dataclasses.replace(problem, usable_bytes=math.inf)
    everything = relaxed.options()
    for stage, o in everything.items():
        if not len(o):
            return (f"model-stage {stage}: no layout of its model fits {where} (tp must divide the node size and the "
                    "model's heads, mlp and vocab; pp its layers; the pool must hold whole tp groups)")
        need = o.resident + o.working
        if need.min() > usable:
            i = int(np.argmin(need))
            short = float(need[i]) - usable
            return (f"model-stage {stage} does not fit {where}: its smallest layout ({o.choice(i)}) needs "
                    f"{need[i] / gib:.2f} GiB per device, {short / gib:.2f} GiB ({short:.0f} bytes) short; add "
                    "devices, use hardware with more memory, or shorten the sequences / batch")
    resident = {s: float(o.resident.min()) for s, o in everything.items()}
    need = sum(resident.values()) + max(float(o.working.min()) for o in everything.values())
    worst = max(resident, key=resident.get)
    short = max(need - usable, 0.0)
    return (f"no combination of layouts fits {where}: every model-stage's resident state at its smallest plus the "
            f"unavoidable working set needs at least {need / gib:.2f} GiB per device ({short / gib:.2f} GiB, "
            f"{short:.0f} bytes short); the largest share is model-stage {worst} ({resident[worst] / gib:.2f} GiB); "
            "add devices or use hardware with more memory")
