"""The running job's prices: its measured costs, and what they predict for the plans and moves the
controller weighs.

    pricer = JobPricer(job, log=print)   # the Adapter owns one and hands its methods to the Controller
    pricer.learn(metrics)                 # every step's measurements (process 0's, agreed at the boundary)
    controller = Controller(pricer.candidates, pricer.latency, pricer.transition_seconds, ...)

Calibration: each step's measured stage seconds refit the cost model's efficiencies (``CostModel.observe``
over a window of recent steps); a step that compiled programs is timed for its compile instead (the first
step's compile, split per model-stage by :func:`compile_by_stage`) and left out of the fit.

Candidates: :meth:`ControllerAdapter.candidates` (``nereus_jax.elastic.adapter``), the one policy the job and
the simulator share (planner plans, partial moves toward the best, the risk-adjusted plan, plans run before, the
home plan; one filter, one pricing). This class supplies its primitives: the planner for the job's topology
(async: actor-gen on its own devices), the configured layouts on the pool as the home plan, plans mapped to the
job's model-stages (actor-infer and critic-infer run on the training units, so they are priced with the
training stage's layout) and priced with the calibrated cost model, the plans the job ran (priced from their
remembered measurements, ``Pricing.residual``), and what the job alone needs to run a plan (:meth:`runnable`).

A transition's predicted cost is the transition graph's makespan on the hardware's links; on shared-compute
hardware (cpu) the compile competes with the steps for the same cores (and the interpreter), so the compile a
move needs is added to it: the first step's measured compile time of each model-stage whose devices or layout
change (actor-gen's per engine), times the steps' measured loss per compile-second at the last hidden compile
(``compile_contention``, 1 before one). On GPUs the compile runs on host cores while the devices step, and is
hidden.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from nereus_jax.config import ConfigError
from nereus_jax.elastic.adapter import ControllerAdapter, partial_moves
from nereus_jax.elastic.controller import UNCERTAINTY_Z, Observation, Priced
from nereus_jax.elastic.costs import CostModel, StageChoice, link_bandwidth
from nereus_jax.elastic.costs.candidates import StageOptions
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.elastic.planner import InfeasiblePlanError, Planner, PlanResult, Problem
from nereus_jax.elastic.pricing import CALIBRATION_WINDOW
from nereus_jax.elastic.recipe import align_ranks
from nereus_jax.elastic.workload import LengthStats, Workload
from nereus_jax.model_stage import ACTOR_GEN
from nereus_jax.runtime.step.initial_plan import job_pricing, plan_from_config
from nereus_jax.runtime.step.job import Job, engine_replicas_across_processes


class JobPricer(ControllerAdapter):
    """The job's calibrated prices: step latency, peak memory and candidates for a pool, transition seconds
    (data movement plus, on shared compute, the compile a move needs). ``job`` is the job it measures
    (the Adapter points it at a job that replaces it after a device loss)."""

    def __init__(self, job: Job, log: Callable[[str], None] = print):
        self.job, self.log = job, log
        cfg = job.cfg
        self.async_mode = cfg.trainer.mode == "async"
        self.pricing = job_pricing(cfg)
        self.topology = self.pricing.topology
        self.planner = Planner(self.cost, headroom=cfg.controller.memory_headroom)
        self.workload: Workload | None = None  # the last measured step's
        self.response_length: float | None = None  # the last measured mean response length
        self.compiled_last_step = True  # the first step compiles everything
        self.compile_s: float | None = None  # measured compile time of a whole plan
        self._compile_step_s: float | None = None
        self._compile_stage_seconds: dict[str, float] = {}  # the compiling step's seconds per stage
        # measured compile seconds per model-stage (its programs, or its engines for actor-gen): a move pays
        # for the model-stages whose devices or layout change; the others keep their compiled programs
        self.stage_compile_s: dict[str, float] | None = None
        # on shared compute: step seconds lost per second of a compile ahead (measured at each hidden compile;
        # 1 until then: the compile counted whole)
        self.compile_contention = 1.0
        self._ran: dict[ExecutionPlan, None] = {}  # plans the job has stepped on, oldest first: candidates again
        self._steady_s: collections.deque[float] = collections.deque(maxlen=CALIBRATION_WINDOW)
        # the priced stages' measured seconds per step (since the last plan change), for the efficiency
        # trigger: their median over a few steps, because single steps on a shared host are noisy
        self._priced_s: collections.deque[float] = collections.deque(maxlen=5)

    @property
    def cost(self) -> CostModel:
        """The calibrated cost model (the planner's and the pricing's)."""
        return self.pricing.cost

    # --------------------------------------------------------------------------- calibration
    def learn(self, metrics: Mapping[str, Any]) -> None:
        """One step's measurements: the workload it ran, its compile (a step that compiled) or its stage
        seconds, which refit the cost model."""
        job = self.job
        self.response_length = metrics["response_length_mean"]
        # padded programs run every row at R; packed ones at the lengths the next step's budget allows
        budget = job.response_budget(metrics["step"] + 1) if job.cfg.trainer.packing else job.R
        mean = min(max(1.0, metrics["response_length_mean"]), budget)
        p95 = min(max(mean, metrics.get("response_length_p95", mean)), budget)
        self.workload = Workload(job.cfg.trainer.prompts_per_step, LengthStats.fixed(job.P),
                                 LengthStats(mean, p95, budget), job.n,
                                 packed=job.cfg.trainer.packing,  # packed: FLOPs follow the mean length
                                 mini_batches=job.cfg.trainer.mini_batches, epochs=job.cfg.trainer.ppo_epochs,
                                 pipeline_schedule=job.cfg.trainer.pipeline_schedule,
                                 vocab_chunk=job.cfg.trainer.vocab_chunk,
                                 shard_optimizer=job.cfg.plan.shard_optimizer,
                                 expert_load=metrics.get("router_busiest_expert_share", 0.0))
        if self.compiled_last_step:  # this step compiled its programs: time it, do not calibrate on it
            self._compile_step_s = metrics["step_seconds"]
            self._compile_stage_seconds = dict(metrics["stage_seconds"])
            self.compiled_last_step = False
            return
        self._steady_s.append(metrics["step_seconds"])
        self._ran.pop(job.plan, None)
        self._ran[job.plan] = None
        if self.compile_s is None and self._compile_step_s is not None:
            self.compile_s = max(0.0, self._compile_step_s - statistics.median(self._steady_s))
            self.stage_compile_s = compile_by_stage(self._compile_stage_seconds, metrics["stage_seconds"], job.plan)
            if str(ACTOR_GEN) in self.stage_compile_s:  # per engine: each replica compiles its own programs
                self.stage_compile_s[str(ACTOR_GEN)] /= len(job.plan[ACTOR_GEN].replicas)
        seconds = dict(metrics["stage_seconds"])
        seconds["actor-infer"] = seconds.get("actor-infer", 0.0) + seconds.get("weight-sync", 0.0)  # as priced
        ms = self.pricing.measurements(self.pricing.choices(job.plan, self.workload), self.workload, seconds)
        # achieved step latency: async, the wall interval between updates (generation overlapped)
        self._priced_s.append(metrics["step_seconds"] if self.async_mode else sum(m.seconds for m in ms))
        self.pricing.calibrate(ms)

    def plan_changed(self) -> None:
        """The job's plan changed (a move, a recovery): the next step compiles, and the achieved latency
        starts afresh on the new plan."""
        self.compiled_last_step = True
        self._priced_s.clear()

    def achieved_step_s(self) -> float | None:
        """The priced stages' median measured seconds per step on the current plan (None before 3 steps)."""
        return statistics.median(self._priced_s) if len(self._priced_s) >= 3 else None

    def steady_step_s(self) -> float | None:
        """The median measured step time of the recent steps that did not compile (None before one)."""
        return statistics.median(self._steady_s) if self._steady_s else None

    def note_compile_cost(self, compile_cost_s: float, standalone_s: float) -> None:
        """A hidden compile cost the steps ``compile_cost_s`` for ``standalone_s`` priced: on shared compute,
        the contention later moves' compiles are priced with."""
        if standalone_s > 0 and self.cost.hardware.shared_compute:
            self.compile_contention = compile_cost_s / standalone_s

    # ---------------------------------------------------------------------------------- pricing
    def latency(self, plan: ExecutionPlan, obs: Observation | None = None) -> float | None:
        """Predicted step latency of a job plan as the job runs it (``elastic.pricing``); None before the
        first measured workload or for a plan the job's batch cannot be split over."""
        if self.workload is None:
            return None
        try:
            return self.pricing.latency(plan, self.pricing.choices(plan, self.workload), self.workload)
        except (ValueError, KeyError):
            return None

    @property
    def memory_cap_bytes(self) -> float:
        """Usable bytes per device: the cap (cluster.device_memory_bytes or the hardware's) less the headroom."""
        return self.pricing.usable_bytes

    @property
    def trigger_bytes(self) -> float:
        """Predicted peak per device above which the current plan must move (``Pricing.trigger_bytes``)."""
        return self.pricing.trigger_bytes(self.cost.hardware.memory_bytes)

    def peak_bytes(self, plan: ExecutionPlan) -> float | None:
        """Predicted peak bytes per device of a job plan on the observed workload: on each device, the
        resident state of every model-stage there plus the largest working set (they run in turn)."""
        if self.workload is None:
            return None
        return self.pricing.peak_bytes(plan, self.pricing.choices(plan, self.workload), self.workload)

    # ------------------------------------------------------------- candidates (elastic.adapter)
    def planning_workload(self) -> Workload:
        """The last measured step's workload (the config's before one)."""
        return self.workload or Workload.from_config(self.job.cfg)

    def planned(self, obs: Observation, workload: Workload) -> list[ExecutionPlan]:
        """The planner's plans for the job's topology (best and runners-up; async: actor-gen on its own devices)."""
        return [r.plan for r in self._planned(obs, workload)]

    def risk_planned(self, obs: Observation, workload: Workload) -> list[ExecutionPlan]:
        return self._measured_plan(obs, workload)

    def ran_plans(self) -> list[ExecutionPlan]:
        """The plans the job stepped on, oldest first (priced from their remembered measurements)."""
        return list(self._ran)

    def home_plans(self, obs: Observation, workload: Workload) -> list[ExecutionPlan]:
        """The configured layouts on the devices present (none when they do not fit the pool)."""
        try:
            return [plan_from_config(self.job.cfg, device_ids=list(obs.devices))]
        except ConfigError:
            return []

    def execution_plan(self, plan: ExecutionPlan) -> ExecutionPlan:
        return plan

    def with_unit(self, current: ExecutionPlan, best: ExecutionPlan, unit) -> ExecutionPlan:
        return ExecutionPlan({**current, unit: best[unit]})

    def choices_of(self, plan: ExecutionPlan, workload: Workload) -> dict[str, StageChoice] | None:
        try:
            return self.pricing.choices(plan, workload)
        except ValueError:  # dp does not split the batch (a configured plan on another pool)
            return None

    def price(self, plan: ExecutionPlan, choices: Mapping[str, StageChoice], workload: Workload) -> float:
        return self.pricing.latency(plan, choices, workload)

    def plan_peak_bytes(self, plan: ExecutionPlan, choices: Mapping[str, StageChoice], workload: Workload) -> float:
        return self.pricing.peak_bytes(plan, choices, workload)

    def _planned(self, obs: Observation, workload: Workload) -> list[PlanResult]:
        cfg, models = self.job.cfg, self.pricing.models
        try:
            if self.async_mode:
                return self.planner.split(models, cfg.algorithm.name, workload, workload, obs.devices, self.topology)
            result = self.planner.plan(models, cfg.algorithm.name, workload, obs.devices, topology=self.topology)
        except InfeasiblePlanError as e:
            self.log(f"step {obs.step}: the planner found no plan for {len(obs.devices)} devices: {e}")
            return []
        return [result, *result.runners_up]

    def _measured_plan(self, obs: Observation, workload: Workload) -> list[ExecutionPlan]:
        """The planner's best plan with options ranked by seconds plus the uncertainty of extrapolating from
        the layouts the job has measured (``Pricing.risk_adjusted``): the fast plan by what the job knows.
        Empty in async mode or when nothing fits (the adapter asks only once something was measured and the
        planner's best runs a layout the job has not measured: else it is that plan)."""
        if self.async_mode:
            return []
        try:
            return [self.planner.plan(self.pricing.models, self.job.cfg.algorithm.name, workload, obs.devices,
                                      topology=self.topology, options=self._risk_options).plan]
        except InfeasiblePlanError:
            return []

    def _risk_options(self, problem: Problem) -> dict[str, StageOptions]:
        return self.pricing.risk_adjusted(problem.options(), UNCERTAINTY_Z)

    def runnable(self, plan: ExecutionPlan) -> bool:
        """What the job needs beyond time and memory: an engine's replicas each in one process, and async
        generation on devices of its own."""
        if engine_replicas_across_processes(plan):
            return False
        gen = set(plan[ACTOR_GEN].devices)
        return not (self.async_mode and any(gen & set(sp.devices) for ms, sp in plan.items() if ms != ACTOR_GEN))

    # ------------------------------------------------------------------------------ transitions
    def graph(self, old: ExecutionPlan, new: ExecutionPlan) -> TransitionGraph:
        """The transition graph of the move from ``old`` to ``new`` on the hardware's intra-node links."""
        bw, lat = link_bandwidth("intra", self.cost.hardware)
        return TransitionGraph.build(old, new, self.job.specs, caps=self.job.cfg.cluster.device_memory_bytes,
                                     bandwidth=bw, latency=lat)

    def transition_seconds(self, old: ExecutionPlan, new: ExecutionPlan) -> Priced | None:
        """The predicted seconds of the move to ``new`` (ranks aligned to where it starts), with that target
        and its graph, which an admitted decision carries to the move; None when no transition reaches it.
        ``old`` is where the move starts: after a device failure, the survivors' plan (``Observation.moves_from``)."""
        target = align_ranks(old, new)
        try:
            graph = self.graph(old, target)
        except ValueError:
            return None
        compile_s = self.move_compile_s(old, target) if self.cost.hardware.shared_compute else 0.0
        return Priced(self.movement_s(graph) + compile_s * self.compile_contention, target, graph)

    def move_compile_s(self, source: ExecutionPlan, target: ExecutionPlan) -> float:
        """Measured compile seconds of what a move to ``target`` compiles (``Job.prepare`` keeps the programs
        and engines of model-stages whose devices and layout stay): the changed model-stages' share of the
        first step's compile, actor-gen's per engine (every replica compiles its own); the whole plan's
        before the per-stage figures exist."""
        if self.stage_compile_s is None:
            return self.compile_s or 0.0
        total = 0.0
        for ms, sp in target.items():
            if ms in source and source[ms] == sp:
                continue
            per = self.stage_compile_s.get(str(ms), 0.0)
            total += per * len(sp.replicas) if ms == ACTOR_GEN else per
        return total

    def movement_s(self, graph: TransitionGraph) -> float:
        """The graph's predicted data movement (the simulator prices its moves with the same object)."""
        return self.pricing.movement_seconds(graph)

    # ------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """For checkpoints: the calibrated efficiencies and n_1/2, and the compile figures."""
        return {"efficiency": self.cost.efficiency, "compile_s": self.compile_s,
                "compile_by_stage": self.stage_compile_s, "compile_contention": self.compile_contention,
                "half_sizes": dict(self.cost.half_sizes)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.planner.cost_model = self.pricing.cost = CostModel(self.cost.hardware, d["efficiency"],
                                                                d.get("half_sizes"))
        self.compile_s = d["compile_s"]
        self.stage_compile_s = d.get("compile_by_stage")
        self.compile_contention = float(d.get("compile_contention", 1.0))


def compile_by_stage(compiling: Mapping[str, float], steady: Mapping[str, float],
                     plan: ExecutionPlan) -> dict[str, float]:
    """Compile seconds per model-stage of ``plan``: the compiling step's seconds of each timed stage less a
    steady step's. A scoring stage runs on its role's training (or only) model-stage (``actor-infer`` on
    ``actor-train``'s programs); stages of no model-stage (the host reward, the weight sync) are left out."""
    out: dict[str, float] = {}
    for name, seconds in compiling.items():
        role, _, kind = name.rpartition("-")
        owners = [ms for ms in plan if ms.role == role and (ms.kind == kind or (kind != "gen" and ms.kind != "gen"))]
        if len(owners) == 1:
            key = str(owners[0])
            out[key] = out.get(key, 0.0) + max(0.0, seconds - steady.get(name, 0.0))
    return out


__all__ = ["JobPricer", "compile_by_stage", "partial_moves"]  # partial_moves: elastic.adapter's, for the tests
