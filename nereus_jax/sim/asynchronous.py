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

- Memory for the batch in flight: an interval generates the batch after the one it trains, two batches past
  the last one the controller observed, so the planner sizes actor-gen (and the memory trigger checks it) for
  that batch: the observed lengths grown by the last observed step-to-step growth, twice (growth only;
  ``AsyncPlanningModel.in_flight``). Planning actor-gen for the observed batch ran out of memory once on
  paper_drift (step 5: lengths grew 15% a step and the plan had been sized two steps earlier).

Policies: ``async_fixed`` (the planner's first disjoint plan's tp/pp kept, dp and the split re-planned: the
paper's async baseline from Laminar, fixed parallelism with DP scaling; the first disjoint plan is the one at
the first step whose pool admits a split, with the hardware table's priors) and ``async_nereus`` (Eq. 2 admission).
:func:`async_oracle` is the hindsight bound: each interval the truly fastest plan (disjoint or colocated) among
the oracle planner's picks for that interval's exact batches and every plan another policy ran there, with
free transitions, pipeline fills priced exactly (a dynamic program over "is this step's batch generated").

Why async_nereus gains ~2.5% over async_fixed on paper_drift, not the paper's 37.3% (measured, seed 0): under
this ground truth actor-gen is 22% of a synchronous step (sync nereus), and its work scales with the mean
length (packed sequences, continuous batching), so nothing idles while the longest response finishes. An
interval is then bound by scoring + training on the 3/4 of the pool left to them (actor-gen 168-186 s beside
~300 s intervals), and splitting the pool costs more than the overlap saves: sync nereus runs 251 s/step
against async_nereus's 301, and the async oracle, free to pick a colocated plan, picks one in 23 of 26
intervals (245 s/step, 1.2% under the sync oracle). Pinning the generator's share of the pool at the first
disjoint plan's 1/4 (a fixed rollout/trainer split) moves async_fixed by <0.1%, so the baseline's re-planned
split is not the reason. The paper's async runs sit on Laminar, built for the opposite regime: long-tail
generation (p99 about 10x the median) that dominates a step, trajectory-level asynchrony (each trajectory
generated and consumed on its own, weights pulled from relay workers at any time) and repacking of long-tail
trajectories onto a few rollout replicas; re-sizing the rollout and trainer pools as lengths drift 16x is
where a planner gains there. Ours is batch-level one-step-off with one global weight sync per interval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs import CostModel, counts
from nereus_jax.elastic.workload import Workload
from nereus_jax.sim.model import PlanningModel, bucket_workload, pinned_options
from nereus_jax.sim.plans import SimPlan
from nereus_jax.sim.records import PolicyRun, StepRecord

GEN = "actor-gen"
TRAIN = "actor-train"
IN_FLIGHT_AHEAD = 2  # the batch generated in an interval is two past the last observed (that interval trains one)


def sync_transfer(plan: SimPlan, actor: ModelConfig, devices_per_node: int) -> tuple[str, float]:
    """(link, bytes per generator device) of the weight sync actor-train -> actor-gen: each generator
    device receives its tp shard of the actor in the compute dtype; "intra" when generator and trainer
    share one node, else "inter"."""
    gen = plan.choice(GEN)
    nbytes = counts.params_per_device(actor, gen.tp, 1) * counts.dtype_bytes(actor.compute_dtype)
    nodes = {d // devices_per_node for ms, sp in plan.plan.items() if str(ms) in (GEN, TRAIN) for d in sp.devices}
    return ("intra" if len(nodes) == 1 else "inter"), nbytes


@dataclasses.dataclass(frozen=True)
class Batches:
    """The two batches of one async interval: scoring and training ``train`` while actor-gen generates ``gen``."""

    train: Workload
    gen: Workload


class AsyncPlanningModel(PlanningModel):
    """The controller's model of an async job: disjoint plans, intervals priced as max(gen, rest) + sync, actor-gen
    sized for the batch in flight."""

    @property
    def observed(self) -> Workload | None:
        return self._observed

    @observed.setter
    def observed(self, wl: Workload | None) -> None:
        self._observed = wl
        seen = self.__dict__.setdefault("_seen", [])
        if wl is not None and (not seen or seen[-1] is not wl):
            seen.append(wl)

    def in_flight(self, wl: Workload) -> Workload:
        """The batch actor-gen generates in the next interval, ``IN_FLIGHT_AHEAD`` batches past the last observed:
        ``wl``'s lengths grown by the last observed step-to-step growth of the mean length (never shrunk)."""
        seen = self.__dict__.get("_seen", [])
        if len(seen) < 2:
            return wl
        growth = max(1.0, seen[-1].response_length.mean / seen[-2].response_length.mean) ** IN_FLIGHT_AHEAD
        return wl if growth == 1.0 else wl.with_response_length(wl.response_length.scaled(growth))

    def batches(self, wl: Workload | Batches) -> Batches:
        return wl if isinstance(wl, Batches) else Batches(wl, self.in_flight(wl))

    def plans(self, wl: Workload | Batches, pool: tuple[int, ...]) -> tuple[SimPlan, ...]:
        """The planner's plans for the interval after observing ``wl`` (or for explicit ``Batches``)."""
        return super().plans(self.batches(wl), pool)

    def _solve(self, cm: CostModel, wl: Batches, pool: tuple[int, ...]) -> tuple[SimPlan, ...] | None:
        planner = self.planner(cm)
        results = planner.split(self.models, self.algorithm, wl.gen, wl.train, pool, self.topology,
                                options=lambda problem: pinned_options(problem.options(), self.layouts))
        found = [SimPlan.of(r, self.topology, overlapped=True) for r in results]
        found.sort(key=lambda p: self.predict_with(cm, p, wl))
        return tuple(found[:4]) or self._colocated(cm, wl.train, pool)

    def _colocated(self, cm: CostModel, wl: Workload, pool: tuple[int, ...]) -> tuple[SimPlan, ...] | None:
        """No split fits: the planner's ordinary (synchronous, colocated) plans, never pinned (a pinned async
        baseline pins its disjoint plan's layouts, which a colocated plan need not be able to use)."""
        pinned, self.layouts = self.layouts, None
        try:
            return super()._solve(cm, wl, pool)
        finally:
            self.layouts = pinned

    def predict_with(self, cm: CostModel, plan: SimPlan, wl: Workload | Batches) -> float:
        b = self.batches(wl)
        seconds = {s: cm.stage_latency(self.pricing.model_for(s), s, c, _batch_of(s, plan, b)).total
                   for s, c in plan.choices}
        if not plan.overlapped:
            return plan.latency(seconds)
        link, nbytes = sync_transfer(plan, self.models["actor"], self.hw.devices_per_node)
        return plan.latency(seconds, cm.transfer_seconds(nbytes, link))

    def predict(self, plan: SimPlan, wl: Workload | Batches) -> float:
        return self.predict_with(self.cost_model, plan, wl)

    def peak_memory(self, plan: SimPlan, wl: Workload | Batches) -> float:
        """Predicted peak bytes on the busiest device; an overlapped plan's actor-gen holds the batch in flight."""
        b = self.batches(wl)
        return self.pricing.peak_bytes(plan.plan, dict(plan.choices), b.train, {GEN: _batch_of(GEN, plan, b)})


def _batch_of(stage: str, plan: SimPlan, b: Batches) -> Workload:
    return b.gen if plan.overlapped and stage == GEN else b.train


def interval_seconds(truth, cfg_of, plan: SimPlan, workloads: Mapping[str, Workload | None],
                     steps: Mapping[str, int]) -> tuple[float, dict[str, float]]:
    """Ground-truth interval of an overlapped plan: each stage at its own batch's workload and step (actor-gen:
    the next batch; none at the last interval), then the critical path + the true weight sync."""
    seconds = {s: (truth.stage_seconds(cfg_of(s), s, c, workloads[s], steps[s]) if workloads[s] is not None else 0.0)
               for s, c in plan.choices}
    link, nbytes = sync_transfer(plan, cfg_of("actor"), truth.hw.devices_per_node)
    return plan.latency(seconds, truth.link_seconds(link, nbytes)), seconds


def async_oracle(sim, others: Sequence = ()):
    """The async hindsight bound on ``sim`` (a :class:`~nereus_jax.sim.simulation.Simulation`): each interval the
    plan that makes the run fastest, with free transitions, among :func:`oracle_candidates`. A dynamic program
    over whether the step's batch is already generated prices pipeline fills exactly: an overlapped plan pays a
    fill unless the previous step's plan was overlapped; a colocated plan after an overlapped one skips
    generation. A lower bound of every run in ``others`` (whose plans are candidates) and of the sync oracle."""
    models = oracle_models(sim)
    best: dict[bool, tuple[float, tuple]] = {False: (0.0, ())}  # batch ``step`` generated? -> (total, records)
    for step in range(sim.trace.steps):
        fitting = oracle_candidates(sim, step, others, models)
        assert fitting, f"async oracle: nothing fits step {step}"
        nxt: dict[bool, tuple[float, tuple]] = {}
        for generated, (total, records) in best.items():
            for p in fitting:
                rec = oracle_record(sim, p, step, generated, StepRecord)
                cost = total + rec.latency_s + rec.fill_s
                if p.overlapped not in nxt or cost < nxt[p.overlapped][0]:
                    nxt[p.overlapped] = (cost, (*records, rec))
        best = nxt
    return PolicyRun("async_oracle", list(min(best.values(), key=lambda v: v[0])[1]))


def oracle_models(sim) -> tuple[AsyncPlanningModel, PlanningModel]:
    """The async and the synchronous planner over a cost model with the truth's large-size efficiencies."""
    efficiency = sim.truth.reference_efficiency()
    return (sim.model(cost_model=CostModel(sim.hw, efficiency), asynchronous=True),
            sim.model(cost_model=CostModel(sim.hw, efficiency)))


def oracle_candidates(sim, step: int, others: Sequence = (), models=None) -> list[SimPlan]:
    """The async oracle's plans for ``step``: the async planner's picks for the interval's exact batches (it
    trains ``step`` and generates ``step + 1``) and the synchronous planner's, both under the truth's
    efficiencies, plus every plan a run of ``others`` ran there; those that fit the pool and true memory, in a
    fixed order (ties resolve the same every run)."""
    amodel, smodel = models or oracle_models(sim)
    wl, pool = sim.trace.workload(step), sim.trace.pool(step)
    ahead = sim.trace.workload(min(step + 1, sim.trace.steps - 1))
    picks = {*amodel.plans(Batches(bucket_workload(wl), bucket_workload(ahead)), pool),
             *smodel.plans(bucket_workload(wl), pool),
             *(r.records[step].plan for r in others)}
    return sorted((p for p in picks if p is not None and set(p.devices) <= set(pool)
                   and sim.step_peak(p, step) <= sim.hw.memory_bytes), key=lambda p: (p.describe(), str(p.plan)))


def oracle_record(sim, plan: SimPlan, step: int, generated: bool, record):
    """``record`` (a StepRecord) of ``plan`` at ``step`` when batch ``step`` is (``generated``) or is not yet
    generated: the ground-truth latency, and the pipeline fill an overlapped plan pays when it is not."""
    latency = sim.measure_step(plan, step, generated=generated and not plan.overlapped)[0]
    fill = 0.0
    if plan.overlapped and not generated:
        fill = sim.truth.stage_seconds(sim.cfg(GEN), GEN, plan.choice(GEN), sim.trace.workload(step), step)
    return record(step, len(sim.trace.pool(step)), latency, fill_s=fill, plan=plan)
