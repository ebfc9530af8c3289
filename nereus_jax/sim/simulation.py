"""Runs policies over a drift trace on a simulated cluster: the SAME Controller, Planner, cost model and
transition graph as the real job, against the ground truth of ``sim.truth``.

Each step: the controller observes the previous step (its response length, measured latency, the
predicted peak memory of the current plan) and the pool for the next step; an admitted decision is
applied at the step boundary (the ground truth prices the transition); the step runs (ground truth
seconds per stage, its critical path; an out-of-memory step wastes half its time and forces an urgent
re-plan); the measured stage seconds calibrate the policy's cost model.

Policies (same trace, same seed, same noise per step and stage):
- ``fixed``: the planner's first-step (tp, pp, ep) per model-stage kept for the run; dp, micro-batch and
  remat re-planned by the same controller (the paper's baseline: fixed TP/PP + DP scaling);
- ``fixed_best``: the best single pinned (tp, pp) assignment in hindsight with DP scaling, among the
  assignments the oracle uses (the 8 most used) and the first-step one;
- ``every_K`` (``every_3``): re-plan every K steps and on pool/memory triggers, admit any predicted gain
  (``Controller(period=K, gamma=inf)``);
- ``no_admission``: re-plan on every trigger, admit any predicted gain (gamma = infinity);
- ``nereus``: the controller with Eq. 2 admission (gamma from the trace);
- ``oracle``: each step the truly fastest plan that fits, among the planner's picks under the truth's
  efficiencies and every plan any other policy ran at that step, with free transitions: a lower bound
  of every policy's step latency (of the synchronous ones: it never runs async plans);
- ``async_fixed`` / ``async_nereus``: one-step-off async with actor-gen on its own devices, the step latency
  the interval between weight syncs (``sim.asynchronous``): the async baseline (first disjoint plan's tp/pp,
  DP scaling) and the controller with Eq. 2 admitting transitions only at weight syncs.

    sim = Simulation(load_trace("paper_drift"))
    runs = sim.run(["fixed", "nereus", "oracle"])
    runs["nereus"].summary()
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import time
from collections import Counter
from collections.abc import Sequence

from nereus_jax.config import resolve_model
from nereus_jax.elastic.controller import Controller, Decision, Observation
from nereus_jax.elastic.costs import CostModel
from nereus_jax.elastic.graph import TransitionGraph, transition_seconds
from nereus_jax.elastic.hardware import get_hardware
from nereus_jax.elastic.topology import Topology
from nereus_jax.elastic.workload import Workload
from nereus_jax.model_stage import split_stage
from nereus_jax.sim.asynchronous import AsyncPlanningModel, async_oracle, interval_seconds
from nereus_jax.sim.model import Layouts, PlanningModel, SharedCaches, bucket_workload, plan_peak_memory
from nereus_jax.sim.plan_cost import SimPlan, changed_stages, expert_parallel, state_specs
from nereus_jax.sim.records import ASYNC_POLICIES, PolicyRun, StepRecord
from nereus_jax.sim.trace import Trace
from nereus_jax.sim.truth import GroundTruth, TruthSettings

POLICIES = ("fixed", "fixed_best", "every_3", "no_admission", "nereus", "oracle")
OOM_WASTE = 0.5  # estimate: an out-of-memory step fails on average halfway through
FIXED_BEST_CANDIDATES = 8


class PolicyError(ValueError):
    """An unknown policy name (the message lists the valid ones)."""


class Simulation:
    """One trace on its simulated cluster; ``run`` plays policies over it."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.hw = get_hardware(trace.hardware)
        self.topology = Topology.of_job(trace.algorithm, reward_model=True)  # the job with a reward model
        self.phases = self.topology.phases
        self.stages = list(self.topology.stages)
        roles = sorted({split_stage(s)[0] for s in self.stages})
        missing = [r for r in roles if r not in trace.models]
        if missing:
            raise ValueError(f"trace '{trace.name}': models needs a preset for role(s) {missing}")
        self.models = {r: resolve_model(trace.models[r]) for r in roles}
        self.specs = state_specs(self.models, self.topology.units)
        self.truth = GroundTruth(self.hw, trace.seed, TruthSettings.from_mapping(trace.truth))
        self.caches = SharedCaches()

    def with_controller(self, **settings: float) -> Simulation:
        """This simulation with controller settings overridden (``gamma=1.0``: a sweep), sharing its ground
        truth and planner caches, which depend on neither (the runs are those of a fresh Simulation)."""
        other = copy.copy(self)
        other.trace = dataclasses.replace(self.trace, controller={**self.trace.controller, **settings})
        return other

    # ---------------------------------------------------------------------------- building blocks
    def model(self, layouts: Layouts | None = None, cost_model: CostModel | None = None,
              asynchronous: bool = False, home: tuple[SimPlan, tuple[int, ...]] | None = None) -> PlanningModel:
        """A policy's planning model (``home``: the plan it starts on and that plan's pool, its home plan)."""
        kind = AsyncPlanningModel if asynchronous else PlanningModel
        return kind(self.models, self.trace.algorithm, self.hw, self.topology, self.specs, self.caches,
                    layouts=layouts, planner=self.trace.planner, cost_model=cost_model, home=home)

    def cfg(self, stage: str):
        """The network of a model-stage (``actor-gen``) or a role (``actor``)."""
        return self.models[stage.partition("-")[0]]

    def measure(self, plan: SimPlan, wl: Workload, step: int) -> tuple[float, dict[str, float]]:
        """Ground-truth step latency and per-stage seconds of ``plan`` at ``step``."""
        seconds = {s: self.truth.stage_seconds(self.cfg(s), s, c, wl, step) for s, c in plan.choices}
        return plan.latency(seconds), seconds

    def measure_step(self, plan: SimPlan, step: int, generated: bool = False
                     ) -> tuple[float, dict[str, float], dict[str, Workload | None]]:
        """Ground-truth step latency, per-stage seconds and per-stage batch of ``plan`` at ``step``: a
        synchronous plan runs step's batch (``generated``: an async step before it generated it already); an
        async (overlapped) one scores and trains batch ``step`` while actor-gen generates batch ``step + 1``
        (none at the last step), then syncs weights."""
        wl = self.trace.workload(step)
        if not plan.overlapped:
            seconds = {s: self.truth.stage_seconds(self.cfg(s), s, c, wl, step) for s, c in plan.choices}
            if generated:
                seconds["actor-gen"] = 0.0
            return plan.latency(seconds), seconds, ({"actor-gen": None} if generated else {})
        nxt = step + 1 if step + 1 < self.trace.steps else None
        workloads = {s: wl for s, _ in plan.choices}
        workloads["actor-gen"] = None if nxt is None else self.trace.workload(nxt)
        steps = {s: (nxt if s == "actor-gen" else step) for s, _ in plan.choices}
        latency, seconds = interval_seconds(self.truth, self.cfg, plan, workloads, steps)
        return latency, seconds, workloads

    def true_peak(self, plan: SimPlan, wl: Workload) -> float:
        return plan_peak_memory(plan, wl, lambda s, c: self.truth.stage_bytes(self.cfg(s), s, c, wl), self.cfg)

    def fits(self, plan: SimPlan, wl: Workload) -> bool:
        return self.true_peak(plan, wl) <= self.hw.memory_bytes

    def step_peak(self, plan: SimPlan, step: int) -> float:
        """True peak bytes of ``plan`` at ``step``; async: actor-gen holds the next batch (its KV cache)."""
        wl = self.trace.workload(step)
        if not plan.overlapped:
            return self.true_peak(plan, wl)
        nxt = self.trace.workload(min(step + 1, self.trace.steps - 1))
        return plan_peak_memory(plan, wl, lambda s, c: self.truth.stage_bytes(
            self.cfg(s), s, c, nxt if s == "actor-gen" else wl), self.cfg)

    def true_transition(self, model: PlanningModel, old: SimPlan, new: SimPlan) -> float | None:
        """Ground-truth seconds of old -> new: data movement at true link speeds + concurrent setup."""
        graph = model.graph(old, new)
        if graph is None:
            return None
        folded = expert_parallel(old.plan) or expert_parallel(new.plan)  # the graph's layouts hide ep changes
        return true_transition_seconds(self.truth, graph, list(changed_stages(old, new).values()) if folded else None)

    def initial_plan(self, asynchronous: bool = False) -> SimPlan:
        """The planner's plan for the first step with the hardware table's priors (every policy of a mode
        starts here; async: the first disjoint plan)."""
        plan = self.model(asynchronous=asynchronous).best(self.trace.workload(0), self.trace.pool(0))
        if plan is None:
            raise ValueError(f"trace '{self.trace.name}': nothing fits the first step's pool")
        return plan

    def first_disjoint_plan(self) -> SimPlan:
        """The planner's first async plan with actor-gen on its own devices (hardware-table priors), at the
        first step whose pool admits one (``async_fixed`` pins its layouts)."""
        model = self.model(asynchronous=True)
        for step in range(self.trace.steps):
            plan = model.best(self.trace.workload(step), self.trace.pool(step))
            if plan is not None and plan.overlapped:
                return plan
        raise ValueError(f"trace '{self.trace.name}': no step's pool fits actor-gen on devices of its own")

    # ---------------------------------------------------------------------------------- policies
    def run(self, policies: Sequence[str] = POLICIES) -> dict[str, PolicyRun]:
        for p in policies:
            check_policy(p)
        runs: dict[str, PolicyRun] = {}
        oracle_picks = self._oracle_picks() if {"fixed_best", "oracle"} & set(policies) else None
        for name in policies:
            if name == "fixed_best":
                runs[name] = self._fixed_best(oracle_picks, runs.get("fixed"))
            elif name not in ("oracle", "async_oracle"):
                runs[name] = self.run_policy(name)
        if "oracle" in policies:
            runs["oracle"] = self._oracle(oracle_picks, list(runs.values()))
        if "async_oracle" in policies:  # a lower bound of every run above (their plans are its candidates)
            runs["async_oracle"] = async_oracle(self, list(runs.values()))
        return {p: runs[p] for p in policies}

    def controller(self, name: str, model: PlanningModel) -> Controller:
        c = self.trace.controller
        kw = {k: float(c[k]) for k in ("length_drift", "efficiency_drift", "expert_drift", "ema") if k in c}
        if "efficiency_window" in c:
            kw["efficiency_window"] = int(c["efficiency_window"])
        kw["devices"] = self.trace.pool(0)  # the pool at start: a change before the first observation triggers
        kw["error_margin"] = bool(c.get("error_margin", True))
        gamma = float(c.get("gamma", 0.5))
        args = (model.candidates, model.latency, model.transition_seconds)
        every = re.fullmatch(r"every_(\d+)", name)
        if every:
            return Controller(*args, gamma=math.inf, period=int(every.group(1)), **kw)
        if name == "no_admission":
            return Controller(*args, gamma=math.inf, **kw)
        return Controller(*args, gamma=gamma, **kw)

    def run_policy(self, name: str, layouts: Layouts | None = None,
                   give_up_above: float = math.inf) -> PolicyRun | None:
        """Play one controller policy over the trace (``fixed``: pinned to the first plan's layouts). None
        once its running total exceeds ``give_up_above`` (a fixed_best candidate that cannot win)."""
        asynchronous = name in ASYNC_POLICIES
        plan = self.initial_plan(asynchronous)
        if name == "fixed" and layouts is None:
            layouts = plan.layouts()
        if name == "async_fixed" and layouts is None:
            layouts = self.first_disjoint_plan().layouts()
        model = self.model(layouts, asynchronous=asynchronous, home=(plan, self.trace.pool(0)))
        controller = self.controller(name, model)
        run = PolicyRun(name, [], notes={"layouts": _layout_text(layouts)} if layouts else {})
        prev: tuple[Workload, float] | None = None
        for step in range(self.trace.steps):
            wl, pool = self.trace.workload(step), self.trace.pool(step)
            rec = StepRecord(step, len(pool), 0.0)
            if prev is not None:
                model.observed = prev[0]
                obs = Observation(step=step, plan=plan, devices=pool, response_length=prev[0].response_length.mean,
                                  step_seconds=prev[1], peak_memory_bytes=model.peak_memory(plan, prev[0]),
                                  memory_cap_bytes=model.pricing.trigger_bytes(self.hw.memory_bytes),
                                  steps_left=self.trace.steps - step, expert_load=prev[0].expert_load or None)
                start, charged, fresh = time.perf_counter(), model.planner_ms, len(self.caches.plan_ms)
                decision = controller.observe(obs)
                wall = (time.perf_counter() - start) * 1e3
                solved = sum(self.caches.plan_ms[fresh:])  # fresh solves are in the wall time already
                rec.decision_ms = wall - solved + (model.planner_ms - charged)
                plan = self._apply(decision, plan, model, rec, run)
            plan = self._ensure_in_pool(plan, model, pool, rec)
            plan = self._run_step(plan, wl, step, model, controller, rec, run)
            run.records.append(rec)
            prev = (wl, rec.latency_s)
            if run.total_s > give_up_above:
                return None
        return run

    def _apply(self, decision: Decision | None, plan: SimPlan, model: PlanningModel, rec: StepRecord,
               run: PolicyRun) -> SimPlan:
        if decision is None:
            return plan
        run.decisions.append(decision)
        if decision.admitted and decision.target is not None:
            return self._transition(plan, decision.target, model, rec)
        if decision.urgent:  # no live transition: checkpoint/restart onto the best plan
            best = model.best(model.observed, tuple(range(rec.pool)))
            if best is not None:
                rec.wasted_s += self.truth.restart_seconds()
                rec.events.append("restart")
                return best
        return plan

    def _transition(self, plan: SimPlan, target: SimPlan, model: PlanningModel, rec: StepRecord) -> SimPlan:
        seconds = self.true_transition(model, plan, target)
        if seconds is None:
            rec.wasted_s += self.truth.restart_seconds()
            rec.events.append("restart")
            return target
        layout = any(changed_stages(plan, target).values())
        model.record_transition(plan, target, seconds)
        rec.transition_s += seconds
        rec.events.append("transition" + (" layout" if layout else ""))
        return target

    def _ensure_in_pool(self, plan: SimPlan, model: PlanningModel, pool: tuple[int, ...], rec: StepRecord) -> SimPlan:
        """A plan on devices that left the pool cannot run: move it (forced), unpinned if pinning can't fit."""
        if set(plan.devices) <= set(pool):
            return plan
        model.observed = model.observed or self.trace.workload(0)
        target = model.best(model.observed, pool)
        if target is None:
            target = self.model(asynchronous=plan.overlapped).best(model.observed, pool)
            rec.events.append("forced relayout")
        return self._transition(plan, target.aligned_to(plan), model, rec)

    def _run_step(self, plan: SimPlan, wl: Workload, step: int, model: PlanningModel, controller: Controller,
                  rec: StepRecord, run: PolicyRun) -> SimPlan:
        for _ in range(3):
            if self.step_peak(plan, step) <= self.hw.memory_bytes:
                break
            rec.oom += 1
            rec.wasted_s += OOM_WASTE * self.measure_step(plan, step)[0]
            model.observed = wl
            obs = Observation(step=step, plan=plan, devices=tuple(range(rec.pool)),
                              response_length=wl.response_length.mean, peak_memory_bytes=self.step_peak(plan, step),
                              memory_cap_bytes=float(self.hw.memory_bytes), steps_left=self.trace.steps - step)
            plan = self._apply(controller.observe(obs), plan, model, rec, run)
        rec.predicted_s = model.predict(plan, wl)
        pipelined = bool(run.records) and run.records[-1].plan.overlapped  # batch ``step`` is generated already
        rec.latency_s, seconds, workloads = self.measure_step(plan, step, generated=pipelined)
        if plan.overlapped and not pipelined:  # (re)filling the pipeline: this step's batch is generated first
            rec.fill_s = self.truth.stage_seconds(self.cfg("actor-gen"), "actor-gen", plan.choice("actor-gen"), wl,
                                                  step)
        rec.plan = plan
        model.calibrate(plan, wl, seconds, changed=bool(rec.events), workloads=workloads)
        return plan

    # -------------------------------------------------------------------------- hindsight policies
    def oracle_model(self) -> PlanningModel:
        """A planner over a cost model with the truth's large-size efficiencies (hindsight knowledge)."""
        return self.model(cost_model=CostModel(self.hw, self.truth.reference_efficiency()))

    def _oracle_picks(self) -> list[tuple[SimPlan, ...]]:
        model = self.oracle_model()
        return [model.plans(bucket_workload(self.trace.workload(s)), self.trace.pool(s))
                for s in range(self.trace.steps)]

    def _oracle(self, picks, others: Sequence[PolicyRun]) -> PolicyRun:
        run = PolicyRun("oracle", [])
        for step in range(self.trace.steps):
            wl, pool = self.trace.workload(step), set(self.trace.pool(step))
            candidates = set(picks[step]) | {r.records[step].plan for r in others
                                             if not r.records[step].plan.overlapped}
            best = None
            for p in candidates:
                if p is None or not set(p.devices) <= pool or not self.fits(p, wl):
                    continue
                latency = self.measure(p, wl, step)[0]
                if best is None or latency < best[0]:
                    best = (latency, p)
            assert best is not None, f"oracle: nothing fits step {step}"
            run.records.append(StepRecord(step, len(pool), best[0], plan=best[1]))
        return run

    def _fixed_best(self, picks, fixed: PolicyRun | None) -> PolicyRun:
        counts = Counter(p[0].layouts() for p in picks if p)
        candidates = [lay for lay, _ in counts.most_common(FIXED_BEST_CANDIDATES)]
        first = self.initial_plan().layouts()
        if first not in candidates:
            candidates.append(first)
        best = None
        for layouts in candidates:
            limit = best.total_s if best is not None else math.inf
            run = fixed if fixed is not None and layouts == first else self.run_policy("fixed_best", layouts, limit)
            if run is None or any("forced relayout" in e for r in run.records for e in r.events):
                continue  # that layout cannot run the whole trace
            if best is None or run.total_s < best.total_s:
                best = run
        assert best is not None
        return PolicyRun("fixed_best", best.records, best.decisions,
                         {**best.notes, "fixed_best_candidates": len(candidates)})


