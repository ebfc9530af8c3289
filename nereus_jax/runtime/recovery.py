"""Coming back from a device failing mid-step: from the units that survived on the remaining devices (a
live move, no checkpoint read) when they are one complete state as of the step's start, else from the
last checkpoint on a plan for the survivors. The controller's path (``Adapter.lose``) picks the target;
without it, the config's plan on the survivors."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from nereus_jax.config import Config, ConfigError
from nereus_jax.elastic.executor import TransitionFailed
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.elastic.recipe import align_ranks
from nereus_jax.runtime.checkpoint import CheckpointError, latest_step, restore_job
from nereus_jax.runtime.initial_plan import plan_from_config
from nereus_jax.runtime.job import Job
from nereus_jax.runtime.move import MoveError, move
from nereus_jax.sharding import device_index


@dataclasses.dataclass
class Recovery:
    """How a job came back from a device loss: ``how`` is "survivors" (re-planned from the units left on
    the surviving devices, the failed step is redone) or "checkpoint" (restored from ``checkpoint``)."""

    job: Job
    how: str
    next_step: int
    reason: str
    checkpoint: str | None = None

    def describe(self) -> str:
        src = "the surviving units" if self.how == "survivors" else f"checkpoint {self.checkpoint}"
        return f"recovered from {src} ({self.reason}); continuing at step {self.next_step} on\n{self.job.plan}"


def training_snapshot(job: Job) -> dict[str, int]:
    """What :func:`recover_from_device_loss` compares against: the job's count of updates per training
    model-stage at the step's start. Free: nothing is read from the devices."""
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


def recover_from_device_loss(job: Job, lost: Sequence[int], step: int, before: Mapping[str, int],
                             checkpoint_dir: str | None, *, plan: ExecutionPlan | None = None) -> Recovery:
    """After ``DeviceLost(lost)`` during ``step`` (``before`` = :func:`training_snapshot` at the step's start):
    when every model-stage still has a complete replica holding its state as of the step's start, ``job``
    itself moves onto ``plan`` (a transition graph from the surviving units, run by
    :func:`nereus_jax.runtime.move.move`: no checkpoint read); otherwise, or when no transition reaches
    ``plan`` or it fails, a new Job on ``plan`` restores the last checkpoint. ``plan`` defaults to the
    config's plan on the survivors (:func:`plan_for_devices`): the run loop with the controller on recovers
    through ``Adapter.lose`` instead, which passes the controller's urgent choice, so a device failing and
    one leaving with notice land on the same plan."""
    lost = {int(d) for d in lost}
    if plan is None:
        plan = plan_for_devices(job.cfg, [i for i, d in enumerate(job.devices) if device_index(d) not in lost],
                                job.rows)
    left, reason = surviving_state(job, lost, step, before)
    if left is not None:  # the urgent path: a transition from what survived, device to device
        plan = align_ranks(left, plan)
        try:
            graph = TransitionGraph.build(left, plan, job.specs, caps=job.cfg.cluster.device_memory_bytes)
            move(job, graph)
            return Recovery(job, "survivors", step, reason)
        except (TransitionFailed, MoveError, ValueError) as e:  # ValueError: Infeasible, a plan the job cannot run
            reason = f"{reason}, but no live transition onto the survivors succeeded ({type(e).__name__}: {e})"
    return restore_after_loss(job, plan, step, reason, checkpoint_dir)


def restore_after_loss(job: Job, plan: ExecutionPlan, step: int, reason: str, checkpoint_dir: str | None
                       ) -> Recovery:
    """A new Job on ``plan`` restored from the last checkpoint under ``checkpoint_dir`` (``reason``: why the
    surviving units could not be used). Raises CheckpointError, naming the fix, when there is none."""
    if checkpoint_dir is None or latest_step(checkpoint_dir) is None:
        raise CheckpointError(f"{reason}, and there is no checkpoint to restore (checkpoint.dir={checkpoint_dir!r}): "
                              "set checkpoint.every_steps so that a loss costs at most that many steps")
    new, meta = restore_job(job.cfg, job.task, job.tok, checkpoint_dir, plan=plan, devices=job.devices)
    return Recovery(new, "checkpoint", meta["step"], reason, meta["_step_dir"])


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
