"""A replica's shape, ``Layout(tp, pp, ep)``, and :class:`LayoutError`, without JAX.

Execution plans, the planner and the simulator name layouts without touching devices, so the type lives
here; ``nereus_jax.sharding`` (meshes, laying arrays out for a layout) re-exports both.
"""

from __future__ import annotations

import dataclasses


class LayoutError(ValueError):
    """A layout that cannot hold a model (a dimension it cannot divide, or too few devices)."""


@dataclasses.dataclass(frozen=True, order=True)
class Layout:
    """One replica's shape: tensor-parallel degree ``tp`` times pipeline degree ``pp`` times expert-parallel
    degree ``ep`` (mixture-of-experts models only: the experts split over ``ep`` devices)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.tp < 1 or self.pp < 1 or self.ep < 1:
            raise LayoutError(f"Layout(tp={self.tp}, pp={self.pp}, ep={self.ep}): degrees must be >= 1")

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.ep

    def __str__(self) -> str:
        return f"tp{self.tp}xpp{self.pp}" + (f"xep{self.ep}" if self.ep > 1 else "")
