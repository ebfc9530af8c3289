"""What a simulated run records: one :class:`StepRecord` per step and a :class:`PolicyRun` per policy.

Its own module so that ``sim.simulation`` (the synchronous policies) and ``sim.asynchronous`` (the async ones
and the async oracle) both build records without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nereus_jax.elastic.controller import Decision
from nereus_jax.sim.plan_cost import SimPlan

ASYNC_POLICIES = ("async_fixed", "async_nereus")  # async_oracle: see sim.asynchronous.async_oracle()


@dataclass
class StepRecord:
    step: int
    pool: int
    latency_s: float            # ground-truth step latency (noise and stragglers included)
    transition_s: float = 0.0   # ground-truth transition time at this step's boundary
    wasted_s: float = 0.0       # out-of-memory attempts and checkpoint/restarts
    fill_s: float = 0.0         # async, first step: generating batch 0 before the pipeline overlaps
    oom: int = 0
    decision_ms: float = 0.0    # the controller's own time at this boundary
    plan: SimPlan | None = None
    events: list[str] = field(default_factory=list)
    predicted_s: float | None = None  # the policy's cost model's prediction for this step (before it ran)


@dataclass
class PolicyRun:
    name: str
    records: list[StepRecord]
    decisions: list[Decision] = field(default_factory=list)
    notes: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(r.latency_s + r.transition_s + r.wasted_s + r.fill_s for r in self.records)

    def transfer_errors(self) -> list[float]:
        """The cost model's error on each move: the first step after a transition, its measured latency
        against the latency the policy predicted for it before it ran (relative to the measured)."""
        return [abs(r.predicted_s - r.latency_s) / r.latency_s for r in self.records
                if r.predicted_s is not None and r.latency_s > 0 and any("transition" in e for e in r.events)]

    def summary(self) -> dict:
        recs = self.records
        transition_s = sum(r.transition_s for r in recs)
        total = self.total_s
        layout_changes = sum(e == "transition layout" for r in recs for e in r.events)
        decision = [r.decision_ms for r in recs[1:]] or [0.0]
        out = {
            "mean_step_s": total / len(recs),
            "mean_compute_step_s": sum(r.latency_s for r in recs) / len(recs),
            "transitions": sum("transition" in e for r in recs for e in r.events),
            "layout_transitions": layout_changes,
            "transition_s": transition_s,
            "overhead_fraction": transition_s / total if total else 0.0,
            "oom_events": sum(r.oom for r in recs),
            "restarts": sum("restart" in e for r in recs for e in r.events),
            "forced_relayouts": sum("forced relayout" in e for r in recs for e in r.events),
            "total_s": total,
            "decision_ms_mean": sum(decision) / len(decision),
            "decision_ms_max": max(decision),
            "transition_steps": [r.step for r in recs if any("transition" in e for e in r.events)],
        }
        errors = self.transfer_errors()
        if errors:
            out["transfer_error_median"] = float(np.median(errors))
            out["transfer_error_max"] = max(errors)
        if any(r.plan is not None and r.plan.overlapped for r in recs) or self.name in ASYNC_POLICIES:
            out["sync_fallback_steps"] = sum(r.plan is not None and not r.plan.overlapped for r in recs)
            out["fill_s"] = sum(r.fill_s for r in recs)
        out.update(self.notes)
        return out
