"""Llama/Qwen2/Qwen3-family decoder in Flax NNX (logical axes only, no meshes) and Hugging Face import/export
(host numpy; a streaming reader of checkpoint slices)."""

from nereus_jax.models.decoder import (
    Decoder,
    abstract_params,
    apply_layers,
    causal_mask,
    count_params,
    default_positions,
    embed_tokens,
    forward,
    init_params,
    output_head,
    param_axes,
)
from nereus_jax.models.hf import (
    HFCheckpoint,
    HFImportError,
    hf_config_from_model,
    load_hf,
    model_config_from_hf,
    save_hf,
)

__all__ = [
    "Decoder",
    "HFCheckpoint",
    "HFImportError",
    "abstract_params",
    "apply_layers",
    "causal_mask",
    "count_params",
    "default_positions",
    "embed_tokens",
    "forward",
    "hf_config_from_model",
    "init_params",
    "load_hf",
    "model_config_from_hf",
    "output_head",
    "param_axes",
    "save_hf",
]
