"""Hugging Face ``config.json`` <-> the model keys of nereus_jax's config tree, without JAX.

The config tree reads a checkpoint's architecture from here when ``model.hf_path`` is given, so a
checkpoint needs no preset; ``nereus_jax.models.hf`` uses the same functions to import and export weights.
Supported: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and their
``*ForSequenceClassification`` heads, ``Qwen3MoeForCausalLM``, RoPE ``default`` or ``llama3``; anything else raises
:class:`HFImportError` naming the key and what is supported.

    keys = model_keys_from_hf(read_hf_config("/models/Qwen3-0.6B"))   # {"family": "qwen3", ...}
    hf = hf_config_from_model(cfg, head="lm")                         # a config.json dict
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class HFImportError(ValueError):
    """A Hugging Face checkpoint or config nereus_jax cannot read (the message names the file, key or tensor)."""


ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "lm"),
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "Qwen3ForCausalLM": ("qwen3", "lm"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "lm"),
    "LlamaForSequenceClassification": ("llama", "value"),
    "Qwen2ForSequenceClassification": ("qwen2", "value"),
    "Qwen3ForSequenceClassification": ("qwen3", "value"),
}
FAMILY_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}
HEAD_SUFFIX = {"lm": "ForCausalLM", "value": "ForSequenceClassification"}
# transformers' defaults when config.json omits them
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "qwen3_moe": 32768}
_DEFAULT_EPS = {"llama": 1e-6, "qwen2": 1e-6, "qwen3": 1e-6, "qwen3_moe": 1e-6}
# the model keys a checkpoint's config.json decides (the rest: dtypes, remat, paths, name)
ARCHITECTURE_KEYS = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "rope_theta", "rope_scaling", "rms_norm_eps", "qkv_bias", "qk_norm",
                     "tie_embeddings", "max_position_embeddings", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "norm_topk_prob")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise HFImportError(f"{path} is not a directory; pass a Hugging Face checkpoint directory "
                            "(config.json + *.safetensors)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HFImportError(f"{path} has no config.json: it is not a Hugging Face checkpoint directory")
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFImportError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise HFImportError(f"{config_file}: expected a JSON object, got {type(data).__name__}")
    return data


def family_and_head(hf: Mapping[str, Any]) -> tuple[str, str]:
    """(model family, head) of a config.json: head "lm" for *ForCausalLM, "value" for *ForSequenceClassification."""
    model_type = hf.get("model_type")
    supported = ", ".join(sorted(ARCHITECTURES))
    if model_type not in FAMILY_PREFIX:
        raise HFImportError(f"config.json model_type={model_type!r} (architectures={hf.get('architectures')!r}) is "
                            f"not supported; supported architectures: {supported}")
    archs = hf.get("architectures") or [FAMILY_PREFIX[model_type] + HEAD_SUFFIX["lm"]]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise HFImportError(f"config.json architectures={archs!r} is not supported; supported: {supported}")
    family, head = ARCHITECTURES[archs[0]]
    if family != model_type:
        raise HFImportError(f"config.json architectures={archs!r} does not match model_type={model_type!r}")
    return family, head


def model_keys_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture keys of ``ModelConfig`` (:data:`ARCHITECTURE_KEYS`) a ``config.json`` describes
    (transformers 4.x or 5.x format)."""
    hf = dict(hf_config)
    family, _ = family_and_head(hf)
    _reject_unsupported(hf)
    num_heads = _required(hf, "num_attention_heads")
    return {
        "family": family,
        "vocab_size": _required(hf, "vocab_size"),
        "hidden_size": _required(hf, "hidden_size"),
        "num_layers": _required(hf, "num_hidden_layers"),
        "num_heads": num_heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or num_heads),
        "head_dim": int(hf["head_dim"]) if hf.get("head_dim") else None,
        "intermediate_size": _required(hf, "intermediate_size"),
        "rope_theta": float(_rope_theta(hf)),
        "rope_scaling": _rope_scaling(hf),
        "rms_norm_eps": float(hf.get("rms_norm_eps", _DEFAULT_EPS[family])),
        "qkv_bias": family == "qwen2" or bool(hf.get("attention_bias", False)),
        "qk_norm": family in ("qwen3", "qwen3_moe"),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_position_embeddings": int(hf.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[family])),
        **_moe_keys(hf, family),
    }


