"""The cost model: pure functions of (model config, stage choice, workload, hardware) for latency per
efficiency class, memory per device and transition costs, plus ``CostModel``, which holds one learned
efficiency per operation class and refits them from measurements (``observe``)."""

from nereus_jax.elastic.costs.counts import (
    attention_flops,
    head_flops_per_token,
    kv_bytes_per_token,
    layer_flops_per_token,
    layer_params_per_device,
    layout_problem,
    param_count,
    params_per_device,
)
from nereus_jax.elastic.costs.latency import Breakdown, allreduce_seconds, efficiency_vector, stage_latency
from nereus_jax.elastic.costs.memory import (
    StageMemory,
    device_peak_bytes,
    resident_bytes,
    stage_memory,
    state_bytes,
    working_bytes,
)
from nereus_jax.elastic.costs.model import (
    LINK_TYPES,
    CostModel,
    Measurement,
    link_bandwidth,
    transfer_seconds,
    transition_seconds,
)
from nereus_jax.elastic.costs.stage import StageChoice, pipeline_microbatches

__all__ = [
    "LINK_TYPES",
    "Breakdown",
    "CostModel",
    "Measurement",
    "StageChoice",
    "StageMemory",
    "allreduce_seconds",
    "attention_flops",
    "device_peak_bytes",
    "efficiency_vector",
    "head_flops_per_token",
    "kv_bytes_per_token",
    "layer_flops_per_token",
    "layer_params_per_device",
    "layout_problem",
    "link_bandwidth",
    "param_count",
    "params_per_device",
    "pipeline_microbatches",
    "resident_bytes",
    "state_bytes",
    "stage_latency",
    "stage_memory",
    "transfer_seconds",
    "transition_seconds",
    "working_bytes",
]
