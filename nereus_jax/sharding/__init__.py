"""Layouts, meshes from device lists, and logical-axis rules per stage kind (gen, infer, train)."""

from nereus_jax.sharding.layout import (
    Layout,
    LayoutError,
    activation_sharding,
    bytes_per_device,
    check_layout,
    collapse_kv,
    expand_kv,
    gather_params,
    kv_repeat,
    logical_to_spec,
    make_mesh,
    param_shardings,
    shard_params,
    stored_shapes,
    sync_kv_grads,
)
from nereus_jax.sharding.pipeline import (
    PipelineError,
    bubble_fraction,
    pipeline_forward,
    pipeline_forward_fn,
    pipeline_forward_with_cache,
)
from nereus_jax.sharding.rules import RULES, rules_for

__all__ = [
    "RULES",
    "Layout",
    "LayoutError",
    "PipelineError",
    "activation_sharding",
    "bubble_fraction",
    "bytes_per_device",
    "check_layout",
    "collapse_kv",
    "expand_kv",
    "gather_params",
    "kv_repeat",
    "logical_to_spec",
    "make_mesh",
    "param_shardings",
    "pipeline_forward",
    "pipeline_forward_fn",
    "pipeline_forward_with_cache",
    "rules_for",
    "shard_params",
    "stored_shapes",
    "sync_kv_grads",
]
