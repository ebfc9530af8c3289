"""Asynchronous (one-step-off) RL in the simulator, as ``runtime/async_rl.py`` runs it with max_staleness 1 and
a weight sync after every update: actor-gen, on devices of its own, generates batch g+1 while scoring and
training consume batch g. Step latency = the interval between weight syncs (the paper's async definition):
max(actor-gen of g+1, scoring + training of g) + the sync, priced so by the ground truth and by the controller's
cost model; the first interval also generates batch 0 (``StepRecord.fill_s``). A plan splits the pool (actor-gen
on the first k devices, k on a grid of eighths, whole nodes once the pool has two), the planner solves each side
and the lowest predicted interval wins; where no split fits, the step runs colocated and synchronously
(``sync_fallback_steps``). Actor-gen is sized for the batch it generates, two past the last observed, lengths
grown by the last observed growth (``AsyncPlanningModel.in_flight``). The controller moves state only at weight
syncs. Policies: ``async_fixed`` (the first disjoint plan's tp/pp kept, dp and the split re-planned: the paper's
async baseline) and ``async_nereus`` (Eq. 2); :func:`async_oracle` is the hindsight bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs import CostModel, counts
from nereus_jax.elastic.workload import Workload
from nereus_jax.sim.model import Layouts, PlanningModel, bucket_workload, pinned_options
from nereus_jax.sim.plan_cost import SimPlan
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

    def measured_plan(self, wl: Workload, pool: tuple[int, ...]) -> tuple[SimPlan, ...]:
        """Empty: a split pool's plans are not re-ranked for risk (nor in the runtime's async mode)."""
        return ()

    def plans(self, wl: Workload | Batches, pool: tuple[int, ...], layouts: Layouts | None = None
              ) -> tuple[SimPlan, ...]:
        """The planner's plans for the interval after observing ``wl`` (or for explicit ``Batches``)."""
        return super().plans(self.batches(wl), pool, layouts)

    def _solve(self, cm: CostModel, wl: Batches, pool: tuple[int, ...],
               layouts: Layouts | None) -> tuple[SimPlan, ...] | None:
        planner = self.planner(cm)
        results = planner.split(self.models, self.algorithm, wl.gen, wl.train, pool, self.topology,
                                options=lambda problem: pinned_options(problem.options(), layouts))
        found = [SimPlan.of(r, self.topology, overlapped=True) for r in results]
        found.sort(key=lambda p: self.predict_with(cm, p, wl))
        return tuple(found[:4]) or self._colocated(cm, wl.train, pool)

    def _colocated(self, cm: CostModel, wl: Workload, pool: tuple[int, ...]) -> tuple[SimPlan, ...] | None:
        """No split fits: the planner's ordinary (synchronous, colocated) plans, never pinned (a pinned async
        baseline pins its disjoint plan's layouts, which a colocated plan need not be able to use)."""
        return super()._solve(cm, wl, pool, None)

    def runnable(self, plan: SimPlan) -> bool:
        """An overlapped plan's actor-gen on devices of its own (a partial move could share them)."""
        if not plan.overlapped:
            return True
        gen = set(plan.plan[next(ms for ms in plan.plan if str(ms) == GEN)].devices)
        return not any(gen & set(sp.devices) for ms, sp in plan.plan.items() if str(ms) != GEN)

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
