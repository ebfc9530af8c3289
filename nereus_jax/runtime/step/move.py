"""The one way a running job's state moves: a transition graph run on the job's units, its result adopted.

Planned moves (the adapter), device-loss recovery and parking all come through :func:`move`:

    moved = move(job, graph, prepared=prepared)   # graph: from (some of) the job's units to a target

Before anything runs, the units the graph starts from are taken out of the job (a placeholder that names
the move stands in for them) and handed to the executor, which then holds the old state: a buffer it frees
is free, so the ledger it keeps is the truth about the state's live bytes (the job's other units, its engines
and compiled programs are outside the graph and untouched). With LoRA's shared frozen base the job's other
units may hold some of the same buffers: they go to the executor as ``keep`` and it frees or donates none
of those (its ledger then books the shared bytes once per holder). The
graph names which units it starts from (``graph.initial``): the job's units of those model-stages that
it does not name (replicas on lost devices, after a failure) are dropped.

What the job adopts:

* a graph over every model-stage of the job: its new plan (weight sync, engines and programs follow;
  ``prepared``'s compiled programs and warmed engines when they were built for that plan);
* a graph over some model-stages that changes only where their state lives (parking: device memory
  <-> pinned host memory): those stages' units; the plan's layouts stay.

Anything that would make the result unusable is checked before a byte moves (a graph that does not
start from the job's units, a target the job cannot run, a partial graph that changes a layout) and
raises ValueError / JobError with the job untouched. A transition that fails part-way (TransitionFailed)
leaves a complete copy of every model-stage; the job gets that state back in the graph's old plan
(moved back by a second transition where the failure left it elsewhere), and the error is re-raised. If
moving back fails too, :class:`MoveError` says so: the state is still complete, in the layout the
error's ``plan`` describes, but the job cannot step on it; restart from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax

from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.executor import TransitionExecutor, TransitionFailed
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.model_stage import ACTOR_GEN, ModelStage

if TYPE_CHECKING:
    from nereus_jax.runtime.step.job import Job, Prepared


class MoveError(RuntimeError):
    """A move failed and so did moving its state back: every model-stage still has a complete copy,
    laid out as ``plan``, which the job holds but cannot step on."""

    def __init__(self, message: str, plan: ExecutionPlan):
        super().__init__(message)
        self.plan = plan


@dataclasses.dataclass
class Moved:
    """A finished move: the job's plan after it, the seconds of data movement (the executor's run until
    every unit is ready) and of the switch (adopting), and the executor (its ledger, trace, peaks)."""

    plan: ExecutionPlan
    movement_s: float
    switch_s: float
    executor: TransitionExecutor


class InMove:
    """Stands in the job for a model-stage's units while a move holds them: any use raises, naming it."""

    def __init__(self, stage: ModelStage):
        self.stage = stage

    def _fail(self, *args: Any) -> Any:
        raise RuntimeError(f"{self.stage}'s units are being moved by a transition: nothing may read them until "
                           "the move has finished (the executor holds the only copy)")

    __getitem__ = __iter__ = __len__ = _fail

    def __repr__(self) -> str:
        return f"InMove({self.stage})"


def move(job: Job, graph: TransitionGraph, *, prepared: Prepared | None = None,
         executor: TransitionExecutor | None = None) -> Moved:
    """Runs ``graph`` on ``job``'s units and adopts the result (see the module docstring). Raises before
    anything moves when the graph or its target does not fit the job; re-raises TransitionFailed after
    giving the job its state back."""
    executor = executor or TransitionExecutor()
    whole = set(graph.new_plan) == set(job.plan)
    sync = job.check_plan(graph.new_plan) if whole else _check_parking(job, graph)
    units = _take(job, graph)
    keep = _outside(job)
    t0 = time.perf_counter()
    try:
        out = executor.run(graph, units, keep=keep, share=job.stages.share_groups)
    except TransitionFailed as failed:
        del units  # the executor freed what it moved: the survivors are the state now
        _give_back(job, graph, failed.units, failed.plan, failed)
        raise
    except ValueError:  # the units do not match the graph: nothing ran
        _put(job, units)
        raise
    del units  # the executor freed or handed on every buffer of them
    jax.block_until_ready([u.leaves for us in out.values() for u in us])
    t1 = time.perf_counter()
    if whole:
        job.adopt(graph.new_plan, out, prepared, sync=sync)
    else:
        _put(job, out)
    return Moved(job.plan, t1 - t0, time.perf_counter() - t1, executor)


