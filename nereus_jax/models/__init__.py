"""Llama/Qwen2-family decoder in Flax NNX (logical axes only, no meshes) and Hugging Face import/export."""

from nereus_jax.models.decoder import (
    Decoder,
    KVCache,
    abstract_params,
    count_params,
    default_positions,
    forward,
    forward_with_cache,
    init_cache,
    init_params,
    param_axes,
)

__all__ = [
    "Decoder",
    "KVCache",
    "abstract_params",
    "count_params",
    "default_positions",
    "forward",
    "forward_with_cache",
    "init_cache",
    "init_params",
    "param_axes",
]
