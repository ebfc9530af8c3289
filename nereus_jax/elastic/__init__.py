"""The Nereus core: Elastic Model Units, execution plans, the transition graph and its executor.

Public names are imported lazily, so ``import nereus_jax.elastic.<module>`` stays cheap for the planner
and the simulator (plans and graphs are metadata; only EMUs and the executor touch arrays).

    from nereus_jax.elastic import ExecutionPlan, StagePlan, ModelStage, StateSpec, EMU
    from nereus_jax.elastic import TransitionGraph, TransitionExecutor, align_ranks, WeightSync
"""

import importlib

_EXPORTS = {
    "plan": ("DEVICE", "HOST", "ExecutionPlan", "ModelStage", "PlanError", "StagePlan"),
    "spec": ("StateSpec", "transition_bytes"),
    "state_bytes": ("ByteSpec",),
    "emu": ("EMU", "assemble_replicas", "split_replicas"),
    "ledger": ("CapExceeded", "Ledger"),
    "graph": ("TransitionError", "TransitionGraph", "plan_usage"),
    "recipe": ("align_ranks",),
    "schedule": ("Infeasible",),
    "executor": ("ChecksumMismatch", "InjectedFailure", "TransitionExecutor", "TransitionFailed"),
    "weight_sync": ("WeightSync",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
