"""Asynchronous (one-step-off) RL in the simulator, as ``runtime/async_rl.py`` runs it with max_staleness 1 and
a weight sync after every update: actor-gen on its own devices generates batch g+1 with the weights of
update g-1 while scoring and training consume batch g on the other devices; then the actor's new weights move
to the generator (the weight sync) and the next interval starts.

- Step latency = the interval between weight syncs (the paper's async definition):
  max(actor-gen of batch g+1, scoring + training of batch g) + weight sync. The ground truth prices it the
  same way (its own stage seconds; its link speeds for the sync), the controller's cost model likewise.
  The first interval also generates batch 0 alone (pipeline fill, ``StepRecord.fill_s``); the last one
  generates nothing.
- Plans keep actor-gen disjoint from every other model-stage: the pool is split (actor-gen on the first k
  devices, the rest on the others; k on a grid of eighths of the pool, in whole nodes once the pool has two)
  and the planner solves each side alone; the split with the lowest predicted interval wins (the others are
  its runners-up). adapt.py filters the real job's candidates the same way (async generation needs its own
  devices). Where no split fits (e.g. 8 A100s of 64 GB cannot hold PPO's four 8B models' training state on
  fewer than 8), the job runs that step colocated and synchronously (the planner's ordinary plans:
  ``SimPlan.overlapped`` False, counted as ``sync_fallback_steps``), as a real job without spare devices would.
- The controller observes and moves state only at weight syncs: every step boundary here is one
  (sync_every 1), so a transition is admitted only between intervals.

Policies: ``async_fixed`` (the planner's first disjoint plan's tp/pp kept, dp and the split re-planned: the
paper's async baseline from Laminar, fixed parallelism with DP scaling; the first disjoint plan is the one at
the first step whose pool admits a split, with the hardware table's priors) and ``async_nereus`` (Eq. 2 admission).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs import CostModel, counts
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.elastic.planner import GAP, MAX_NODES, InfeasiblePlanError, Planner
from nereus_jax.elastic.workload import Workload
from nereus_jax.sim.model import PlanningModel, _pinned
from nereus_jax.sim.plans import SimPlan

GEN = "actor-gen"
TRAIN = "actor-train"
SPLITS = 8  # actor-gen gets k/8 of the pool, k = 1..7 (rounded to whole devices)
ASYNC_POLICIES = ("async_fixed", "async_nereus")


def gen_sizes(n: int, node: int) -> list[int]:
    """Candidate device counts for actor-gen on a pool of ``n``: eighths of the pool, at least 1 each side;
    whole nodes of ``node`` devices once the pool has two (tp groups stay inside nodes on both sides)."""
    unit = node if n >= 2 * node else 1
    return sorted({min(n - unit, max(unit, unit * round(n * k / SPLITS / unit))) for k in range(1, SPLITS)}
                  ) if n > unit else []


def sync_transfer(plan: SimPlan, actor: ModelConfig, devices_per_node: int) -> tuple[str, float]:
    """(link, bytes per generator device) of the weight sync actor-train -> actor-gen: each generator
    device receives its tp shard of the actor in the compute dtype; "intra" when generator and trainer
    share one node, else "inter"."""
    gen = plan.choice(GEN)
    nbytes = counts.params_per_device(actor, gen.tp, 1) * counts.dtype_bytes(actor.compute_dtype)
    nodes = {d // devices_per_node for ms, sp in plan.plan.items() if str(ms) in (GEN, TRAIN) for d in sp.devices}
    return ("intra" if len(nodes) == 1 else "inter"), nbytes


class AsyncPlanningModel(PlanningModel):
    """The controller's model of an async job: disjoint plans, intervals priced as max(gen, rest) + sync."""

    def _solve(self, cm: CostModel, wl: Workload, pool: tuple[int, ...]) -> tuple[SimPlan, ...] | None:
        s = self.planner_settings
        planner = Planner(cm, headroom=float(s.get("headroom", 0.1)), gap=float(s.get("gap", GAP)),
                          max_nodes=int(s.get("max_nodes", MAX_NODES)))
        try:
            full = planner.problem(self.models, self.algorithm, wl, pool)
        except InfeasiblePlanError:
            return None
        found = []
        for k in gen_sizes(len(pool), self.hw.devices_per_node):
            gen = _solve_side(planner, dataclasses.replace(full, phases=full.phases[:1], pool=pool[:k]), self.layouts)
            rest = gen and _solve_side(planner, dataclasses.replace(full, phases=full.phases[1:], pool=pool[k:]),
                                       self.layouts)
            if gen and rest:
                plan = ExecutionPlan({**gen.plan, **rest.plan})
                found.append(SimPlan.build({**gen.choices, **rest.choices}, plan, self.phases, overlapped=True))
        found.sort(key=lambda p: self.predict_with(cm, p, wl))
        return tuple(found[:4]) or self._colocated(cm, wl, pool)

    def _colocated(self, cm: CostModel, wl: Workload, pool: tuple[int, ...]) -> tuple[SimPlan, ...] | None:
        """No split fits: the planner's ordinary (synchronous, colocated) plans, never pinned (a pinned async
        baseline pins its disjoint plan's layouts, which a colocated plan need not be able to use)."""
        pinned, self.layouts = self.layouts, None
        try:
            return super()._solve(cm, wl, pool)
        finally:
            self.layouts = pinned

    def predict_with(self, cm: CostModel, plan: SimPlan, wl: Workload) -> float:
        seconds = {s: cm.stage_latency(self.models[s.split("-")[0]], s, c, wl).total for s, c in plan.choices}
        if not plan.overlapped:
            return plan.latency(seconds)
        link, nbytes = sync_transfer(plan, self.models["actor"], self.hw.devices_per_node)
        return plan.latency(seconds, cm.transfer_seconds(nbytes, link))

    def predict(self, plan: SimPlan, wl: Workload) -> float:
        return self.predict_with(self.cost_model, plan, wl)


def _solve_side(planner: Planner, problem, layouts):
    opts = _pinned(problem.options(), layouts)
    result = planner.solve(problem, opts)
    if result is None and problem.concurrent:
        result = planner.solve(dataclasses.replace(problem, allow_concurrency=False), opts)
    return result


def interval_seconds(truth, cfg_of, plan: SimPlan, workloads: Mapping[str, Workload | None],
                     steps: Mapping[str, int]) -> tuple[float, dict[str, float]]:
    """Ground-truth interval of an overlapped plan: each stage at its own batch's workload and step (actor-gen:
    the next batch; none at the last interval), then the critical path + the true weight sync."""
    seconds = {s: (truth.stage_seconds(cfg_of(s), s, c, workloads[s], steps[s]) if workloads[s] is not None else 0.0)
               for s, c in plan.choices}
    link, nbytes = sync_transfer(plan, cfg_of("actor"), truth.hw.devices_per_node)
    return plan.latency(seconds, truth.link_seconds(link, nbytes)), seconds
