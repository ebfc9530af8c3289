"""What the transition graph needs to know about a model-stage's state, without JAX: :class:`StateBytes`, the
contract (bytes per device for a layout, and whether a layout can hold it), and :class:`ByteSpec`, that
contract from byte counts alone, which the simulator and the graph tests use. ``elastic.spec.StateSpec`` is
the real one, from a model's parameter tree.

    ByteSpec(16 * 2**30).bytes_per_device(Layout(tp=2))   # 8 GiB
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from nereus_jax.layout import Layout


class StateBytes(Protocol):
    """What the transition graph needs to know about a model-stage's state."""

    def bytes_per_device(self, layout: Layout) -> int: ...

    def check(self, layout: Layout) -> None: ...


@dataclasses.dataclass(frozen=True)
class ByteSpec:
    """A replica's state as byte counts only (simulations): ``sharded_bytes`` split evenly over the
    replica's tp * pp devices, ``replicated_bytes`` held by every device. ``optimizer_bytes``: the part of
    ``sharded_bytes`` that is optimizer state split over the stage's replicas (plan.shard_optimizer; 0: none
    is), of which each of ``optimizer_shards`` replicas holds its share (:meth:`for_dp`)."""

    sharded_bytes: int
    replicated_bytes: int = 0
    optimizer_bytes: int = 0
    optimizer_shards: int = 1

    def bytes_per_device(self, layout: Layout) -> int:
        opt = self.optimizer_bytes if self.optimizer_shards > 1 else 0
        held = self.sharded_bytes - opt + -(-opt // self.optimizer_shards)
        return self.replicated_bytes + -(-held // layout.size)

    def param_bytes_per_device(self, layout: Layout) -> int:
        """The part of :meth:`bytes_per_device` a regroup of the optimizer leaves in place."""
        return self.replicated_bytes + -(-(self.sharded_bytes - self.optimizer_bytes) // layout.size)

    def for_dp(self, dp: int) -> ByteSpec:
        """One of ``dp`` replicas' state (see ``StateSpec.for_dp``)."""
        if dp == 1 or not self.optimizer_bytes or self.optimizer_shards != 1:
            return self
        return dataclasses.replace(self, optimizer_shards=dp)

    @property
    def whole(self) -> ByteSpec:
        return dataclasses.replace(self, optimizer_shards=1)

    def check(self, layout: Layout) -> None:
        return None
