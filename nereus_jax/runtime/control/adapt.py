"""Adapting the running job: the controller asked at every step boundary, admitted transitions executed.

    adapter = Adapter(job, log=print)
    for step in range(steps):
        adapter.boundary(step, last_metrics)   # pool changes, re-plan, compile ahead, transition
        last_metrics = job.step(step).metrics

At each boundary, in order:

1. Calibration: the previous step's measured stage seconds refit the cost model's efficiencies
   (``JobPricer.learn``: ``CostModel.observe`` over a window of recent steps; steps that compiled are left out).
2. The device pool: ``cluster.schedule`` changes take effect at their step; a leave with ``notice`` > 0
   is announced ``notice`` steps early, and the controller plans without those devices from then on.
   A leave is graceful (the device stays readable until its step, as with a preemption notice); an
   abrupt loss in the middle of a step (:meth:`Adapter.lose`) takes the same urgent path, with the move
   starting from the units that survived, and restores the last checkpoint only when no live move exists.
3. A pending transition whose programs are compiled is executed now: the executor's data movement and
   the switch to the new engines are the whole pause. The move is the graph the decision was priced
   with, run by :func:`nereus_jax.runtime.step.move.move` (the job holds none of the moved units meanwhile);
   one that fails leaves the job on its plan with its state. If a device the plan uses leaves at this step,
   the boundary waits for the compile (an urgent move cannot be deferred).
4. Otherwise the controller observes the step (response length, step time, pool) and may re-plan. An
   admitted target is compiled ahead on a background thread (``Job.prepare``) while the current plan
   keeps stepping; the move happens at the first boundary after the compile finishes.

With several processes every process runs the same adapter and must take the same decisions: the
measured inputs (step and stage seconds, lengths) are process 0's, shared at each boundary, and a
compile-ahead counts as finished when it has finished on every process.

Prices (step latency, peak memory, candidates, transition seconds) and the calibration they rest on
are :class:`~nereus_jax.runtime.control.job_pricer.JobPricer`'s: the adapter owns one, feeds it each step's
measurements and hands its methods to the :class:`~nereus_jax.elastic.controller.Controller`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from nereus_jax.elastic.controller import Controller, Decision, Observation
from nereus_jax.elastic.executor import TransitionFailed
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.elastic.recipe import align_ranks
from nereus_jax.runtime.control.job_pricer import JobPricer
from nereus_jax.runtime.control.pool import DevicePool
from nereus_jax.runtime.control.recovery import Recovery, recover
from nereus_jax.runtime.platform.distributed import agree, all_processes
from nereus_jax.runtime.step.job import Job, Prepared
from nereus_jax.runtime.step.move import move

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
        self.pricer = JobPricer(job, log)  # measurements and prices; the controller calls back into it
        self.device_pool = DevicePool(range(cfg.cluster.num_devices), cfg.cluster.schedule, log)
        self.controller = Controller(self.pricer.candidates, self.pricer.latency, self.pricer.transition_seconds,
                                     gamma=cfg.controller.gamma, length_drift=cfg.controller.length_drift,
                                     devices=self.pool, error_margin=cfg.controller.error_margin)
        self.events: list[dict[str, Any]] = []  # decisions and transitions, for the run's log
        self.transitions = 0
        self.pending: _Pending | None = None
        self._pool_ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nereus-compile")
        self._before_move: list[Callable[[], None]] = []  # run before state moves (async: pause generation)
        self._mismatch: dict[str, float] = {}  # the last step's rollout/train mismatch
        self._after_move: dict[str, Any] | None = None  # a transition event awaiting the mismatch after it

    @property
    def pool(self) -> tuple[int, ...]:
        """The device ids the job may use now (``DevicePool``)."""
        return self.device_pool.devices

    # ------------------------------------------------------------------------------ the boundary
    def boundary(self, step: int, metrics: dict[str, Any] | None) -> None:
        """Run before ``step``; ``metrics`` are the previous step's (None before the first step)."""
        compiled = self.pricer.compiled_last_step  # the previous step compiled programs: its time is not a step's
        if metrics is not None:
            metrics = {**metrics, **agree({k: metrics[k] for k in _MEASURED if k in metrics})}
            self.pricer.learn(metrics)
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
        achieved = None if compiled else self.pricer.achieved_step_s()
        length = metrics["response_length_mean"] if metrics else (self.controller.reference_length or 1.0)
        obs = self._observation(step, self.job, length, achieved,
                                metrics.get("router_busiest_expert_share") if metrics else None)
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
            steady = self.pricer.steady_step_s()
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
        graph = self.pricer.graph(self.job.plan, target)
        self.job.check_plan(target)
        decision = Decision(step=-1, trigger="request", urgent=True, target=target, admitted=True, reason=reason,
                            current_latency_s=None, target_latency_s=None, horizon=1.0, move=graph)
        if self.pending is not None:
            self.pending.future.cancel()
        self.controller.forget_move()  # the next plan change is this request, not the controller's last move
        steady = self.pricer.steady_step_s()
        self.pending = _Pending(decision, target, graph, self._pool_ex.submit(self.job.prepare, target),
                                time.perf_counter(), -1, steady, wait=wait)
        self.log(f"transition requested ({reason}) -> {_short(target)}")

    def lose(self, devices, step: int, before: dict[str, int], checkpoint_dir: str | None) -> Recovery:
        """Recovers the job in place from ``devices`` failing during ``step`` (``before``: ``training_snapshot``
        at its start) through the one policy, :func:`nereus_jax.runtime.control.recovery.recover`, and returns how. The
        devices leave the pool for good and a pending move is dropped (it may target them). With the controller
        on, the decision is the path of a device leaving with notice: the controller observes the pool without
        the failed devices (an urgent trigger), its moves priced from the units that survived (the survivors'
        plan is part of the observation), and picks its target among the same candidates; the last checkpoint is
        restored onto that target only when no live move exists. With the controller off, or not yet
        calibrated (no candidate), the config's plan on the survivors is the target. The next step's programs
        compile (its time is not a step's)."""
        lost = {int(d) for d in devices}
        if self.pending is not None:
            self.pending.future.cancel()
            self.pending = None
            self.controller.forget_move()
        self.device_pool.remove(lost)
        decided = []

        def decide(survivors: ExecutionPlan | None) -> Decision | None:
            length = self.pricer.response_length or self.controller.reference_length or 1.0
            obs = dataclasses.replace(self._observation(step, self.job, length), failed=True, survivors=survivors)
            decision = self.controller.observe(obs)
            if decision is not None:
                self._log_decision(decision)
            decided.append(decision)
            return decision

        rec = recover(self.job, lost, step, before, checkpoint_dir, decide=decide if self.enabled else None)
        if not self.enabled or (decided and (decided[0] is None or not (decided[0].admitted or decided[0].rejected))):
            self.controller.devices = self.device_pool.planning(step)  # re-planned for this pool already
        if rec.how == "checkpoint":
            self.controller.forget_move()  # what ran is a restore, not the controller's move
        if rec.moved is not None:
            self.transitions += 1
            self.log(f"step {step}: recovery move -> {_short(rec.plan)}: data movement {rec.moved.movement_s:.3g} s, "
                     f"switch {rec.moved.switch_s:.3g} s")
        self.events.append({"event": "recovery", "step": step, "lost": sorted(lost), "how": rec.how,
                            "reason": rec.reason, "plan": _short(rec.plan)})
        self.pricer.plan_changed()
        return rec

    def close(self) -> None:
        """Stops taking work; a compile still running finishes in the background (its result is unused)."""
        self._pool_ex.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------- execution
    def _execute(self, step: int, pending: _Pending) -> None:
        t0 = time.perf_counter()
        waited = not pending.future.done()
        prepared: Prepared = pending.future.result()
        standalone = self.pricer.move_compile_s(self.job.plan, pending.target)  # the compile as priced (uncontended)
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
        self.pricer.plan_changed()
        self.transitions += 1
        overlapped = pending.step_seconds
        slowdown = statistics.median(overlapped) / pending.steady_s if overlapped and pending.steady_s else None
        # what the compile cost the steps: their time past the steady step, plus any wait for it at the boundary
        compile_cost = None
        if pending.steady_s and not pending.decision.urgent:
            compile_cost = sum(max(0.0, s - pending.steady_s) for s in overlapped) + (t1 - t0)
            self.pricer.note_compile_cost(compile_cost, standalone)
        event = {"event": "transition", "step": step, "trigger": pending.decision.trigger,
                 "admitted_at_step": pending.step, "pause_s": t3 - t0, "wait_for_compile_s": t1 - t0,
                 "movement_s": moved.movement_s, "switch_s": moved.switch_s, "compile_s": prepared.seconds,
                 "compile_hidden": not waited, "steps_during_compile": len(overlapped),
                 "step_slowdown_during_compile": slowdown, "compile_cost_s": compile_cost,
                 "predicted_compile_s": standalone, "compile_contention": self.pricer.compile_contention,
                 "predicted_transition_s": pending.decision.transition_s,
                 "predicted_movement_s": self.pricer.movement_s(graph), "plan": _short(pending.target),
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

    def _priced_move(self, decision: Decision) -> tuple[ExecutionPlan, TransitionGraph]:
        """The admitted target (ranks aligned) and the graph it was priced with; built here only when the
        controller priced it without one (a transition function that answers in seconds)."""
        graph = decision.move
        if isinstance(graph, TransitionGraph) and graph.old_plan == self.job.plan:
            return decision.target, graph
        target = align_ranks(self.job.plan, decision.target)
        return target, self.pricer.graph(self.job.plan, target)

    def _observation(self, step: int, job: Job, length: float, achieved: float | None = None,
                     expert_load: float | None = None) -> Observation:
        """What the controller sees at ``step``: ``job``'s plan, the pool planned for, the mean response
        length, the achieved step seconds (None: not measured), the predicted peak against the trigger and, for
        a mixture of experts whose actor-infer read recorded routes, the busiest expert's share of the routed
        pairs (``router_busiest_expert_share``; None otherwise)."""
        return Observation(step=step, plan=job.plan, devices=self.device_pool.planning(step),
                           response_length=length, step_seconds=achieved,
                           peak_memory_bytes=self.pricer.peak_bytes(job.plan),
                           memory_cap_bytes=self.pricer.trigger_bytes, steps_left=max(1, job.cfg.trainer.steps - step),
                           expert_load=expert_load)

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
        """For checkpoints: the controller's state (references, horizons, pool, efficiency window), the
        pool, the pricer's (calibrated efficiencies, compile times) and the transitions."""
        return {**self.controller.state_dict(), "pool": list(self.pool), **self.pricer.state_dict(),
                "transitions": self.transitions}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.controller.load_state_dict(d)
        self.device_pool.devices = tuple(d["pool"])
        self.pricer.load_state_dict(d)
        self.transitions = d["transitions"]


def _short(plan: ExecutionPlan) -> str:
    return " ".join(f"{ms}:{sp.layout}x{sp.dp}@{','.join(map(str, sp.devices))}" for ms, sp in plan.items())


def _check_line(check: dict) -> str:
    """One log line: the first measured step after a move against the latency and uncertainty it was
    admitted with."""
    verdict = ("within the uncertainty it was admitted with" if check["within"]
               else f"OUTSIDE the uncertainty it was admitted with, by {check['outside_by_s']:.3g} s")
    return (f"step {check['step']}: first step after the move took {check['measured_s']:.3g} s, predicted "
            f"{check['predicted_s']:.3g} +- {check['uncertainty_s']:.3g} s: {verdict}")
