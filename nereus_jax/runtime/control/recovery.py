"""Coming back from a device failing mid-step, as one policy (:func:`recover`): one decision picks the target
plan (the controller's urgent choice, with the survivors' plan in its observation; without a controller, or
before it has a candidate, the config's plan on the survivors), then the job moves there from the units that
survived (a live move, no checkpoint read) when they are one complete state as of the step's start, else the
same job object restores its last checkpoint onto that target. The job is never replaced: every loop that
holds it keeps running the recovered one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from nereus_jax.config import Config, ConfigError
from nereus_jax.elastic.controller import Decision
from nereus_jax.elastic.executor import TransitionFailed
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.elastic.recipe import align_ranks
from nereus_jax.runtime.durability.checkpoint import CheckpointError, latest_step, restore_onto
from nereus_jax.runtime.step.initial_plan import plan_from_config
from nereus_jax.runtime.step.job import Job
from nereus_jax.runtime.step.move import Moved, MoveError, move
from nereus_jax.sharding import device_index

# ``decide(survivors)``: the controller's urgent decision for the pool without the lost devices, its moves
# priced from ``survivors`` (None: no live move exists); None when it has no candidate yet
Decide = Callable[[ExecutionPlan | None], Decision | None]


@dataclasses.dataclass
class Recovery:
    """How a job came back from a device loss: ``how`` is "survivors" (moved onto ``plan`` from the units left
    on the surviving devices; the failed step is redone) or "checkpoint" (``checkpoint`` restored onto ``plan``,
    steps from ``next_step`` redone). ``moved``: the live move's figures (None when nothing moved)."""

    how: str
    next_step: int
    reason: str
    plan: ExecutionPlan
    checkpoint: str | None = None
    moved: Moved | None = None

    def describe(self) -> str:
        src = "the surviving units" if self.how == "survivors" else f"checkpoint {self.checkpoint}"
        return f"recovered from {src} ({self.reason}); continuing at step {self.next_step} on\n{self.plan}"


def training_snapshot(job: Job) -> dict[str, int]:
    """What :func:`recover` compares against: the job's count of updates per training model-stage at the
    step's start. Free: nothing is read from the devices."""
    return {str(ms): job.updates.get(ms, 0) for ms in job.units if ms.kind == "train"}


def surviving_state(job: Job, lost: Sequence[int], step: int, before: Mapping[str, int]
                    ) -> tuple[ExecutionPlan | None, str]:
    """After ``lost`` devices failed during ``step`` (``before`` = :func:`training_snapshot` at its start): the
    plan of the job's units on the surviving devices when they are one complete state as of the step's start
    (every model-stage kept a replica and no training stage had updated), else None; and why, for the log."""
    lost = {int(d) for d in lost}
    survivors = {ms: [u for u in units if not lost & set(u.device_ids)] for ms, units in job.units.items()}
    gone = sorted(str(ms) for ms, us in survivors.items() if not us)
    if gone:
        return None, f"devices {sorted(lost)} lost; no replica of {', '.join(gone)} survived"
    split = sorted(str(ms) for ms, us in survivors.items() if us[0].spec.shards > 1 and len(us) < len(job.units[ms]))
    if split:  # each replica held its own block of the optimizer state (plan.shard_optimizer)
        return None, (f"devices {sorted(lost)} lost with a block of the optimizer state of {', '.join(split)}, "
                      "which each replica holds a block of (plan.shard_optimizer; false keeps whole copies)")
    moved = [str(ms) for ms, us in survivors.items()
             if ms.kind == "train" and (job.updates.get(ms, 0) != before.get(str(ms), 0)
                                        or any(x.is_deleted() for u in us for x in u.leaves))]
    if moved:
        return None, f"devices {sorted(lost)} lost after {', '.join(moved)} had updated in step {step}"
    left = ExecutionPlan({ms: StagePlan(us[0].layout, tuple(u.device_ids for u in us), us[0].memory)
                          for ms, us in survivors.items()})
    return left, f"devices {sorted(lost)} lost; every model-stage kept a replica"


