"""Logical-axis rules per stage kind: which mesh axis each logical axis of the model is split over.

Layout policy is data. Model code names logical axes only; a stage kind's table maps them to the mesh
axes of a replica (``pp``, ``tp``, and ``expert`` for a layout with ep > 1) and of a multi-replica SPMD
program (``dp``). ``None`` = replicated. A mesh axis a table names but the mesh lacks (``dp`` on a single
replica, ``expert`` with ep = 1) is dropped.

Expert parallelism: a mixture-of-experts layer's weights (``layers/moe/w_gate, w_up, w_down`` and their
optimizer state) are split on their ``experts`` axis over ``expert``, and on ``mlp`` over ``tp`` as a dense MLP.
Everything else, the router and every activation included, is replicated over ``expert``: the batch is not
split over it. Each expert rank runs the dense layers on the whole batch and its own experts on the pairs
routed to them; one all-reduce over ``expert`` per layer sums the ranks' outputs
(:mod:`nereus_jax.sharding.experts`). Why not the batch split over ``expert`` (MaxText/Megatron treat expert
ranks as data-parallel for the dense layers, then dispatch tokens all-to-all): the job's rows, packing,
micro-batching and pipeline micro-batches are all split over ``dp`` alone, and a replica is one model-stage
unit whose inputs are whole; keeping activations whole inside a replica keeps every one of those, the dense
path's numerics, and the transitions unchanged. The price is the dense layers computed ep times (priced as
such), for expert weights, their optimizer state and the experts' FLOPs split ep ways.
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
    "experts": "expert",  # the experts' weights over the expert-parallel axis (each also split on mlp over tp)
    "router_experts": None,  # the router's outputs: whole on every device (softmax and top-k read them all)
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

MESH_AXES = ("dp", "pp", "expert", "tp")  # "expert" only in meshes of a layout with ep > 1


def rules_for(kind: StageKind) -> MappingProxyType:
    """The rules table of a stage kind; unknown kinds are an error naming the valid ones."""
    try:
        return RULES[kind]
    except KeyError:
        raise ValueError(f"unknown stage kind {kind!r}; expected one of {sorted(RULES)}") from None
