"""What the controller is offered: one candidate-set policy for the running job and the simulator.

The :class:`~nereus_jax.elastic.controller.Controller` takes three callables (candidates, latency,
transition seconds). :class:`ControllerAdapter` writes the first once, so the job
(:class:`~nereus_jax.runtime.control.job_pricer.JobPricer`) and the simulator
(:class:`~nereus_jax.sim.model.PlanningModel`) offer the same plans on the same state and a simulated figure
tests the policy the job runs. :meth:`ControllerAdapter.candidates`, in order:

1. the planner's plans for the pool (best first, then runners-up);
2. the partial moves toward the best: the current plan with one model-stage (unit) moved to its place in the
   best plan, a rider following its host (cheaper transitions that may keep most of the gain);
3. when the best plan runs a layout the job has not measured (and it has measured some), the planner's best
   under options re-ranked for the risk of extrapolating (``Pricing.risk_adjusted``): the plan that is fast
   by what was measured;
4. the plans run before, oldest first, on devices the pool still holds (the per-layout memory prices them as
   measured);
5. the home plan: the job's configured layouts on the pool; the simulator's first plan on the pool it was
   planned for, elsewhere its layouts with dp, micro-batch and remat re-planned (the ``fixed`` baseline's
   plan).

Then one filter, each plan once: on the pool, runnable (what the caller needs beyond time and memory), its
calls defined (dp splits the batch) and its predicted peak per device within ``Pricing.usable_bytes``; one
pricing: the predicted step latency and the standard deviation of the predicted gain over the current plan
(``Pricing.gain_sd``); sorted by latency (stable: ties keep the order above).

Subclasses supply primitives only: the workload to plan for, the planner's plans (plain and risk-adjusted),
the plans run before, the home plan, the execution plan of a plan, a plan with one unit taken from another,
a plan's calls, its latency and peak bytes, and job-only runnability. Ranks are not aligned here: a
subclass's ``transition_seconds`` aligns the target to where the move starts and answers a
:class:`~nereus_jax.elastic.controller.Priced` carrying that target, so the candidate sets compare as plans.
Transition seconds are each subclass's (the job: graph + the compile a move needs on shared compute; the
simulator: graph + a learned setup term) under the one name. Imports no JAX.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nereus_jax.elastic.controller import Candidate, Observation, Plan, Priced
from nereus_jax.elastic.costs import StageChoice
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.elastic.pricing import Pricing
from nereus_jax.elastic.workload import Workload


class ControllerAdapter:
    """The candidate-set policy (:meth:`candidates`, the template) over a subclass's primitives; the Controller
    takes ``adapter.candidates, adapter.latency, adapter.transition_seconds``."""

    pricing: Pricing

    # ------------------------------------------------------------------------------- the policy
    def candidates(self, obs: Observation) -> list[Candidate]:
        """The plans worth weighing from ``obs`` (module docstring), fastest first."""
        workload = self.planning_workload()
        if workload is None:
            return []
        planned = list(self.planned(obs, workload))
        plans = list(planned)
        if planned:
            plans += self.partial_moves(obs.plan, planned[0])
            best = self.choices_of(planned[0], workload)
            if self.pricing.measured_layouts and best is not None and not self.pricing.all_measured(best):
                plans += self.risk_planned(obs, workload)
        pool = set(obs.devices)
        plans += [p for p in self.ran_plans() if set(self.execution_plan(p).devices) <= pool]
        plans += self.home_plans(obs, workload)
        current = self.choices_of(obs.plan, workload)
        features = None if current is None else self.pricing.features(current, workload)
        out: dict[Any, Candidate] = {}
        for plan in plans:
            if plan in out or not set(self.execution_plan(plan).devices) <= pool or not self.runnable(plan):
                continue
            choices = self.choices_of(plan, workload)
            if choices is None or self.plan_peak_bytes(plan, choices, workload) > self.pricing.usable_bytes:
                continue
            sd = 0.0 if features is None else self.pricing.gain_sd(features, choices, workload)
            out[plan] = Candidate(plan, self.price(plan, choices, workload), sd)
        return sorted(out.values(), key=lambda c: c.step_latency_s)

    def partial_moves(self, current: Plan, best: Plan) -> list[Plan]:
        """``current`` with one unit moved to its place in ``best``, for each unit ``best`` places differently
        (:func:`moved_units`); none when the plans do not hold the same units."""
        moved = (self.with_unit(current, best, ms)
                 for ms in moved_units(self.execution_plan(current), self.execution_plan(best)))
        return [p for p in moved if p is not None]

    # ---------------------------------------------------------------------------- the primitives
    def planning_workload(self) -> Workload | None:
        """The workload the candidates are planned and priced for (None: no candidates yet)."""
        raise NotImplementedError

    def planned(self, obs: Observation, workload: Workload) -> Sequence[Plan]:
        """The planner's plans for ``obs.devices``, best first; empty when nothing fits."""
        raise NotImplementedError

    def risk_planned(self, obs: Observation, workload: Workload) -> Sequence[Plan]:
        """The planner's best under options ranked by ``Pricing.risk_adjusted`` (empty where the caller does not
        re-rank, or nothing fits)."""
        raise NotImplementedError

    def ran_plans(self) -> Iterable[Plan]:
        """The plans run before, oldest first."""
        raise NotImplementedError

    def home_plans(self, obs: Observation, workload: Workload) -> Sequence[Plan]:
        """The home plan on ``obs.devices`` (empty: none)."""
        raise NotImplementedError

    def execution_plan(self, plan: Plan) -> ExecutionPlan:
        """The model-stage -> stage-plan mapping of ``plan``."""
        raise NotImplementedError

    def with_unit(self, current: Plan, best: Plan, unit) -> Plan | None:
        """``current`` with the unit model-stage ``unit`` (and its riders) as ``best`` runs it (None: no such plan)."""
        raise NotImplementedError

    def choices_of(self, plan: Plan, workload: Workload) -> dict[str, StageChoice] | None:
        """Every priced model-stage's call of ``plan`` on ``workload`` (None: its dp does not split the batch)."""
        raise NotImplementedError

    def price(self, plan: Plan, choices: Mapping[str, StageChoice], workload: Workload) -> float:
        """Predicted step latency of ``plan`` running ``choices``."""
        raise NotImplementedError

    def plan_peak_bytes(self, plan: Plan, choices: Mapping[str, StageChoice], workload: Workload) -> float:
        """Predicted peak bytes on the busiest device of ``plan`` running ``choices``."""
        raise NotImplementedError

    def runnable(self, plan: Plan) -> bool:
        """What the caller needs beyond time and memory (default: nothing)."""
        return True

    # ----------------------------------------------------------------- the other two callables
    def latency(self, plan: Plan, obs: Observation | None = None) -> float | None:
        """Predicted step latency of ``plan`` (the controller's latency callable); None: cannot be priced."""
        raise NotImplementedError

    def transition_seconds(self, old: Plan, new: Plan) -> float | Priced | None:
        """Predicted seconds of the move ``old`` -> ``new``, with ``new`` aligned to ``old`` (None: no live
        transition reaches it)."""
        raise NotImplementedError


def moved_units(current: ExecutionPlan, best: ExecutionPlan) -> list:
    """The model-stages ``best`` places differently from ``current``, in ``best``'s order (none when the two
    plans do not hold the same model-stages)."""
    if set(current) != set(best):
        return []
    return [ms for ms in best if best[ms] != current[ms]]


def partial_moves(current: ExecutionPlan, best: ExecutionPlan) -> list[ExecutionPlan]:
    """The execution plans of :meth:`ControllerAdapter.partial_moves`: ``current`` with one model-stage moved to
    its place in ``best``, for every model-stage ``best`` moves."""
    return [ExecutionPlan({**current, ms: best[ms]}) for ms in moved_units(current, best)]
