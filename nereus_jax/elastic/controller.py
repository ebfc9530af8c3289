"""The controller: monitor -> re-plan -> admit (the paper's Controller section, Eq. 2).

It consumes one :class:`Observation` per step boundary and returns a :class:`Decision` when it asked
the planner for a new plan, or None. It never touches arrays: planning, latency prediction and
transition pricing come in as callables, so the same controller drives the real job and the simulator.
The transition callable may answer with a :class:`Priced` (the seconds, the target as the move reaches
it, the move itself): an admitted decision then carries that target and move, so the runtime runs
exactly the move it priced, built once.

Triggers:
  - hard: the device pool changed (urgent when a device in use left), or the predicted peak memory of
    the current plan exceeds the memory cap (urgent);
  - soft: mean response length drifted more than ``length_drift`` (30%) from its reference, or the
    achieved efficiency drifted more than ``efficiency_drift`` from its reference (a model with a steady
    bias does not trigger forever; a change in how the hardware performs does). The efficiency signal is
    the median of measured / predicted step time over the last ``efficiency_window`` steps run on the
    current plan: one straggler step is not a drift (at 1,024 GPUs a 1.3-2x straggler hits some stage
    every few dozen steps), and a plan the controller just moved to is judged against its own steps, not
    the old plan's, so a new plan is not re-planned before it has run ``efficiency_window`` steps.
    Every re-plan, admitted or not, resets the references; and, for mixture-of-experts models whose
    observation carries it (``Observation.expert_load``: the busiest expert's share of the routed tokens),
    that share drifted more than ``expert_drift`` (30%) from its reference: with expert parallelism the
    device holding the busiest expert sets the expert layers' time, so a skew can make another ep faster.
    The planner prices the skew from the workload; the move is admitted by Eq. 2 like any other;
  - scheduled (``period=K``, the "re-plan every K steps" baseline): every K-th step instead of the soft
    triggers.
Admission (Eq. 2): a target is admitted when its predicted per-step gain dL > 0 and
``transition_s / dL <= gamma * H``, H the EMA of the number of steps between threshold crossings of the
triggering signal (1 before any is seen), at most the steps the run has left when the runtime says so
(``Observation.steps_left``: a plan cannot pay back after the last step). A rejected best target falls
back to the runners-up (slightly slower plans with cheaper transitions). The urgent path waives
profitability; when no candidate can be reached live it says so (checkpoint/restart is the last resort).

Margin (not in the paper): a non-urgent target is admitted only when its predicted dL also exceeds
``UNCERTAINTY_Z`` standard deviations of that prediction (``Candidate.uncertainty_s``: the calibrated cost
model's covariance, small when the target runs calls of sizes the job has measured, large when it
extrapolates, plus a term per doubling of tp or pp from the layouts measured; a prior before any
measurement), then Eq. 2 prices the move as the paper does. An urgent
move (no gain to check) takes the reachable candidate with the least predicted latency plus that
uncertainty, so a plan of measured call sizes wins over a barely faster guess. A model
calibrated on one plan extrapolates to others, and a gain inside its uncertainty is a guess.
``error_margin=False`` turns it off; with ``gamma = inf`` (no admission: ``no_admission``, ``every_K``)
there is no margin either. After every move (urgent or not) the first measured step on the new plan is
compared with the latency predicted for it at the decision: ``transfer_errors`` keeps those relative
errors (reported; the log says when a move missed its admitted uncertainty).

    controller = Controller(plan_fn, latency_fn, transition_fn, gamma=0.5)
    decision = controller.observe(Observation(step=step, plan=plan, devices=devices,
                                              response_length=response_length, step_seconds=step_seconds))
    saved = controller.state_dict()          # JSON-ready: references, horizons, crossings, efficiency window
    controller.load_state_dict(saved)
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

Plan = Any  # an ExecutionPlan (or anything hashable the callables understand)
UNCERTAINTY_Z = 1.0  # a gain must exceed this many standard deviations of its prediction to be admitted


@dataclasses.dataclass(frozen=True, kw_only=True)
class Observation:
    """What the runtime measured at a step boundary."""

    step: int
    plan: Plan
    devices: tuple[int, ...]          # the device pool available now
    response_length: float            # mean response tokens this step
    step_seconds: float | None = None  # measured step latency (None: not measured)
    peak_memory_bytes: float | None = None  # predicted/measured peak of the current plan per device
    memory_cap_bytes: float | None = None
    steps_left: int | None = None     # steps the run has left including this one (None: unknown)
    expert_load: float | None = None  # mixture of experts: the busiest expert's share of routed tokens (None: dense)
    # a device failed during the step: moves start from ``survivors``, the plan of the units that survived on the
    # remaining devices (None: they are not one consistent state, so no live move exists), not from ``plan``
    failed: bool = False
    survivors: Plan | None = None

    @property
    def moves_from(self) -> Plan | None:
        """Where a move would start: the current plan, or after a failure the survivors' (None: no live move)."""
        return self.survivors if self.failed else self.plan


