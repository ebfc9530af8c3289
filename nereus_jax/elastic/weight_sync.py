"""The per-step weight sync actor-train -> actor-gen, as a small transition on the same machinery.

Within one execution plan, the generation units are re-derived from the training units' parameters
(cast to the generation dtype on the way, optimizer state left behind): Derive on the training devices
(into the largest layout both stages split into), Extend where the devices differ, Merge into the
generation layout; the stale generation units are destroyed first. The graph depends only on the plan,
so it is built once per plan and reused every step. With LoRA only the adapters are re-derived: the frozen
base stays in the generation units (see :class:`WeightSync`).

    sync = WeightSync(plan, train_spec, gen_spec, caps=cfg.cluster.device_memory_bytes)
    gen_units = sync(train_units, gen_units)     # after every optimizer step
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from nereus_jax.model_stage import ACTOR_GEN, ACTOR_TRAIN, ModelStage
from nereus_jax.models.lora import is_adapter

from .emu import EMU
from .executor import TransitionExecutor
from .graph import TransitionGraph
from .plan import ExecutionPlan
from .spec import StateSpec, check_derivable


class WeightSync:
    """Syncs ``dst`` (default actor-gen) from ``src`` (actor-train) within ``plan``.

    With LoRA (``model.lora_rank``) only the adapters change between syncs: the generation units keep their
    frozen base leaves and only the adapter leaves are re-derived (``adapters_only``, the default for a
    LoRA model), a few MB instead of the model. Generation units that are missing (a job rebuilding them) get
    the whole tree.

    ``keep_old`` (async's double buffer): the generating units stay intact while the new ones are derived; with
    adapters only, the new units hold new adapters beside the same frozen base buffers as the old ones (nothing
    writes or donates a frozen leaf), so the double buffer costs one more copy of the adapters, not the model."""

    def __init__(self, plan: ExecutionPlan, train_spec: StateSpec, gen_spec: StateSpec, *,
                 src: ModelStage = ACTOR_TRAIN, dst: ModelStage = ACTOR_GEN, caps: int | None = None,
                 executor: TransitionExecutor | None = None, keep_old: bool = False,
                 adapters_only: bool | None = None):
        check_derivable(train_spec, gen_spec)
        self.src, self.dst, self.keep_old = src, dst, keep_old
        self.plan, self.specs, self.caps = plan, {src: train_spec, dst: gen_spec}, caps
        if adapters_only is None:
            adapters_only = bool(train_spec.model.lora_rank)
        self.index = adapter_indices(train_spec) if adapters_only else None
        self._full: TransitionGraph | None = None
        if self.index:
            self.sub_specs = {src: train_spec.subset(self.index), dst: gen_spec.subset(self.index)}
            self.graph = TransitionGraph.weight_sync(plan, src, dst, self.sub_specs, caps=caps, keep_old=keep_old)
        else:
            self.index = None
            self.graph = self._full = TransitionGraph.weight_sync(plan, src, dst, self.specs, caps=caps,
                                                                  keep_old=keep_old)
        self.executor = executor or TransitionExecutor()

    def __call__(self, train_units: Sequence[EMU], gen_units: Sequence[EMU], keep: Sequence[EMU] = ()) -> list[EMU]:
        """Fresh generation units (``gen_units`` are consumed; ``train_units`` stay as they are). ``keep``: other
        units that may share buffers with these (LoRA's shared base), left intact."""
        old = {u.devices: u for u in gen_units}
        if self.index is None or set(old) != {self._devices(r) for r in self.plan[self.dst].replicas}:
            return self._whole(train_units, gen_units, keep)
        views = {self.src: [self._view(u, self.src) for u in train_units],
                 self.dst: [] if self.keep_old else [self._view(u, self.dst) for u in gen_units]}
        out = []
        for new in self.executor.run(self.graph, views)[self.dst]:
            leaves = list(old[new.devices].leaves)
            for j, i in enumerate(self.index):
                leaves[i] = new.leaves[j]
            out.append(dataclasses.replace(old[new.devices], leaves=leaves))
        return out

    @property
    def moved_bytes_per_device(self) -> int:
        """Bytes one generation device receives per sync (its layout's share of what is re-derived)."""
        spec = self.sub_specs[self.dst] if self.index is not None else self.specs[self.dst]
        return spec.bytes_per_device(self.plan[self.dst].layout)

    def _whole(self, train_units: Sequence[EMU], gen_units: Sequence[EMU], keep: Sequence[EMU]) -> list[EMU]:
        if self._full is None:
            self._full = TransitionGraph.weight_sync(self.plan, self.src, self.dst, self.specs, caps=self.caps,
                                                     keep_old=self.keep_old)
        out = self.executor.run(self._full, {self.src: train_units, self.dst: [] if self.keep_old else gen_units},
                                keep=keep)
        return out[self.dst]

    def _view(self, unit: EMU, stage: ModelStage) -> EMU:
        return dataclasses.replace(unit, leaves=[unit.leaves[i] for i in self.index], spec=self.sub_specs[stage])

    @staticmethod
    def _devices(replica) -> tuple:
        from nereus_jax.sharding import device_at

        return tuple(device_at(i) for i in replica)


def adapter_indices(spec: StateSpec) -> list[int]:
    """Positions of the LoRA adapter leaves among ``spec``'s parameter leaves."""
    paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(spec.params_def, list(range(spec.n_params))))[0]
    return [i for (path, i) in paths if is_adapter(tuple(getattr(k, "key", k) for k in path))]