def recover(job: Job, lost: Sequence[int], step: int, before: Mapping[str, int], checkpoint_dir: str | None,
            *, decide: Decide | None = None) -> Recovery:
    """Recovers ``job`` in place after ``DeviceLost(lost)`` during ``step`` (``before`` = :func:`training_snapshot`
    at the step's start); the one device-loss policy of the runtime.

    1. What survived: the plan of the surviving units when they are one complete state as of the step's start
       (:func:`surviving_state`), else None. When the lost devices held none of the job's units, nothing moves.
    2. One decision: ``decide(survivors)`` (the adapter's controller, its urgent path with the survivors' plan in
       its observation) gives the target: its admitted choice, or, when no live transition reaches any of its
       candidates, the best of them. Without ``decide``, or when it has no candidate yet, the target is the
       config's plan on the surviving devices (:func:`plan_for_devices`).
    3. A live move from the survivors onto the target (:func:`nereus_jax.runtime.step.move.move`, the transition graph
       the decision priced when it has one) when they are one complete state; otherwise, or when the move
       fails (and leaves the job's units as they were), the last checkpoint under ``checkpoint_dir`` is
       restored onto the target, into the same job (:func:`nereus_jax.runtime.durability.checkpoint.restore_onto`).
       Raises CheckpointError, naming the fix, when that is needed and there is none."""
    lost = {int(d) for d in lost}
    left, reason = surviving_state(job, lost, step, before)
    if left == job.plan:  # the failed devices held none of the job's units
        return Recovery("survivors", step, f"{reason}; none of them held the job's state", job.plan)
    decision = decide(left) if decide is not None else None
    graph = None
    if decision is not None and decision.admitted:
        target, graph, why = decision.target, decision.move, "moved to the controller's urgent target"
    elif decision is not None and decision.rejected:  # no live transition reaches any candidate
        target, why = decision.rejected[0][0], "the controller's best candidate"
        if left is not None:
            reason = f"{reason}, but no live transition reaches a candidate"
            left = None
    else:
        survivors = [i for i, d in enumerate(job.devices) if device_index(d) not in lost]
        target, why = plan_for_devices(job.cfg, survivors, job.rows), "the config's plan on the survivors"
    if left is not None:
        try:
            if not (isinstance(graph, TransitionGraph) and graph.old_plan == left):  # priced without one
                graph = TransitionGraph.build(left, align_ranks(left, target), job.specs,
                                              caps=job.cfg.cluster.device_memory_bytes)
            moved = move(job, graph)
            return Recovery("survivors", step, f"{reason}; {why}", job.plan, moved=moved)
        except (TransitionFailed, MoveError, ValueError) as e:  # ValueError: Infeasible, a plan it cannot run
            reason = f"{reason}, but no live move onto the survivors succeeded ({type(e).__name__}: {e})"
    if checkpoint_dir is None or latest_step(checkpoint_dir) is None:
        raise CheckpointError(f"{reason}, and there is no checkpoint to restore (checkpoint.dir={checkpoint_dir!r}): "
                              "set checkpoint.every_steps so that a loss costs at most that many steps")
    meta = restore_onto(job, checkpoint_dir, target)
    return Recovery("checkpoint", meta["step"], f"{reason}; restored onto {why}", job.plan, meta["_step_dir"])


def plan_for_devices(cfg: Config, device_ids: Sequence[int], rows: int) -> ExecutionPlan:
    """The config's plan on the largest prefix of ``device_ids`` it fits (every non-generation stage's dp
    dividing the ``rows`` rollouts of a step)."""
    for k in range(len(device_ids), 0, -1):
        try:
            plan = plan_from_config(cfg, list(device_ids[:k]))
        except ConfigError:
            continue
        if all(ms.kind == "gen" or rows % sp.dp == 0 for ms, sp in plan.items()):
            return plan
    raise CheckpointError(f"no plan of the config fits the surviving devices {list(device_ids)}: lower the "
                          "plan's dp/tp/pp in the config")