def true_transition_seconds(truth: GroundTruth, graph: TransitionGraph, changed: Sequence[bool] | None = None) -> float:
    """Ground-truth seconds of a scheduled transition graph: its critical path at the truth's link speeds,
    plus the setup of the changed model-stages (paid concurrently: the slowest one counts). ``changed``: per
    changed model-stage whether its layout changed (default: from the graph's plans)."""
    data = transition_seconds(graph, truth.link_seconds, truth.hw.devices_per_node)
    if changed is None:
        changed = [sp.layout != graph.old_plan[ms].layout for ms, sp in graph.new_plan.items()
                   if sp != graph.old_plan[ms]]
    return data + max((truth.setup_seconds(v) for v in changed), default=0.0)


def check_policy(name: str) -> None:
    """Raises PolicyError unless ``name`` is a policy ``run`` knows (the message lists them)."""
    if name not in POLICIES + ASYNC_POLICIES + ("async_oracle",) and not re.fullmatch(r"every_[1-9]\d*", name):
        raise PolicyError(f"unknown policy '{name}'; valid: {', '.join(POLICIES + ASYNC_POLICIES)}, async_oracle "
                          "(every_K for any K >= 1)")


def _layout_text(layouts: Layouts | None) -> str:
    return "; ".join(f"{s} tp{tp} pp{pp}" + (f" ep{ep}" if ep > 1 else "") for s, tp, pp, ep in layouts) \
        if layouts else ""
