"""Adapting the running job: the controller asked at every step boundary, admitted transitions executed.

    adapter = Adapter(job, log=print)
    for step in range(steps):
        adapter.boundary(step, last_metrics)   # pool changes, re-plan, compile ahead, transition
        last_metrics = job.step(step).metrics

At each boundary, in order:

1. Calibration: the previous step's measured stage seconds refit the cost model's efficiencies
   (``CostModel.observe`` over a window of recent steps; steps that compiled are left out).
2. The device pool: ``cluster.schedule`` changes take effect at their step; a leave with ``notice`` > 0
   is announced ``notice`` steps early, and the controller plans without those devices from then on.
   A leave is graceful (the device stays readable until its step, as with a preemption notice); an
   abrupt loss in the middle of a step (:meth:`Adapter.lose`) takes the same urgent path, with the move
   starting from the units that survived, and restores the last checkpoint only when no live move exists.
3. A pending transition whose programs are compiled is executed now: the executor's data movement and
   the switch to the new engines are the whole pause. The move is the graph the decision was priced
   with, run by :func:`nereus_jax.runtime.move.move` (the job holds none of the moved units meanwhile);
   one that fails leaves the job on its plan with its state. If a device the plan uses leaves at this step,
   the boundary waits for the compile (an urgent move cannot be deferred).
4. Otherwise the controller observes the step (response length, step time, pool) and may re-plan. An
   admitted target is compiled ahead on a background thread (``Job.prepare``) while the current plan
   keeps stepping; the move happens at the first boundary after the compile finishes.

With several processes every process runs the same adapter and must take the same decisions: the
measured inputs (step and stage seconds, lengths) are process 0's, shared at each boundary, and a
compile-ahead counts as finished when it has finished on every process.

Candidates come from the planner for the pool at hand; each is mapped to the job's model-stages
(actor-infer and critic-infer run on the training units, so they are priced with the training stage's
layout) and priced with the calibrated cost model. A transition's predicted cost is the transition
graph's makespan on the hardware's links; on shared-compute hardware (cpu) the compile competes with
the steps for the same cores (and the interpreter), so the compile a move needs is added to it: the
first step's measured compile time of each model-stage whose devices or layout change (actor-gen's per
engine), times the steps' measured loss per compile-second at the last hidden compile
(``compile_contention``, 1 before one). On GPUs the compile runs on host cores while the devices step,
and is hidden. Besides the planner's plans, the current plan with one model-stage moved to its place in
the best plan is a candidate (``partial_moves``): a cheaper transition that may keep most of the gain;
so is every plan the job has run on devices it still has, priced from its remembered measurements
(``Pricing.residual``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from nereus_jax.config import ConfigError
from nereus_jax.elastic.controller import Candidate, Controller, Decision, Observation, Priced
from nereus_jax.elastic.costs import CostModel, link_bandwidth
from nereus_jax.elastic.executor import TransitionFailed
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.elastic.planner import InfeasiblePlanError, Planner, PlanResult
from nereus_jax.elastic.pricing import CALIBRATION_WINDOW
from nereus_jax.elastic.recipe import align_ranks
from nereus_jax.elastic.workload import LengthStats, Workload
from nereus_jax.model_stage import ACTOR_GEN
from nereus_jax.runtime.distributed import agree, all_processes
from nereus_jax.runtime.initial_plan import job_pricing, plan_from_config
from nereus_jax.runtime.job import Job, Prepared, engine_replicas_across_processes
from nereus_jax.runtime.move import MoveError, move
from nereus_jax.runtime.pool import DevicePool
from nereus_jax.runtime.recovery import Recovery, recover_from_device_loss, restore_after_loss, surviving_state

_MEASURED = ("step_seconds", "stage_seconds", "response_length_mean", "response_length_p95")  # clock/length reads
_MISMATCH = ("mismatch_kl", "mismatch_ratio_max", "mismatch_outside_fraction")  # logged before/after a move


class LiveTransitionError(RuntimeError):
    """Devices the plan uses are gone and no live transition exists: checkpoint/restart is the way on."""


@dataclasses.dataclass
class _Pending:
    decision: Decision
    target: ExecutionPlan  # ranks aligned to the job's plan
    graph: TransitionGraph  # job.plan -> target: the graph the move was priced with, run as it is
    future: concurrent.futures.Future
    started: float
    step: int
    steady_s: float | None  # median step time before the compile started
    step_seconds: list[float] = dataclasses.field(default_factory=list)  # steps run while compiling
    wait: bool = False  # move at the next boundary even if that means waiting for the compile


class Adapter:
    """The controller in the job's loop: observes every step, re-plans, compiles ahead, moves the state."""

    def __init__(self, job: Job, log: Callable[[str], None] = print):
        self.job, self.log = job, log
        cfg = job.cfg
        self.enabled = cfg.controller.enabled
        self.pricing = job_pricing(cfg)
        self.cost, self.topology = self.pricing.cost, self.pricing.topology
        self.planner = Planner(self.cost, headroom=cfg.controller.memory_headroom)
        self.device_pool = DevicePool(range(cfg.cluster.num_devices), cfg.cluster.schedule, log)
        self.controller = Controller(self._candidates, self._latency, self._transition_seconds,
                                     gamma=cfg.controller.gamma, length_drift=cfg.controller.length_drift,
                                     devices=self.pool, error_margin=cfg.controller.error_margin)
        self.events: list[dict[str, Any]] = []  # decisions and transitions, for the run's log
        self.transitions = 0
        self.pending: _Pending | None = None
        self._compiled_last_step = True  # the first step compiles everything
        self._compile_s: float | None = None  # measured compile time of a whole plan
        self._compile_step_s: float | None = None
        self._compile_stage_seconds: dict[str, float] = {}  # the compiling step's seconds per stage
        # measured compile seconds per model-stage (its programs, or its engines for actor-gen): a move pays
        # for the model-stages whose devices or layout change; the others keep their compiled programs
        self._compile_by_stage: dict[str, float] | None = None
        # on shared compute: step seconds lost per second of a compile ahead (measured at each hidden compile;
        # 1 until then: the compile counted whole)
        self.compile_contention = 1.0
        self._ran: dict[ExecutionPlan, None] = {}  # plans the job has stepped on, oldest first: candidates again
        self._steady_s: collections.deque[float] = collections.deque(maxlen=CALIBRATION_WINDOW)
        # the priced stages' measured seconds per step (since the last plan change), for the efficiency
        # trigger: their median over a few steps, because single steps on a shared host are noisy
        self._priced_s: collections.deque[float] = collections.deque(maxlen=5)
        self._workload: Workload | None = None
        self._pool_ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nereus-compile")
        self.async_mode = cfg.trainer.mode == "async"
        self._before_move: list[Callable[[], None]] = []  # run before state moves (async: pause generation)
        self._mismatch: dict[str, float] = {}  # the last step's rollout/train mismatch
        self._after_move: dict[str, Any] | None = None  # a transition event awaiting the mismatch after it
        self._length: float | None = None  # the last measured mean response length (for a recovery's observation)
        # during a device-loss recovery: (the job's plan, the plan of its surviving units or None when they are
        # not one consistent state); moves out of that plan start from the survivors
        self._failed: tuple[ExecutionPlan, ExecutionPlan | None] | None = None

    @property
    def pool(self) -> tuple[int, ...]:
        """The device ids the job may use now (``DevicePool``)."""
        return self.device_pool.devices

    # ------------------------------------------------------------------------------ the boundary
    def boundary(self, step: int, metrics: dict[str, Any] | None) -> None:
        """Run before ``step``; ``metrics`` are the previous step's (None before the first step)."""
        compiled = self._compiled_last_step  # the previous step compiled programs: its time is not a step's
        if metrics is not None:
            metrics = {**metrics, **agree({k: metrics[k] for k in _MEASURED if k in metrics})}
            self._length = metrics["response_length_mean"]
            self._learn(metrics)
            self._note_mismatch(step, metrics)
        gone = self.device_pool.apply(step)
        if not self.enabled:
            if gone & set(self.job.plan.devices):
                raise RuntimeError(f"step {step}: devices {sorted(gone)} leave but controller.enabled=false: "
                                   "enable the controller to move the state off them")
            return
        if self.pending is not None and gone & set(self.pending.target.devices):
            self.pending.future.result()  # planned before this loss: discard it and re-plan below
            self.log(f"step {step}: devices {sorted(gone)} left before the admitted move ran; re-planning")
            self.pending = None
            self.controller.forget_move()
        if self.pending is not None:
            ready = all_processes(self.pending.future.done())
            if ready or self.pending.wait or gone & set(self.job.plan.devices):
                self._execute(step, self.pending)
            elif metrics is not None:
                self.pending.step_seconds.append(metrics["step_seconds"])
            return
        if metrics is None and not gone:
            return
        achieved = statistics.median(self._priced_s) if len(self._priced_s) >= 3 and not compiled else None
        obs = Observation(step=step, plan=self.job.plan, devices=self.device_pool.planning(step),
                          response_length=metrics["response_length_mean"] if metrics else (self._ref_length() or 1.0),
                          step_seconds=achieved, peak_memory_bytes=self.peak_bytes(self.job.plan),
                          memory_cap_bytes=self.pricing.trigger_bytes(self.cost.hardware.memory_bytes),
                          steps_left=max(1, self.job.cfg.trainer.steps - step))
        checked = len(self.controller.move_checks)
        decision = self.controller.observe(obs)
        for check in self.controller.move_checks[checked:]:
            self.log(_check_line(check))
        if decision is not None:
            self._log_decision(decision)
        if (decision is None or not decision.admitted) and gone & set(self.job.plan.devices):
            why = decision.reason if decision is not None else "the move planned at its announcement was not admitted"
            raise LiveTransitionError(
                f"step {step}: devices {sorted(gone)} left and no live transition reaches a plan without them "
                f"({why}); restart from the last checkpoint on the remaining devices (checkpoint.resume_from=...)")
        if decision is None:
            return
        if decision.admitted:
            target, graph = self._priced_move(decision)
            steady = statistics.median(self._steady_s) if self._steady_s else None
            # an urgent move (memory, devices) runs at the next boundary even if it must wait for the compile:
            # stepping on while the plan is predicted not to fit would risk an out-of-memory error
            pending = _Pending(decision, target, graph, self._pool_ex.submit(self.job.prepare, target),
                               time.perf_counter(), step, steady, wait=decision.urgent)
            self.pending = pending
            if gone & set(self.job.plan.devices):  # the device is gone now: no time to compile ahead
                self._execute(step, pending)

    def on_before_move(self, listener: Callable[[], None]) -> None:
        """Calls ``listener`` at every move, after its compile and before any state moves (the async runner
        pauses generation there, so no engine reads parameters being moved)."""
        self._before_move.append(listener)

    def request(self, plan: ExecutionPlan, *, wait: bool = True, reason: str = "requested") -> None:
        """Moves the job to ``plan`` (an operator's or a test's choice, not the controller's): compiled
        ahead from now on, executed at the next boundary (``wait``: even if that waits for the compile)
        or at the first boundary after the compile finishes. Replaces a pending move. A plan no transition
        reaches (a layout the model cannot take, caps it cannot fit) raises here, naming it, with nothing
        changed."""
        target = align_ranks(self.job.plan, plan)
        graph = self._graph(self.job.plan, target)
        self.job.check_plan(target)
        decision = Decision(step=-1, trigger="request", urgent=True, target=target, admitted=True, reason=reason,
                            current_latency_s=None, target_latency_s=None, horizon=1.0, move=graph)
        if self.pending is not None:
            self.pending.future.cancel()
        self.controller.forget_move()  # the next plan change is this request, not the controller's last move
        steady = statistics.median(self._steady_s) if self._steady_s else None
        self.pending = _Pending(decision, target, graph, self._pool_ex.submit(self.job.prepare, target),
                                time.perf_counter(), -1, steady, wait=wait)
        self.log(f"transition requested ({reason}) -> {_short(target)}")

    def lose(self, devices, step: int, before: dict[str, int], checkpoint_dir: str | None) -> Recovery:
        """Recovers from ``devices`` failing during ``step`` (``before``: ``training_snapshot`` at its start)
        and returns how (the job to run from now on is ``self.job`` = the recovery's job). The devices leave
        the pool for good and a pending move is dropped (it may target them). With the controller on, the
        recovery takes the path of a device leaving with notice: the controller observes the pool without
        the failed devices (an urgent trigger) and picks its target among the same candidates, priced from
        the units that survived; the admitted move runs like any other (``move``). The last checkpoint is
        restored, onto the controller's target (or its best candidate), only when no live move exists:
        no consistent copy of every model-stage survived, or no transition reaches a candidate, or the move
        failed. With the controller off, or not yet calibrated (no candidate), the config's plan on the
        survivors is the target. The next step's programs compile (its time is not a step's)."""
        lost = {int(d) for d in devices}
        if self.pending is not None:
            self.pending.future.cancel()
            self.pending = None
            self.controller.forget_move()
        job = self.job
        self.device_pool.remove(lost)
        rec = self._recover(job, lost, step, before, checkpoint_dir) if self.enabled else None
        if rec is None:
            rec = recover_from_device_loss(job, lost, step, before, checkpoint_dir)
            self.controller.devices = self.device_pool.planning(step)  # re-planned for this pool already
        self.events.append({"event": "recovery", "step": step, "lost": sorted(lost), "how": rec.how,
                            "reason": rec.reason, "plan": _short(rec.job.plan)})
        self.job = rec.job
        self._compiled_last_step = True
        self._priced_s.clear()
        return rec

    def _recover(self, job: Job, lost: set[int], step: int, before: dict[str, int],
                 checkpoint_dir: str | None) -> Recovery | None:
        """The controller's urgent path after a failure (see :meth:`lose`); None: it has no candidate."""
        left, reason = surviving_state(job, lost, step, before)
        obs = Observation(step=step, plan=job.plan, devices=self.device_pool.planning(step),
                          response_length=self._length or self._ref_length() or 1.0,
                          peak_memory_bytes=self.peak_bytes(job.plan),
                          memory_cap_bytes=self.pricing.trigger_bytes(self.cost.hardware.memory_bytes),
                          steps_left=max(1, job.cfg.trainer.steps - step))
        self._failed = (job.plan, left)
        try:
            decision = self.controller.observe(obs)
        finally:
            self._failed = None
        if decision is not None:
            self._log_decision(decision)
        if decision is not None and decision.admitted and left is not None:
            try:
                graph = decision.move
                if not (isinstance(graph, TransitionGraph) and graph.old_plan == left):  # priced without a graph
                    graph = self._graph(left, align_ranks(left, decision.target))
                moved = move(job, graph)
            except (TransitionFailed, MoveError, ValueError) as e:  # ValueError: Infeasible, a plan it cannot run
                self.controller.forget_move()
                reason = f"{reason}, but the live move failed ({type(e).__name__}: {e})"
                return restore_after_loss(job, decision.target, step, reason, checkpoint_dir)
            self.transitions += 1
            self.log(f"step {step}: recovery move -> {_short(moved.plan)}: data movement {moved.movement_s:.3g} s, "
                     f"switch {moved.switch_s:.3g} s")
            return Recovery(job, "survivors", step, f"{reason}; moved to the controller's urgent target")
        if left == job.plan:  # the failed devices held none of the job's units: nothing needs to move
            return Recovery(job, "survivors", step, f"{reason}; none of them held the job's state")
        if decision is None or not decision.rejected:
            return None  # no candidate (e.g. not calibrated yet): the config's plan on the survivors
        reason = reason if left is None else f"{reason}, but no live transition reaches a candidate"
        return restore_after_loss(job, decision.rejected[0][0], step, reason, checkpoint_dir)

    def close(self) -> None:
        """Stops taking work; a compile still running finishes in the background (its result is unused)."""
        self._pool_ex.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------- execution
    def _execute(self, step: int, pending: _Pending) -> None:
        t0 = time.perf_counter()
        waited = not pending.future.done()
        prepared: Prepared = pending.future.result()
        standalone = self._move_compile_s(self.job.plan, pending.target)  # the compile as priced (uncontended)
        for listener in self._before_move:
            listener()
        t1 = time.perf_counter()
        self.pending = None
        try:  # the job holds none of the moved units meanwhile: what the executor frees is free
            moved = move(self.job, pending.graph, prepared=prepared)
        except TransitionFailed as failed:  # the job has its state back, on its plan
            self.controller.forget_move()
            self.events.append({"event": "transition_failed", "step": step, "trigger": pending.decision.trigger,
                                "plan": _short(pending.target), "error": str(failed)})
            self.log(f"step {step}: transition -> {_short(pending.target)} failed; the job stays on its plan: {failed}")
            leaving = set(self.job.plan.devices) - set(self.pool)
            if leaving:
                raise LiveTransitionError(
                    f"step {step}: devices {sorted(leaving)} left and the live transition off them failed "
                    f"({failed}); restart from the last checkpoint on the remaining devices "
                    "(checkpoint.resume_from=...)") from failed
            return
        t3 = time.perf_counter()
        graph = pending.graph
        self._priced_s.clear()
        self.transitions += 1
        self._compiled_last_step = True
        overlapped = pending.step_seconds
        slowdown = statistics.median(overlapped) / pending.steady_s if overlapped and pending.steady_s else None
        # what the compile cost the steps: their time past the steady step, plus any wait for it at the boundary
        compile_cost = None
        if pending.steady_s and not pending.decision.urgent:
            compile_cost = sum(max(0.0, s - pending.steady_s) for s in overlapped) + (t1 - t0)
            if standalone > 0 and self.cost.hardware.shared_compute:
                self.compile_contention = compile_cost / standalone
        event = {"event": "transition", "step": step, "trigger": pending.decision.trigger,
                 "admitted_at_step": pending.step, "pause_s": t3 - t0, "wait_for_compile_s": t1 - t0,
                 "movement_s": moved.movement_s, "switch_s": moved.switch_s, "compile_s": prepared.seconds,
                 "compile_hidden": not waited, "steps_during_compile": len(overlapped),
                 "step_slowdown_during_compile": slowdown, "compile_cost_s": compile_cost,
                 "predicted_compile_s": standalone, "compile_contention": self.compile_contention,
                 "predicted_transition_s": pending.decision.transition_s,
                 "predicted_movement_s": self._movement_s(graph), "plan": _short(pending.target),
                 **{f"{k}_before": v for k, v in self._mismatch.items()}}
        self.events.append(event)
        self._after_move = event
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        self.log(f"step {step}: transition -> {event['plan']}: pause {event['pause_s']:.3g} s = data movement "
                 f"{event['movement_s']:.3g} s (predicted {event['predicted_movement_s']:.3g}) + switch "
                 f"{event['switch_s']:.3g} s + waiting for compile {event['wait_for_compile_s']:.3g} s; compile "
                 f"{prepared.seconds:.1f} s "
                 f"{'hidden behind ' + str(len(overlapped)) + ' steps' if not waited else 'NOT hidden'} "
                 f"(those steps ran {fmt(slowdown)}x the steady step time; the compile cost the job "
                 f"{fmt(compile_cost)} s for {standalone:.3g} s of compile priced)")

    def _note_mismatch(self, step: int, metrics: dict[str, Any]) -> None:
        """The rollout/train mismatch of the step before a move goes into its transition event; the first
        step after it completes the event and logs both, so a user sees what the new layout did."""
        self._mismatch = {k: float(metrics[k]) for k in _MISMATCH if k in metrics}
        event, self._after_move = self._after_move, None
        if event is None or not self._mismatch:
            return
        event.update({f"{k}_after": v for k, v in self._mismatch.items()})
        shown = ", ".join(f"{k} {event.get(k + '_before', float('nan')):.3g} -> {v:.3g}"
                          for k, v in self._mismatch.items())
        self.log(f"step {step - 1}: rollout/train mismatch across the transition at step {event['step']}: {shown}")

    def _graph(self, old: ExecutionPlan, new: ExecutionPlan) -> TransitionGraph:
        bw, lat = link_bandwidth("intra", self.cost.hardware)
        return TransitionGraph.build(old, new, self.job.specs, caps=self.job.cfg.cluster.device_memory_bytes,
                                     bandwidth=bw, latency=lat)

    def _priced_move(self, decision: Decision) -> tuple[ExecutionPlan, TransitionGraph]:
        """The admitted target (ranks aligned) and the graph it was priced with; built here only when the
        controller priced it without one (a transition function that answers in seconds)."""
        graph = decision.move
        if isinstance(graph, TransitionGraph) and graph.old_plan == self.job.plan:
            return decision.target, graph
        target = align_ranks(self.job.plan, decision.target)
        return target, self._graph(self.job.plan, target)

    def _live_source(self, plan: ExecutionPlan) -> ExecutionPlan | None:
        """The plan a move out of ``plan`` starts from: ``plan`` itself, or during a device-loss recovery
        the job's surviving units (None: they are not one consistent state, so no live move exists)."""
        if self._failed is not None and plan == self._failed[0]:
            return self._failed[1]
        return plan

    # --------------------------------------------------------------------------- calibration
    def _learn(self, metrics: dict[str, Any]) -> None:
        job = self.job
        # padded programs run every row at R; packed ones at the lengths the next step's budget allows
        budget = job.response_budget(metrics["step"] + 1) if job.cfg.trainer.packing else job.R
        mean = min(max(1.0, metrics["response_length_mean"]), budget)
        p95 = min(max(mean, metrics.get("response_length_p95", mean)), budget)
        self._workload = Workload(job.cfg.trainer.prompts_per_step, LengthStats.fixed(job.P),
                                  LengthStats(mean, p95, budget), job.n,
                                  packed=job.cfg.trainer.packing,  # packed: FLOPs follow the mean length
                                  mini_batches=job.cfg.trainer.mini_batches, epochs=job.cfg.trainer.ppo_epochs,
                                  pipeline_schedule=job.cfg.trainer.pipeline_schedule)
        if self._compiled_last_step:  # this step compiled its programs: time it, do not calibrate on it
            self._compile_step_s = metrics["step_seconds"]
            self._compile_stage_seconds = dict(metrics["stage_seconds"])
            self._compiled_last_step = False
            return
        self._steady_s.append(metrics["step_seconds"])
        self._ran.pop(job.plan, None)
        self._ran[job.plan] = None
        if self._compile_s is None and self._compile_step_s is not None:
            self._compile_s = max(0.0, self._compile_step_s - statistics.median(self._steady_s))
            self._compile_by_stage = compile_by_stage(self._compile_stage_seconds, metrics["stage_seconds"],
                                                      job.plan)
            if str(ACTOR_GEN) in self._compile_by_stage:  # per engine: each replica compiles its own programs
                self._compile_by_stage[str(ACTOR_GEN)] /= len(job.plan[ACTOR_GEN].replicas)
        seconds = dict(metrics["stage_seconds"])
        seconds["actor-infer"] = seconds.get("actor-infer", 0.0) + seconds.get("weight-sync", 0.0)  # as priced
        ms = self.pricing.measurements(self.pricing.choices(job.plan, self._workload), self._workload, seconds)
        # achieved step latency: async, the wall interval between updates (generation overlapped)
        self._priced_s.append(metrics["step_seconds"] if self.async_mode else sum(m.seconds for m in ms))
        self.pricing.calibrate(ms)

    def _ref_length(self) -> float | None:
        return self.controller.reference_length

    # ---------------------------------------------------------------------------------- pricing
    def _latency(self, plan: ExecutionPlan, obs: Observation | None = None) -> float | None:
        """Predicted step latency of a job plan as the job runs it (``elastic.pricing``); None before the
        first measured workload or for a plan the job's batch cannot be split over."""
        if self._workload is None:
            return None
        try:
            return self.pricing.latency(plan, self.pricing.choices(plan, self._workload), self._workload)
        except (ValueError, KeyError):
            return None

    @property
    def memory_cap_bytes(self) -> float:
        """Usable bytes per device: the cap (cluster.device_memory_bytes or the hardware's) less the headroom."""
        return self.pricing.usable_bytes

    def peak_bytes(self, plan: ExecutionPlan) -> float | None:
        """Predicted peak bytes per device of a job plan on the observed workload: on each device, the
        resident state of every model-stage there plus the largest working set (they run in turn)."""
        if self._workload is None:
            return None
        return self.pricing.peak_bytes(plan, self.pricing.choices(plan, self._workload), self._workload)

    def _candidates(self, obs: Observation) -> list[Candidate]:
        """The planner's plans for the job's topology (best and runners-up; async: actor-gen on its own
        devices) and the configured layouts on the pool, fastest first. The planner prices and checks
        memory as the job does (``elastic.pricing``), so its plans fit; a plan the job cannot run across
        processes, or a configured one that does not fit, is left out."""
        workload = self._workload or Workload.from_config(self.job.cfg)
        plans = [r.plan for r in self._planned(obs, workload)]
        if plans:
            plans += partial_moves(obs.plan, plans[0])
        # plans the job ran on devices it still has: the per-layout memory prices them as measured
        plans += [p for p in self._ran if set(p.devices) <= set(obs.devices)]
        with contextlib.suppress(ConfigError):  # the configured layouts on the devices present: a candidate
            plans.append(plan_from_config(self.job.cfg, device_ids=list(obs.devices)))
        try:
            current = self.pricing.features(self.pricing.choices(obs.plan, workload), workload)
        except ValueError:  # the current plan cannot split this batch: nothing to compare a gain against
            current = None
        out: dict[ExecutionPlan, Candidate] = {}
        for plan in plans:
            if plan in out or not self._runnable(plan):
                continue
            try:
                choices = self.pricing.choices(plan, workload)
            except ValueError:  # dp does not split the batch (a configured plan on another pool)
                continue
            if self.pricing.peak_bytes(plan, choices, workload) <= self.memory_cap_bytes:
                sd = 0.0 if current is None else self.pricing.gain_sd(current, choices, workload)
                out[plan] = Candidate(plan, self.pricing.latency(plan, choices, workload), sd)
        return sorted(out.values(), key=lambda c: c.step_latency_s)

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

    def _runnable(self, plan: ExecutionPlan) -> bool:
        """What the job needs beyond time and memory: an engine's replicas each in one process, and async
        generation on devices of its own."""
        if engine_replicas_across_processes(plan):
            return False
        gen = set(plan[ACTOR_GEN].devices)
        return not (self.async_mode and any(gen & set(sp.devices) for ms, sp in plan.items() if ms != ACTOR_GEN))

    def _transition_seconds(self, old: ExecutionPlan, new: ExecutionPlan) -> Priced | None:
        """The predicted seconds of the move to ``new`` (ranks aligned to where it starts), with that target
        and its graph, which an admitted decision carries to the move; None when no transition reaches it."""
        source = self._live_source(old)
        if source is None:
            return None
        target = align_ranks(source, new)
        try:
            graph = self._graph(source, target)
        except ValueError:
            return None
        compile_s = self._move_compile_s(source, target) if self.cost.hardware.shared_compute else 0.0
        return Priced(self._movement_s(graph) + compile_s * self.compile_contention, target, graph)

    def _move_compile_s(self, source: ExecutionPlan, target: ExecutionPlan) -> float:
        """Measured compile seconds of what a move to ``target`` compiles (``Job.prepare`` keeps the programs
        and engines of model-stages whose devices and layout stay): the changed model-stages' share of the
        first step's compile, actor-gen's per engine (every replica compiles its own); the whole plan's
        before the per-stage figures exist."""
        if self._compile_by_stage is None:
            return self._compile_s or 0.0
        total = 0.0
        for ms, sp in target.items():
            if ms in source and source[ms] == sp:
                continue
            per = self._compile_by_stage.get(str(ms), 0.0)
            total += per * len(sp.replicas) if ms == ACTOR_GEN else per
        return total

    def _movement_s(self, graph: TransitionGraph) -> float:
        """The graph's predicted data movement (the simulator prices its moves with the same object)."""
        return self.pricing.movement_seconds(graph)

    # ------------------------------------------------------------------------------------ log
    def _log_decision(self, d: Decision) -> None:
        event = {"event": "decision", "step": d.step, "trigger": d.trigger, "urgent": d.urgent,
                 "admitted": d.admitted, "reason": d.reason, "current_latency_s": d.current_latency_s,
                 "target_latency_s": d.target_latency_s, "gain_s": d.gain_s,
                 "predicted_transition_s": d.transition_s, "horizon": d.horizon,
                 "target": _short(d.target) if d.target is not None else None,
                 "rejected": [[_short(p), why] for p, why in d.rejected]}
        self.events.append(event)
        self.log(d.log_line() + (f" -> {event['target']}" if d.target is not None else ""))
        for plan, why in d.rejected:
            self.log(f"    rejected {_short(plan)}: {why}")

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints: the controller's state (references, horizons, pool, efficiency window) and the
        adapter's (pool, calibrated efficiencies, compile time, transitions)."""
        return {**self.controller.state_dict(), "pool": list(self.pool), "efficiency": self.cost.efficiency,
                "compile_s": self._compile_s, "compile_by_stage": self._compile_by_stage,
                "compile_contention": self.compile_contention,
                "half_sizes": dict(self.cost.half_sizes), "transitions": self.transitions}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.controller.load_state_dict(d)
        self.device_pool.devices = tuple(d["pool"])
        self.cost = CostModel(self.cost.hardware, d["efficiency"], d.get("half_sizes"))
        self.planner.cost_model = self.pricing.cost = self.cost
        self._compile_s, self.transitions = d["compile_s"], d["transitions"]
        self._compile_by_stage = d.get("compile_by_stage")
        self.compile_contention = float(d.get("compile_contention", 1.0))


def partial_moves(current: ExecutionPlan, best: ExecutionPlan) -> list[ExecutionPlan]:
    """The current plan with one model-stage moved to its place in ``best``, for every model-stage that
    ``best`` moves: cheaper transitions (fewer arrays to move, fewer programs to compile) that may keep
    most of the gain. None when the two plans do not hold the same model-stages."""
    if set(current) != set(best):
        return []
    return [ExecutionPlan({**current, ms: best[ms]}) for ms in best if best[ms] != current[ms]]


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


def _short(plan: ExecutionPlan) -> str:
    return " ".join(f"{ms}:{sp.layout}x{sp.dp}@{','.join(map(str, sp.devices))}" for ms, sp in plan.items())


def _check_line(check: dict) -> str:
    """One log line: the first measured step after a move against the latency and uncertainty it was
    admitted with."""
    verdict = ("within the uncertainty it was admitted with" if check["within"]
               else f"OUTSIDE the uncertainty it was admitted with, by {check['outside_by_s']:.3g} s")
    return (f"step {check['step']}: first step after the move took {check['measured_s']:.3g} s, predicted "
            f"{check['predicted_s']:.3g} +- {check['uncertainty_s']:.3g} s: {verdict}")
