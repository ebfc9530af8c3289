"""The controller's side of a simulated run: what a real job would compute, knowing nothing of the truth.

:class:`PlanningModel` holds a :class:`CostModel` that starts from the hardware table's priors and is
calibrated only from measured stage seconds (``calibrate``), a :class:`Planner` over it, and the
transition pricing (the scheduled transition graph priced by ``elastic.graph.transition_seconds`` with
the cost model's link times, plus a setup term learned from measured transitions). Its ``candidates`` /
``latency`` / ``transition_seconds`` are the three callables :class:`nereus_jax.elastic.controller.Controller`
takes, with the job's names. The candidate set is :meth:`ControllerAdapter.candidates`
(``nereus_jax.elastic.adapter``), the policy the running job uses too; this class supplies its primitives:
the planner's plans on a snapshot of the cost model (cached), the plans this run has run, the home plan (the
run's first plan on its first pool; on another pool its layouts re-planned), :class:`SimPlan` s with their
choices (a partial move takes a unit's and its riders' choices from the best plan), and their predicted
latency and peak memory.

``layouts`` pins every model-stage's (tp, pp, ep) (the "fixed TP/PP with DP scaling" baselines): the
planner then chooses only dp, micro-batch and remat among the pinned layouts' options.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, MutableMapping

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.adapter import ControllerAdapter
from nereus_jax.elastic.controller import UNCERTAINTY_Z, Observation, Priced
from nereus_jax.elastic.costs import CostModel, StageChoice
from nereus_jax.elastic.costs.candidates import StageOptions
from nereus_jax.elastic.costs.memory import frozen_base_key
from nereus_jax.elastic.hardware import Hardware
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.elastic.planner import GAP, MAX_NODES, InfeasiblePlanError, Planner
from nereus_jax.elastic.pricing import CALIBRATION_WINDOW, Pricing
from nereus_jax.elastic.topology import Topology
from nereus_jax.elastic.workload import LengthStats, Workload
from nereus_jax.sim.plan_cost import SimPlan, build_graph

# The transition setup (communicators, programs) the cost model does not price: a conservative prior until
# a transition has been measured, then an EMA of measured minus predicted data-movement seconds.
SETUP_PRIOR_S = 10.0
SETUP_EMA = 0.5
SKIP_ERROR = 0.05  # no refit while every stage of a settled plan is predicted within 5% (noise level)
EFFICIENCY_GRID = 0.02  # the planner sees efficiencies rounded to 2% steps (log scale): a cacheable snapshot
BUCKET = 0.02  # the oracle plans for response lengths rounded to a 2% log grid (then prices the exact step)

Layouts = tuple[tuple[str, int, int, int], ...]  # (model-stage, tp, pp, ep)


@dataclasses.dataclass
class SharedCaches:
    """Caches one simulation's policies share: plans (by cost model snapshot, workload, pool, pinned
    layouts) and transition graphs (by plan pair). Both are pure functions of their keys."""

    plans: MutableMapping[tuple, tuple[tuple[SimPlan, ...] | None, float]] = dataclasses.field(default_factory=dict)
    graphs: MutableMapping[tuple, object] = dataclasses.field(default_factory=dict)
    plan_ms: list[float] = dataclasses.field(default_factory=list)


class PlanningModel(ControllerAdapter):
    """Planner + calibrated cost model + transition pricing for one policy's run. ``home``: the plan the run
    started on and the pool it was planned for (the home plan's source; None: no home plan)."""

    def __init__(self, models: Mapping[str, ModelConfig], algorithm: str, hw: Hardware, topology: Topology, specs,
                 caches: SharedCaches, *, layouts: Layouts | None = None, planner: Mapping[str, float] | None = None,
                 cost_model: CostModel | None = None, home: tuple[SimPlan, tuple[int, ...]] | None = None):
        self.models, self.algorithm, self.hw, self.topology, self.specs = dict(models), algorithm, hw, topology, specs
        self.caches, self.layouts = caches, layouts
        self.planner_settings = dict(planner or {})
        self.pricing = Pricing(cost_model or CostModel(hw), topology, self.models, self.usable_bytes(),
                               window=CALIBRATION_WINDOW)
        self.observed: Workload | None = None
        self.setup_s, self.setups_seen = SETUP_PRIOR_S, 0
        self.planner_ms = 0.0  # planner time charged to this policy (cached solves included)
        self.since_change = 0
        self.ran: dict[SimPlan, None] = {}  # the plans this policy has run, oldest first (candidates again)
        self.home = home

    @property
    def cost_model(self) -> CostModel:
        return self.pricing.cost

    @property
    def phases(self) -> tuple[tuple[str, ...], ...]:
        return self.topology.phases

    # ------------------------------------------------------------------------------------ planning
    def snapshot(self) -> CostModel:
        """The cost model as the planner sees it: efficiencies and n_1/2 rounded on a 2% log grid."""
        step = math.log1p(EFFICIENCY_GRID)

        def snap(v: float) -> float:
            return float(math.exp(round(math.log(v) / step) * step)) if v > 0 else 0.0

        cm = self.cost_model
        return CostModel(self.hw, {c: snap(v) for c, v in cm.efficiency.items()},
                         {t: snap(v) for t, v in cm.half_sizes.items()})

    def plans(self, wl: Workload, pool: tuple[int, ...], layouts: Layouts | None = None) -> tuple[SimPlan, ...]:
        """The planner's best plan and runners-up (fastest first); empty when nothing fits. ``layouts``: pinned
        (default: this model's ``layouts``)."""
        cm = self.snapshot()
        layouts = self.layouts if layouts is None else layouts
        key = (type(self).__name__, cm.efficiency_vector, tuple(cm.half_sizes.values()), wl, pool, layouts,
               tuple(sorted(self.planner_settings.items())))
        if key not in self.caches.plans:
            start = time.perf_counter()
            found = self._solve(cm, wl, pool, layouts)
            ms = (time.perf_counter() - start) * 1e3
            self.caches.plans[key] = (found, ms)
            self.caches.plan_ms.append(ms)
        found, ms = self.caches.plans[key]
        self.planner_ms += ms  # a cache hit is charged what the planner took: each policy "plans" alone
        return found or ()

    def _solve(self, cm: CostModel, wl: Workload, pool: tuple[int, ...],
               layouts: Layouts | None) -> tuple[SimPlan, ...] | None:
        planner = self.planner(cm)
        try:
            problem = planner.problem(self.models, self.algorithm, wl, pool, topology=self.topology)
        except InfeasiblePlanError:
            return None
        opts = pinned_options(problem.options(), layouts)
        result = planner.solve(problem, opts)
        if result is None and problem.concurrent:
            result = planner.solve(dataclasses.replace(problem, allow_concurrency=False), opts)
        if result is None:
            return None
        return tuple(SimPlan.of(r, self.topology) for r in (result, *result.runners_up))

    def measured_plan(self, wl: Workload, pool: tuple[int, ...]) -> tuple[SimPlan, ...]:
        """The planner's best plan when options are ranked by seconds plus the uncertainty of extrapolating
        from the layouts this run has measured (:meth:`Pricing.risk_adjusted`); () with pinned layouts or when
        nothing fits (the adapter asks only once something was measured and the planner's best runs a layout
        not measured). Not cached: it depends on the layouts measured, and re-plans are rare."""
        if self.layouts is not None:
            return ()
        try:
            result = self.planner(self.snapshot()).plan(
                self.models, self.algorithm, wl, pool, topology=self.topology,
                options=lambda problem: self.pricing.risk_adjusted(problem.options(), UNCERTAINTY_Z))
        except InfeasiblePlanError:
            return ()
        return (SimPlan.of(result, self.topology),)

    def planner(self, cm: CostModel) -> Planner:
        s = self.planner_settings
        return Planner(cm, headroom=float(s.get("headroom", 0.1)), gap=float(s.get("gap", GAP)),
                       max_nodes=int(s.get("max_nodes", MAX_NODES)))

    def best(self, wl: Workload, pool: tuple[int, ...]) -> SimPlan | None:
        found = self.plans(wl, pool)
        return found[0] if found else None

    # ------------------------------------------------------------- candidates (elastic.adapter)
    def planning_workload(self) -> Workload | None:
        return self.observed

    def planned(self, obs: Observation, workload: Workload) -> tuple[SimPlan, ...]:
        return self.plans(workload, tuple(obs.devices))

    def risk_planned(self, obs: Observation, workload: Workload) -> tuple[SimPlan, ...]:
        return self.measured_plan(workload, tuple(obs.devices))

    def ran_plans(self) -> list[SimPlan]:
        return list(self.ran)

    def home_plans(self, obs: Observation, workload: Workload) -> tuple[SimPlan, ...]:
        """The plan this run started on, on the pool it was planned for; on another pool its (tp, pp, ep)
        layouts with dp, micro-batch and remat re-planned (the ``fixed`` baseline's plan there). None for a
        pinned model (its plans are the pinned layouts')."""
        if self.home is None or self.layouts is not None:
            return ()
        plan, pool = self.home
        if sorted(obs.devices) == sorted(pool):
            return (plan,)
        return self.plans(workload, tuple(obs.devices), plan.layouts())[:1]

    def execution_plan(self, plan: SimPlan) -> ExecutionPlan:
        return plan.plan

    def with_unit(self, current: SimPlan, best: SimPlan, unit) -> SimPlan | None:
        """``current`` with ``unit`` and its riders as ``best`` runs them (their choices too); None between a
        colocated and an overlapped plan."""
        if current.overlapped != best.overlapped:
            return None
        name = str(unit)
        choices = {s: (best if self.topology.host(s) == name else current).choice(s) for s, _ in current.choices}
        return SimPlan.build(choices, ExecutionPlan({**current.plan, unit: best.plan[unit]}), self.topology,
                             current.overlapped)

    def choices_of(self, plan: SimPlan, workload: Workload) -> dict[str, StageChoice]:
        return dict(plan.choices)

    def price(self, plan: SimPlan, choices: Mapping[str, StageChoice], workload: Workload) -> float:
        return self.predict(plan, workload)

    def plan_peak_bytes(self, plan: SimPlan, choices: Mapping[str, StageChoice], workload: Workload) -> float:
        return self.peak_memory(plan, workload)

    # ------------------------------------------------------------------ the other two callables
    def latency(self, plan: SimPlan, obs: Observation | None = None) -> float | None:
        return self.predict(plan, self.observed)

    def transition_seconds(self, old: SimPlan, new: SimPlan) -> Priced | None:
        """Predicted data movement of ``old`` -> ``new`` (ranks aligned to ``old``) plus the learned setup, with
        that target and its graph."""
        target = new.aligned_to(old)
        graph = self.graph(old, target)
        if graph is None:
            return None
        return Priced(self.pricing.movement_seconds(graph) + (self.setup_s if old != target else 0.0), target, graph)

    # ---------------------------------------------------------------------------------- predictions
    def predict(self, plan: SimPlan, wl: Workload) -> float:
        """Predicted step latency of ``plan`` on ``wl`` with the current (calibrated) cost model."""
        return plan.latency(self.pricing.stage_seconds(dict(plan.choices), wl))

    def peak_memory(self, plan: SimPlan, wl: Workload) -> float:
        """Predicted peak bytes on the busiest device of ``plan`` on ``wl``."""
        return self.pricing.peak_bytes(plan.plan, dict(plan.choices), wl)

    def usable_bytes(self) -> float:
        return (1 - float(self.planner_settings.get("headroom", 0.1))) * self.hw.memory_bytes

    def graph(self, old: SimPlan, new: SimPlan):
        key = (old, new)
        if key not in self.caches.graphs:
            self.caches.graphs[key] = build_graph(old, new, self.specs, self.hw.memory_bytes)
        return self.caches.graphs[key]

    # ---------------------------------------------------------------------------------- calibration
    def calibrate(self, plan: SimPlan, wl: Workload, seconds: Mapping[str, float], changed: bool,
                  workloads: Mapping[str, Workload | None] | None = None) -> bool:
        """Refit the cost model's efficiencies from the measured stage seconds of the last steps. Skipped
        (returns False) once the window holds only this plan and every stage is predicted within
        ``SKIP_ERROR``: the refit would barely move (a saving for 1,000-step simulations). ``workloads``:
        per stage, the batch it ran when not ``wl`` (async actor-gen: the next one; None: it did not run)."""
        self.ran.pop(plan, None)
        self.ran[plan] = None
        per = {s: (workloads or {}).get(s, wl) for s, _ in plan.choices}
        ran = {s: c for s, c in plan.choices if per[s] is not None}
        ms = [m for s in ran for m in self.pricing.measurements({s: ran[s]}, per[s], seconds)]
        self.since_change = 0 if changed else self.since_change + 1
        if self.since_change >= CALIBRATION_WINDOW and self.pricing.window and ms:
            cm = self.cost_model
            worst = max(abs(cm.stage_latency(m.model, m.stage, m.choice, m.workload).total / m.seconds - 1)
                        for m in ms)
            if worst < SKIP_ERROR:
                self.pricing.remember(ms)
                return False
        self.pricing.calibrate(ms)
        return True

    def record_transition(self, old: SimPlan, new: SimPlan, measured_s: float) -> None:
        """Learn the setup part of transitions: measured seconds minus predicted data movement."""
        graph = self.graph(old, new)
        if graph is None:
            return
        data = self.pricing.movement_seconds(graph)
        setup = max(0.0, measured_s - data)
        self.setup_s = setup if self.setups_seen == 0 else SETUP_EMA * setup + (1 - SETUP_EMA) * self.setup_s
        self.setups_seen += 1


def plan_peak_memory(plan: SimPlan, wl: Workload, stage_bytes, model_for=None) -> float:
    """Peak bytes over the plan's devices (``Topology.device_bytes``); ``stage_bytes(stage, choice) ->
    (resident, working)``. ``model_for(stage)``: the stage's network, so LoRA's frozen base counts once where
    units hold it alike, as the runtime shares it (``costs.memory.frozen_base_key``)."""
    choices = dict(plan.choices)
    shared = None if model_for is None else (
        lambda s: frozen_base_key(model_for(s), s, choices[s].tp, choices[s].pp, choices[s].ep))
    return max(plan.topology.device_bytes(plan.plan, lambda s: tuple(stage_bytes(s, choices[s])), shared).values())


def pinned_options(opts: Mapping[str, StageOptions], layouts: Layouts | None) -> dict[str, StageOptions]:
    """Each model-stage's options restricted to its pinned (tp, pp, ep) (all of them when not pinned)."""
    if layouts is None:
        return dict(opts)
    keep = {s: (tp, pp, ep) for s, tp, pp, ep in layouts}
    out = {}
    for s, o in opts.items():
        tp, pp, ep = keep[s]
        m = (o.table[:, 0] == tp) & (o.table[:, 1] == pp) & (o.table[:, 5] == ep)
        out[s] = o.masked(m)
    return out


def bucket_workload(wl: Workload) -> Workload:
    """``wl`` with its response lengths rounded to the :data:`BUCKET` log grid: what the oracles plan for (nearby
    steps share a planner call), before they price the exact step."""
    step = math.log1p(BUCKET)
    r = wl.response_length

    def snap(x: float) -> float:
        return math.exp(round(math.log(x) / step) * step)

    mean, p95 = snap(r.mean), snap(r.p95)
    top = max(int(math.ceil(snap(r.max))), int(math.ceil(p95)))
    return wl.with_response_length(LengthStats(min(mean, p95), p95, top))
