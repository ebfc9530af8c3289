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
    replica's tp * pp devices, ``replicated_bytes`` held by every device."""

    sharded_bytes: int
    replicated_bytes: int = 0

    def bytes_per_device(self, layout: Layout) -> int:
        return self.replicated_bytes + -(-self.sharded_bytes // layout.size)

    def check(self, layout: Layout) -> None:
        return None
