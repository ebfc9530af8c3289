"""The per-step weight sync actor-train -> actor-gen, as a small transition on the same machinery.

Within one execution plan, the generation units are re-derived from the training units' parameters
(cast to the generation dtype on the way, optimizer state left behind): Derive on the training devices
(into the largest layout both stages split into), Extend where the devices differ, Merge into the
generation layout; the stale generation units are destroyed first. The graph depends only on the plan,
so it is built once per plan and reused every step.

    sync = WeightSync(plan, train_spec, gen_spec, caps=cfg.cluster.device_memory_bytes)
    gen_units = sync(train_units, gen_units)     # after every optimizer step
"""

from __future__ import annotations

from collections.abc import Sequence

from nereus_jax.model_stage import ACTOR_GEN, ACTOR_TRAIN, ModelStage

from .emu import EMU
from .executor import TransitionExecutor
from .graph import TransitionGraph
from .plan import ExecutionPlan
from .spec import StateSpec, check_derivable


class WeightSync:
    """Syncs ``dst`` (default actor-gen) from ``src`` (actor-train) within ``plan``."""

    def __init__(self, plan: ExecutionPlan, train_spec: StateSpec, gen_spec: StateSpec, *,
                 src: ModelStage = ACTOR_TRAIN, dst: ModelStage = ACTOR_GEN, caps: int | None = None,
                 executor: TransitionExecutor | None = None, keep_old: bool = False):
        check_derivable(train_spec, gen_spec)
        self.src, self.dst, self.keep_old = src, dst, keep_old
        self.graph = TransitionGraph.weight_sync(plan, src, dst, {src: train_spec, dst: gen_spec}, caps=caps,
                                                 keep_old=keep_old)
        self.executor = executor or TransitionExecutor()

    def __call__(self, train_units: Sequence[EMU], gen_units: Sequence[EMU]) -> list[EMU]:
        """Fresh generation units (``gen_units`` are consumed; ``train_units`` stay as they are)."""
        out = self.executor.run(self.graph, {self.src: train_units, self.dst: [] if self.keep_old else gen_units})
        return out[self.dst]