def _check_parking(job: Job, graph: TransitionGraph) -> None:
    """A graph over some of the job's model-stages may only change where their state lives."""
    for ms, sp in graph.new_plan.items():
        if ms not in job.plan:
            raise ValueError(f"the graph moves {ms}, which the job does not run (its model-stages: "
                             f"{', '.join(map(str, job.plan))})")
        if dataclasses.replace(sp, memory=job.plan[ms].memory) != job.plan[ms]:
            raise ValueError(f"the graph changes {ms}'s layout or devices ({sp.layout} on {list(sp.replicas)}; the "
                             f"plan has {job.plan[ms].layout} on {list(job.plan[ms].replicas)}) but covers only "
                             f"{', '.join(map(str, graph.new_plan))}: a layout change moves the whole plan, so build "
                             "the graph from every model-stage of the job to a complete target plan")


def _take(job: Job, graph: TransitionGraph) -> dict[ModelStage, list[EMU]]:
    """The job's units the graph starts from, in its order; the job holds placeholders for those stages
    from now on. Raises ValueError, the job untouched, when it does not hold one of them."""
    taken: dict[ModelStage, list[EMU]] = {}
    for ms, uids in graph.initial.items():
        held = job.units.get(ms)
        if held is None or isinstance(held, InMove):
            raise ValueError(f"the graph starts from {ms}, whose units the job does not hold ({held!r})")
        where = {(u.device_ids, u.layout, u.memory): u for u in held}
        picked = []
        for uid in uids:
            want = graph.units[uid]
            emu = where.get((want.devices, want.layout, want.memory))
            if emu is None:
                raise ValueError(f"{ms}: the graph starts from {want.label()}, which the job does not hold (it holds "
                                 f"{held}); build the graph from the job's units (e.g. TransitionGraph.build(job.plan,"
                                 " target, job.specs))")
            picked.append(emu)
        taken[ms] = picked
    for ms in taken:
        job.stages.replace(ms, InMove(ms))  # in place: another thread reading other stages sees no change
    return taken


def _outside(job: Job) -> list[EMU]:
    """The job's units a move does not hold: with LoRA they may share the frozen base's buffers with the moved
    ones (``elastic/shared_base.py``), so the executor must not delete or donate what they hold."""
    return job.stages.held_outside()


def _put(job: Job, units: Mapping[ModelStage, list[EMU]]) -> None:
    for ms, us in units.items():
        job.stages.replace(ms, list(us))


def _give_back(job: Job, graph: TransitionGraph, units: dict[ModelStage, list[EMU]], plan: ExecutionPlan,
               failure: BaseException) -> None:
    """After a failed move: the job gets its state back in the graph's old plan."""
    if plan != graph.old_plan:  # part of the move happened: move the survivors back where they were
        try:
            back = TransitionGraph.build(plan, graph.old_plan, {ms: job.specs[ms] for ms in graph.initial},
                                         caps=graph.caps, host_cap=graph.host_cap)
            units = TransitionExecutor().run(back, units, keep=_outside(job), share=job.stages.share_groups)
        except TransitionFailed as again:
            _put(job, again.units)
            raise MoveError(f"{failure}; moving the state back to the old plan failed too ({again}): every "
                            f"model-stage still has a complete copy, laid out as\n{again.plan}\nbut the job cannot "
                            "step on it: restart from the last checkpoint", again.plan) from again
        except ValueError as again:  # no transition reaches the old plan (e.g. it no longer fits the caps)
            _put(job, units)
            raise MoveError(f"{failure}; no transition leads back to the old plan ({again}): every model-stage "
                            f"still has a complete copy, laid out as\n{plan}\nbut the job cannot step on it: "
                            "restart from the last checkpoint", plan) from again
    _put(job, units)
    if ACTOR_GEN in units and graph.old_plan[ACTOR_GEN] == job.plan.get(ACTOR_GEN):
        job.load_state(dict(job.units), job.version)  # the engines take the parameters they have now


__all__ = ["InMove", "MoveError", "Moved", "move"]