def _moe_keys(hf: Mapping[str, Any], family: str) -> dict[str, Any]:
    """Qwen3-MoE's router and experts (``num_experts``, or transformers 5's ``num_local_experts``); every layer
    must be a mixture-of-experts layer."""
    if family != "qwen3_moe":  # a dense MLP: ModelConfig's defaults
        return {"num_experts": 0, "num_experts_per_tok": 2, "moe_intermediate_size": None, "norm_topk_prob": True}
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise HFImportError(f"config.json decoder_sparse_step={hf.get('decoder_sparse_step')!r} / mlp_only_layers="
                            f"{hf.get('mlp_only_layers')!r} is not supported; supported: every layer a "
                            "mixture-of-experts layer (decoder_sparse_step 1, no mlp_only_layers)")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise HFImportError("config.json lacks required key 'num_experts' (or 'num_local_experts')")
    return {"num_experts": int(experts), "num_experts_per_tok": _required(hf, "num_experts_per_tok"),
            "moe_intermediate_size": _required(hf, "moe_intermediate_size"),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


def hf_config_from_model(cfg: Any, *, head: str = "lm", num_labels: int = 1,
                         extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` dict transformers needs to load an export of ``cfg`` (a ModelConfig; ``extra``
    keys win, e.g. ``{"pad_token_id": 0}``, which sequence classification needs for batches)."""
    if head not in HEAD_SUFFIX:
        raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
    out: dict[str, Any] = {
        "architectures": [FAMILY_PREFIX[cfg.family] + HEAD_SUFFIX[head]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": cfg.param_dtype,
        **_rope_to_hf(cfg),
        **_family_keys(cfg),
    }
    if head == "value":
        out["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        out["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    out.update(extra or {})
    return out


def _reject_unsupported(hf: Mapping[str, Any]) -> None:
    checks = [
        ("hidden_act", hf.get("hidden_act", "silu") not in ("silu", "swish"), "only 'silu' (SwiGLU MLP)"),
        ("mlp_bias", bool(hf.get("mlp_bias", False)), "only false (no MLP biases)"),
        ("use_sliding_window", bool(hf.get("use_sliding_window", False)), "only false (full attention)"),
        ("layer_types", any(t != "full_attention" for t in hf.get("layer_types") or ()),
         "only 'full_attention' layers"),
        ("partial_rotary_factor", _partial_rotary(hf) != 1.0, "only 1.0 (RoPE over the whole head)"),
        ("quantization_config", "quantization_config" in hf, "only unquantized checkpoints"),
    ]
    for key, bad, supported in checks:
        if bad:
            raise HFImportError(f"config.json {key}={hf.get(key)!r} is not supported; supported: {supported}")


def _required(hf: Mapping[str, Any], key: str) -> int:
    if hf.get(key) is None:
        raise HFImportError(f"config.json lacks required key {key!r}")
    try:
        return int(hf[key])
    except (TypeError, ValueError):
        raise HFImportError(f"config.json {key}={hf[key]!r} is not an integer") from None


def _rope_dict(hf: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The RoPE parameters and the key they came from: ``rope_parameters`` (transformers 5) wins over
    the legacy ``rope_scaling`` (4.x, with ``rope_theta`` at the top level)."""
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if params:
            if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
                raise HFImportError(f"config.json {key} nested per layer type is not supported; supported: one "
                                    "flat dict for all layers")
            return key, dict(params)
    return "rope_parameters", {}


def _rope_theta(hf: Mapping[str, Any]) -> float:
    _, params = _rope_dict(hf)
    return params.get("rope_theta", hf.get("rope_theta", 10000.0))


def _partial_rotary(hf: Mapping[str, Any]) -> float:
    _, params = _rope_dict(hf)
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0))


def _rope_scaling(hf: Mapping[str, Any]) -> dict[str, Any] | None:
    key, params = _rope_dict(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise HFImportError(f"config.json {key}.rope_type={rope_type!r} is not supported; supported: "
                            "'default' (or absent) and 'llama3'")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise HFImportError(f"config.json {key} (rope_type 'llama3') lacks {missing}")
    original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return {"rope_type": "llama3", "factor": float(params["factor"]),
            "low_freq_factor": float(params["low_freq_factor"]), "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_position_embeddings": int(original)}


def _rope_to_hf(cfg: Any) -> dict[str, Any]:
    """Both spellings: ``rope_parameters`` for transformers 5, ``rope_theta``/``rope_scaling`` for 4.x."""
    if cfg.rope_scaling is None:
        return {"rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    s = cfg.rope_scaling
    scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
               "high_freq_factor": s.high_freq_factor,
               "original_max_position_embeddings": s.original_max_position_embeddings}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta}}


def _family_keys(cfg: Any) -> dict[str, Any]:
    if cfg.family == "llama":
        # HF Llama's attention_bias also gives o_proj a bias; an export writes it as zeros.
        return {"attention_bias": cfg.qkv_bias, "mlp_bias": False}
    keys = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
            "layer_types": ["full_attention"] * cfg.num_layers}
    if cfg.family == "qwen3_moe":
        keys.update(attention_bias=cfg.qkv_bias, num_experts=cfg.num_experts,
                    num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
                    norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                    router_aux_loss_coef=0.001, output_router_logits=False)
    if cfg.family == "qwen3":
        keys["attention_bias"] = cfg.qkv_bias
    return keys
