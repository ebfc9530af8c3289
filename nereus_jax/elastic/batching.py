"""DP changes keep the global batch fixed: dp x per-replica batch x accumulation steps == global batch.

Only DP degrees for which such a split exists are valid (the paper's rule; the planner filters its
candidates with :func:`valid_dp_degrees`). Among the splits of one dp degree, the one with the largest
per-replica batch that fits ``max_per_replica`` (fewest accumulation steps) is the default.

    valid_dp_degrees(64, max_dp=8)                  # [1, 2, 4, 8]
    choose_batch_split(64, dp=4, max_per_replica=8)  # BatchSplit(dp=4, per_replica=8, accumulation=2)
"""

from __future__ import annotations

import dataclasses


class BatchError(ValueError):
    """A DP degree that cannot keep the global batch fixed."""


@dataclasses.dataclass(frozen=True, order=True)
class BatchSplit:
    """How one step's global batch runs: ``dp`` replicas x ``per_replica`` rows x ``accumulation`` steps."""

    dp: int
    per_replica: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.dp * self.per_replica * self.accumulation


def batch_splits(global_batch: int, dp: int, max_per_replica: int | None = None) -> list[BatchSplit]:
    """Every (per-replica batch, accumulation) with dp * b * a == global_batch, largest b first."""
    if global_batch < 1 or dp < 1:
        raise BatchError(f"global batch ({global_batch}) and dp ({dp}) must be >= 1")
    if global_batch % dp:
        return []
    rows = global_batch // dp
    cap = rows if max_per_replica is None else min(rows, max_per_replica)
    return [BatchSplit(dp, b, rows // b) for b in range(cap, 0, -1) if rows % b == 0]


def valid_dp_degrees(global_batch: int, max_dp: int, max_per_replica: int | None = None) -> list[int]:
    """The DP degrees up to ``max_dp`` that can keep ``global_batch`` fixed."""
    return [dp for dp in range(1, max_dp + 1) if batch_splits(global_batch, dp, max_per_replica)]


def choose_batch_split(global_batch: int, dp: int, max_per_replica: int | None = None) -> BatchSplit:
    """The split with the largest per-replica batch (fewest accumulation steps); BatchError if none."""
    splits = batch_splits(global_batch, dp, max_per_replica)
    if not splits:
        valid = valid_dp_degrees(global_batch, max(dp, 1) * 2, max_per_replica)
        raise BatchError(f"dp={dp} cannot keep the global batch of {global_batch} fixed "
                         f"(dp x per-replica batch x accumulation must equal it); valid dp degrees up to "
                         f"{2 * dp}: {valid}")
    return splits[0]
