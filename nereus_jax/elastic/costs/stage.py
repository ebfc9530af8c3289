"""The per-stage decision the cost model prices and the planner chooses, and the pipeline micro-batching it
implies (model-stage names and their split live in :mod:`nereus_jax.model_stage`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from nereus_jax.model_stage import StageError


@dataclass(frozen=True, order=True)
class StageChoice:
    """How one model-stage runs: ``dp`` replicas of a (tp, pp, ep) layout, ``micro_batch`` sequences per
    forward/backward call (per replica; gen: concurrent decode slots per replica) and, for training,
    rematerialisation. Calls per step = sequences per replica / micro_batch (gradient accumulation).
    ``ep`` (mixture-of-experts models, scoring and training): the experts split over ep devices, each of which
    runs the rest of the model on all of the call's rows; last so that every (tp, pp, dp, micro_batch, remat)
    choice reads as before."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    remat: bool = False
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "ep"):
            if getattr(self, name) < 1:
                raise StageError(f"StageChoice.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def devices(self) -> int:
        """Devices the stage occupies: dp replicas of tp * pp * ep."""
        return self.tp * self.pp * self.ep * self.dp

    def __str__(self) -> str:
        remat = " remat" if self.remat else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return f"tp{self.tp} pp{self.pp}{ep} dp{self.dp} mb{self.micro_batch}{remat}"


def pipeline_microbatches(micro_batch, pp: int):
    """GPipe micro-batches inside one call: the largest divisor of ``micro_batch`` up to 4 * pp
    (bubble (pp - 1) / (m + pp - 1) <= 20% when the call is large enough); 1 without pipelining.
    An array of call sizes gives an array."""
    if pp == 1:
        return 1
    if isinstance(micro_batch, np.ndarray):
        return np.array([_microbatches(int(b), pp) for b in micro_batch])
    return _microbatches(micro_batch, pp)


@functools.lru_cache(maxsize=4096)
def _microbatches(micro_batch: int, pp: int) -> int:
    return max(m for m in range(1, min(micro_batch, 4 * pp) + 1) if micro_batch % m == 0)


def stash_microbatches(microbatches, pp: int):
    """Stage inputs a device of a 1F1B training call holds at once: min(m, 2 pp - 1) (the schedule is lock-step,
    so stage 0 holds a micro-batch from its forward until its backward 2 (pp - 1) ticks later; see
    :mod:`nereus_jax.sharding.pipeline`). ``microbatches`` may be an array."""
    return np.minimum(microbatches, 2 * pp - 1)


def one_f_one_b(pp: int, workload) -> bool:
    """Whether a training stage with this pp runs the 1F1B schedule (pp > 1 and the workload's schedule)."""
    return pp > 1 and workload.pipeline_schedule == "1f1b"


def head_split(micro_batch, pp: int):
    """Over how many stages GPipe runs the output head: pp when each micro-batch's rows (per replica) divide
    by pp, so the hand-off leaves every stage 1/pp of them, else 1: every stage runs the head on the whole
    call (:mod:`nereus_jax.sharding.pipeline`). ``micro_batch`` may be an array."""
    rows = micro_batch / pipeline_microbatches(micro_batch, pp)
    return np.where(np.mod(rows, pp) == 0, pp, 1) if isinstance(rows, np.ndarray) else (pp if rows % pp == 0 else 1)