@dataclasses.dataclass(frozen=True)
class Candidate:
    plan: Plan
    step_latency_s: float
    uncertainty_s: float = 0.0  # standard deviation of its predicted gain over the current plan (s/step)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """The outcome of one re-plan: the chosen target (None when nothing is admitted; the Priced target
    when the transition callable gave one) and why."""

    step: int
    trigger: str                      # "pool", "memory", "length", "efficiency", "expert", "schedule"
    urgent: bool
    target: Plan | None
    admitted: bool
    reason: str
    current_latency_s: float | None
    target_latency_s: float | None
    horizon: float                    # H
    gain_s: float | None = None       # predicted per-step saving dL
    transition_s: float | None = None  # predicted transition cost L_tran
    rejected: tuple[tuple[Plan, str], ...] = ()  # candidates turned down, with the reason
    margin_s: float = 0.0             # the cost model's uncertainty about dL (s/step): dL must exceed it
    move: Any = None                  # what the transition was priced with (Priced.move), to run it as priced

    def log_line(self) -> str:
        fmt = lambda x, unit: "n/a" if x is None else f"{x:.3g} {unit}"  # noqa: E731
        verdict = "ADMIT" if self.admitted else "reject"
        return (f"step {self.step} {verdict} trigger={self.trigger}{' (urgent)' if self.urgent else ''} "
                f"gain={fmt(self.gain_s, 's/step')} transition={fmt(self.transition_s, 's')} H={self.horizon:.2f}: "
                f"{self.reason}")


@dataclasses.dataclass(frozen=True)
class Priced:
    """A transition function's answer with what the runtime needs to run the move it priced: ``target``,
    the candidate as the move reaches it (e.g. ranks aligned to the current plan), and ``move`` (e.g. the
    transition graph). An admitted decision carries both, so the move that runs is the one priced and
    is built once."""

    seconds: float
    target: Plan
    move: Any = None


PlanFn = Callable[[Observation], Sequence[Candidate]]        # best first, then runners-up
LatencyFn = Callable[[Plan, Observation], float | None]       # predicted step latency; None = infeasible
TransitionFn = Callable[[Plan, Plan], float | Priced | None]   # predicted seconds; None = no live transition


class Controller:
    """Triggers, Eq. 2 admission with an EMA horizon, runners-up, and the urgent path."""

    def __init__(self, plan_fn: PlanFn, latency_fn: LatencyFn, transition_fn: TransitionFn, *,
                 gamma: float = 0.5, length_drift: float = 0.3, efficiency_drift: float = 0.3,
                 efficiency_window: int = 3, ema: float = 0.5, period: int | None = None,
                 devices: Sequence[int] | None = None, error_margin: bool = True, expert_drift: float = 0.3):
        self.plan_fn, self.latency_fn, self.transition_fn = plan_fn, latency_fn, transition_fn
        self.gamma, self.length_drift, self.efficiency_drift, self.ema = gamma, length_drift, efficiency_drift, ema
        self.expert_drift = expert_drift
        if period is not None and period < 1:
            raise ValueError(f"period={period}: re-plan every K >= 1 steps, or None for drift triggers")
        self.period = period
        self.error_margin = error_margin  # False: Eq. 2 exactly as the paper has it
        self.reference_length: float | None = None
        self.reference_ratio: float | None = None  # the efficiency signal at the last reset (None: not yet)
        self.reference_expert_load: float | None = None  # the busiest expert's share at the last reset
        self.devices: tuple[int, ...] | None = None if devices is None else tuple(devices)  # the pool at start
        self.horizon = {"length": 1.0, "efficiency": 1.0, "expert": 1.0, "pool": 1.0, "memory": 1.0, "schedule": 1.0}
        self._last_crossing: dict[str, int] = {}
        self._seen_twice: set[str] = set()
        self._ratios: deque[float] = deque(maxlen=max(1, efficiency_window))  # on ``_ratio_plan``, newest last
        self._ratio_plan: Plan | None = None
        self._adopt_window = False  # after load_state_dict: the restored window is the next observed plan's
        # (the plan a move left, the target's predicted latency, the uncertainty it was admitted with)
        self._moved: tuple[Plan, float, float] | None = None
        self.transfer_errors: deque[float] = deque(maxlen=8)  # |measured / predicted - 1| of recent moves
        self.move_checks: list[dict[str, Any]] = []  # each move's first measured step against its prediction
        self.decisions: list[Decision] = []

    @property
    def transfer_error(self) -> float:
        """Mean relative error of the cost model on the plans it moved to (0 before one was measured)."""
        return statistics.mean(self.transfer_errors) if self.transfer_errors else 0.0

    def forget_move(self) -> None:
        """The runtime dropped the last admitted move (replaced, or its devices left first): the next plan
        change is not the one predicted, so it does not measure the model's error."""
        self._moved = None

    def _check_move(self, obs: Observation) -> None:
        """The first measured step on a plan a move reached: how far was it from its prediction?"""
        if self._moved is None or obs.plan == self._moved[0] or obs.step_seconds is None:
            return
        _, predicted, margin = self._moved
        self.transfer_errors.append(abs(obs.step_seconds / predicted - 1))
        miss = abs(obs.step_seconds - predicted) - margin
        self.move_checks.append({"step": obs.step, "predicted_s": predicted, "measured_s": obs.step_seconds,
                                 "uncertainty_s": margin, "within": miss <= 0, "outside_by_s": max(0.0, miss)})
        self._moved = None

    # --------------------------------------------------------------------------------- triggers
    def observe(self, obs: Observation) -> Decision | None:
        self._check_move(obs)
        efficiency = self._efficiency(obs)
        if self.reference_ratio is None:  # (re)established once the current plan has run a full window
            self.reference_ratio = efficiency
        if self.reference_expert_load is None:
            self.reference_expert_load = obs.expert_load
        if self.reference_length is None:  # the first observation sets the references; only a pool change
            self.reference_length = obs.response_length  # since ``devices`` (if given) can trigger
            if self.devices is None or tuple(obs.devices) == self.devices:
                self.devices = tuple(obs.devices)
                return None
        trigger, urgent = self._trigger(obs, efficiency)
        if trigger is None:
            return None
        self._crossed(trigger, obs.step)
        decision = self._replan(obs, trigger, urgent)
        self.reference_length, self.devices = obs.response_length, tuple(obs.devices)  # reset, admitted or not
        self.reference_ratio = efficiency  # an admitted move starts a new window on its target
        self.reference_expert_load = obs.expert_load
        if decision.admitted and decision.target_latency_s:
            self._moved = (obs.plan, decision.target_latency_s, decision.margin_s)
        self.decisions.append(decision)
        return decision

    def _trigger(self, obs: Observation, efficiency: float | None) -> tuple[str | None, bool]:
        """(trigger, urgent) for this observation, or (None, False): hard triggers first (pool, then
        memory), then the schedule (``period``) or the soft ones (length, efficiency, expert load)."""
        if tuple(obs.devices) != self.devices:
            lost = set(self.devices or ()) - set(obs.devices)
            return "pool", bool(lost & set(_plan_devices(obs.plan)))
        if obs.peak_memory_bytes is not None and obs.memory_cap_bytes is not None \
                and obs.peak_memory_bytes > obs.memory_cap_bytes:
            return "memory", True
        if self.period is not None:
            return ("schedule", False) if obs.step % self.period == 0 else (None, False)
        ref = self.reference_length or 0.0
        if ref > 0 and abs(obs.response_length - ref) / ref > self.length_drift:
            return "length", False
        if efficiency is not None and self.reference_ratio and \
                abs(efficiency / self.reference_ratio - 1) > self.efficiency_drift:
            return "efficiency", False
        load, ref_load = obs.expert_load, self.reference_expert_load
        if load is not None and ref_load and abs(load - ref_load) / ref_load > self.expert_drift:
            return "expert", False
        return None, False

    def _efficiency(self, obs: Observation) -> float | None:
        """The efficiency signal: median measured / predicted step time over the last ``efficiency_window``
        steps on ``obs.plan`` (None until it has run that many). A new plan starts a new window and clears
        the reference."""
        if self._adopt_window:
            self._ratio_plan, self._adopt_window = obs.plan, False
        if obs.plan != self._ratio_plan:
            self._ratios.clear()
            self._ratio_plan, self.reference_ratio = obs.plan, None
        ratio = self._ratio(obs)
        if ratio is not None:
            self._ratios.append(ratio)
        return statistics.median(self._ratios) if len(self._ratios) == self._ratios.maxlen else None

    def _ratio(self, obs: Observation) -> float | None:
        """Measured / predicted step time: the inverse of the achieved efficiency relative to the model."""
        if obs.step_seconds is None:
            return None
        predicted = self.latency_fn(obs.plan, obs)
        return obs.step_seconds / predicted if predicted else None

    def _crossed(self, signal: str, step: int) -> None:
        """H: EMA of steps between threshold crossings of this signal (1 until a second crossing)."""
        last = self._last_crossing.get(signal)
        if last is not None:
            gap = max(1, step - last)
            self.horizon[signal] = self.ema * gap + (1 - self.ema) * self.horizon[signal] \
                if signal in self._seen_twice else float(gap)
            self._seen_twice.add(signal)
        self._last_crossing[signal] = step

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a restarted controller needs to decide as this one would (JSON-ready): the references,
        the pool, H per signal with its last crossings, and the efficiency window of the current plan."""
        return {"reference_length": self.reference_length, "reference_ratio": self.reference_ratio,
                "reference_expert_load": self.reference_expert_load,
                "devices": None if self.devices is None else list(self.devices), "horizon": dict(self.horizon),
                "last_crossing": dict(self._last_crossing), "seen_twice": sorted(self._seen_twice),
                "ratios": list(self._ratios), "transfer_errors": list(self.transfer_errors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the efficiency window belongs to whatever plan is observed next
        (a job resumes on the plan it saved)."""
        self.reference_length = state["reference_length"]
        self.reference_ratio = state.get("reference_ratio")
        self.reference_expert_load = state.get("reference_expert_load")
        self.devices = None if state["devices"] is None else tuple(state["devices"])
        self.horizon.update({k: float(v) for k, v in state["horizon"].items()})
        self._last_crossing = {k: int(v) for k, v in state["last_crossing"].items()}
        self._seen_twice = set(state["seen_twice"])
        self._ratios.clear()
        self._ratios.extend(float(r) for r in state.get("ratios", ()))
        self.transfer_errors.clear()
        self.transfer_errors.extend(float(e) for e in state.get("transfer_errors", ()))
        self._adopt_window = True

    # ------------------------------------------------------------------------------- admission
    def _replan(self, obs: Observation, trigger: str, urgent: bool) -> Decision:
        H = self.horizon[trigger]
        if obs.steps_left is not None:  # a new plan cannot pay back after the run ends
            H = min(H, float(max(1, obs.steps_left)))
        current = None if urgent else self.latency_fn(obs.plan, obs)
        checked = self.error_margin and current is not None and self.gamma != math.inf
        candidates = [c for c in self.plan_fn(obs) if c.plan != obs.plan]
        if urgent and self.error_margin:  # no gain to check: prefer what the model is sure of (risk-adjusted)
            candidates.sort(key=lambda c: c.step_latency_s + UNCERTAINTY_Z * c.uncertainty_s)
        rejected: list[tuple[Plan, str]] = []
        source = obs.moves_from
        for c in candidates:
            priced = None if source is None else self.transition_fn(source, c.plan)
            if priced is None:
                rejected.append((c.plan, "no live transition reaches it"))
                continue
            cost, target, move = ((priced.seconds, priced.target, priced.move) if isinstance(priced, Priced)
                                  else (priced, c.plan, None))
            if urgent:
                return Decision(step=obs.step, trigger=trigger, urgent=True, target=target, admitted=True,
                                reason="urgent: profitability waived", current_latency_s=current,
                                target_latency_s=c.step_latency_s, transition_s=cost, horizon=H,
                                rejected=tuple(rejected), move=move)
            gain = None if current is None else current - c.step_latency_s
            margin = UNCERTAINTY_Z * c.uncertainty_s if checked else 0.0
            if gain is None or gain <= 0:
                rejected.append((c.plan, "no gain" if gain is None else
                                 f"no gain: dL={gain:.3g} s/step (transition {cost:.3g} s)"))
                continue
            if gain <= margin:
                rejected.append((c.plan, f"gain {gain:.3g} s/step is within the cost model's uncertainty about it "
                                         f"({margin:.3g} s/step)"))
                continue
            if cost / gain <= self.gamma * H:
                return Decision(step=obs.step, trigger=trigger, urgent=False, target=target, admitted=True,
                                reason=f"pays back in {cost / gain:.2f} steps <= gamma*H={self.gamma * H:.2f}"
                                + (f" (gain above the model's uncertainty, {margin:.3g} s/step)" if margin else ""),
                                current_latency_s=current, target_latency_s=c.step_latency_s, gain_s=gain,
                                transition_s=cost, horizon=H, rejected=tuple(rejected), margin_s=margin, move=move)
            rejected.append((c.plan, f"gain {gain:.3g} s/step, transition {cost:.3g} s: pays back in "
                                     f"{cost / gain:.2f} steps > gamma*H={self.gamma * H:.2f}"))
        reason = ("urgent, but no feasible live transition exists: checkpoint/restart is the last resort"
                  if urgent else "no candidate admitted")
        best = candidates[0] if candidates else None
        return Decision(step=obs.step, trigger=trigger, urgent=urgent, target=None, admitted=False, reason=reason,
                        current_latency_s=current, target_latency_s=best.step_latency_s if best else None,
                        horizon=H, rejected=tuple(rejected))


def _plan_devices(plan: Plan) -> tuple[int, ...]:
    return tuple(getattr(plan, "devices", ()))
