"""Logical-axis rules per stage kind: which mesh axis each logical axis of the model is split over.

Layout policy is data. Model code names logical axes only; a stage kind's table maps them to the mesh
axes of a replica (``pp``, ``tp``) and of a multi-replica SPMD program (``dp``). ``None`` = replicated.
A mesh axis a table names but the mesh lacks (``dp`` on a single replica) is dropped.
"""

from __future__ import annotations

from types import MappingProxyType

StageKind = str  # "gen" | "infer" | "train"

_TENSOR_PARALLEL = {
    "vocab": "tp",
    "embed": None,
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "layers": "pp",
    "labels": None,
    "batch": "dp",
    "length": None,
    "lora_rank": None,
    "experts": None,  # experts replicated over tp (each split on its mlp axis); expert parallelism: not yet
}

RULES: MappingProxyType = MappingProxyType({
    # Generation: weights split Megatron-style over tp, the KV cache over kv heads on tp.
    "gen": MappingProxyType(dict(_TENSOR_PARALLEL)),
    # Forward-only scoring (actor-infer, ref-infer, critic-infer, reward-infer).
    "infer": MappingProxyType(dict(_TENSOR_PARALLEL)),
    # Training: same parameter layout; optimizer state is laid out like the parameters, and with
    # plan.shard_optimizer also split over dp along the first of OPTIMIZER_DP_AXES that dp divides.
    "train": MappingProxyType(dict(_TENSOR_PARALLEL)),
})

# ZeRO-1: the logical axes an optimizer leaf may be split over dp along, in order of preference. Each is one
# the rules above leave whole (replicated over tp), so a replica's block is a slice of its tp shard.
OPTIMIZER_DP_AXES = ("embed", "head_dim", "lora_rank", "labels")

MESH_AXES = ("dp", "pp", "tp")


def rules_for(kind: StageKind) -> MappingProxyType:
    """The rules table of a stage kind; unknown kinds are an error naming the valid ones."""
    try:
        return RULES[kind]
    except KeyError:
        raise ValueError(f"unknown stage kind {kind!r}; expected one of {sorted(RULES)}") from None
