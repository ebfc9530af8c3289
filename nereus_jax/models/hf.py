"""Hugging Face import and export: Llama / Qwen2 checkpoints (config.json + safetensors) <-> our tree.

Reads and writes local directories only (no hub access) through ``safetensors.numpy``; torch and
transformers are never imported. Supported: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (language-model
head) and ``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification`` (their ``score`` layer
becomes our value head), RoPE ``default`` or ``llama3``. Anything else raises :class:`HFImportError`
naming the config key or tensor and what is supported.

Usage::

    from nereus_jax.models.hf import load_hf, save_hf
    cfg, params = load_hf("/models/Qwen2.5-0.5B")                  # numpy tree in cfg.param_dtype
    cfg, params = load_hf(path, dtype="bfloat16")                  # cast on the way in
    cfg, params = load_hf(path, layout=Layout(tp=2), mesh=mesh)    # laid out with sharding.shard_params
    logits_btv = forward(params, cfg, tokens_bt)                   # a *ForSequenceClassification gives values
    save_hf("/tmp/export", cfg, params)                            # from_pretrained("/tmp/export") loads it
    save_hf(out, cfg, critic_params, extra_config={"pad_token_id": 0}, max_shard_bytes=2**30)

Parity with transformers: ``.venv311/bin/python -m pytest tests/models/test_hf_parity.py -q``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from nereus_jax.config import ConfigError, ModelConfig, RopeScalingConfig

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_ARCHS = {
    "LlamaForCausalLM": ("llama", "lm"),
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "LlamaForSequenceClassification": ("llama", "value"),
    "Qwen2ForSequenceClassification": ("qwen2", "value"),
}
_FAMILY_PREFIX = {"llama": "Llama", "qwen2": "Qwen2"}
_HEAD_SUFFIX = {"lm": "ForCausalLM", "value": "ForSequenceClassification"}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768}  # transformers' defaults when config.json omits it


class HFImportError(ValueError):
    """A Hugging Face checkpoint or config nereus_jax cannot read (the message names the key or tensor)."""


# ------------------------------------------------------------------------------------------------ config
def model_config_from_hf(hf_config: Mapping[str, Any], name: str = "hf") -> ModelConfig:
    """A ModelConfig from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x format)."""
    hf = dict(hf_config)
    family, _ = _family_and_head(hf)
    _reject_unsupported(hf)
    num_heads = _required(hf, "num_attention_heads")
    try:
        return ModelConfig(
            name=name,
            family=family,
            vocab_size=_required(hf, "vocab_size"),
            hidden_size=_required(hf, "hidden_size"),
            num_layers=_required(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or None,
            intermediate_size=_required(hf, "intermediate_size"),
            rope_theta=float(_rope_theta(hf)),
            rope_scaling=_rope_scaling(hf),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[family])),
        )
    except ConfigError as e:
        raise HFImportError(f"config.json describes a model nereus_jax cannot build: {e}") from e


def hf_config_from_model(cfg: ModelConfig, *, head: str = "lm", num_labels: int = 1,
                         extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` dict transformers needs to load an export of ``cfg`` (``extra`` keys win,
    e.g. ``{"pad_token_id": 0}``, which sequence classification needs for batches)."""
    if head not in _HEAD_SUFFIX:
        raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
    out: dict[str, Any] = {
        "architectures": [_FAMILY_PREFIX[cfg.family] + _HEAD_SUFFIX[head]],
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


def _family_and_head(hf: Mapping[str, Any]) -> tuple[str, str]:
    model_type = hf.get("model_type")
    if model_type not in _FAMILY_PREFIX:
        raise HFImportError(f"config.json model_type={model_type!r} is not supported; supported: llama, qwen2")
    archs = hf.get("architectures") or [_FAMILY_PREFIX[model_type] + _HEAD_SUFFIX["lm"]]
    if len(archs) != 1 or archs[0] not in _ARCHS:
        raise HFImportError(f"config.json architectures={archs!r} is not supported; supported: one of {sorted(_ARCHS)}")
    family, head = _ARCHS[archs[0]]
    if family != model_type:
        raise HFImportError(f"config.json architectures={archs!r} does not match model_type={model_type!r}")
    return family, head


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
    return int(hf[key])


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


def _rope_scaling(hf: Mapping[str, Any]) -> RopeScalingConfig | None:
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
    return RopeScalingConfig(rope_type="llama3", factor=float(params["factor"]),
                             low_freq_factor=float(params["low_freq_factor"]),
                             high_freq_factor=float(params["high_freq_factor"]),
                             original_max_position_embeddings=int(original))


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Both spellings: ``rope_parameters`` for transformers 5, ``rope_theta``/``rope_scaling`` for 4.x."""
    if cfg.rope_scaling is None:
        return {"rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    s = cfg.rope_scaling
    scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
               "high_freq_factor": s.high_freq_factor,
               "original_max_position_embeddings": s.original_max_position_embeddings}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta}}


def _family_keys(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.family == "llama":
        # HF Llama's attention_bias also gives o_proj a bias; an export writes it as zeros.
        return {"attention_bias": cfg.qkv_bias, "mlp_bias": False}
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
            "layer_types": ["full_attention"] * cfg.num_layers}


# ------------------------------------------------------------------------------------------ tensor table
@dataclass(frozen=True)
class _Rule:
    """One parameter: our path, the HF name (``{i}`` = layer), the HF shape, and the two conversions."""

    ours: tuple[str, ...]
    hf: str
    hf_shape: Callable[[ModelConfig, int], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def _same(x, cfg):
    return x


def _t(x, cfg):
    return x.T


def _proj_rule(name: str, heads: Callable[[ModelConfig], int]) -> _Rule:
    """q/k/v_proj.weight [heads*E, D] <-> w [D, heads, E]."""
    return _Rule(("layers", "attn", f"w{name}"), f"model.layers.{{i}}.self_attn.{name}_proj.weight",
                 lambda c, n: (heads(c) * c.head_dim, c.hidden_size),
                 lambda x, c: x.T.reshape(c.hidden_size, heads(c), c.head_dim),
                 lambda x, c: x.reshape(c.hidden_size, -1).T)


def _bias_rule(name: str, heads: Callable[[ModelConfig], int]) -> _Rule:
    """q/k/v_proj.bias [heads*E] <-> b [heads, E]."""
    return _Rule(("layers", "attn", f"b{name}"), f"model.layers.{{i}}.self_attn.{name}_proj.bias",
                 lambda c, n: (heads(c) * c.head_dim,),
                 lambda x, c: x.reshape(heads(c), c.head_dim), lambda x, c: x.reshape(-1))


def _vector_rule(ours: tuple[str, ...], hf: str) -> _Rule:
    return _Rule(ours, hf, lambda c, n: (c.hidden_size,), _same, _same)


def _rules(cfg: ModelConfig, head: str) -> list[_Rule]:
    """Every parameter of a model with ``cfg`` and ``head``, in HF's order."""
    q_heads, kv_heads = (lambda c: c.num_heads), (lambda c: c.num_kv_heads)
    d, f = (lambda c: c.hidden_size), (lambda c: c.intermediate_size)
    rules = [
        _Rule(("embed", "embedding"), "model.embed_tokens.weight", lambda c, n: (c.vocab_size, c.hidden_size),
              _same, _same),
        _vector_rule(("layers", "attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight"),
        _proj_rule("q", q_heads), _proj_rule("k", kv_heads), _proj_rule("v", kv_heads),
        _Rule(("layers", "attn", "wo"), "model.layers.{i}.self_attn.o_proj.weight",
              lambda c, n: (c.hidden_size, c.num_heads * c.head_dim),
              lambda x, c: x.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
              lambda x, c: x.reshape(-1, c.hidden_size).T),
        _vector_rule(("layers", "mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight"),
        _Rule(("layers", "mlp", "w_gate"), "model.layers.{i}.mlp.gate_proj.weight", lambda c, n: (f(c), d(c)), _t, _t),
        _Rule(("layers", "mlp", "w_up"), "model.layers.{i}.mlp.up_proj.weight", lambda c, n: (f(c), d(c)), _t, _t),
        _Rule(("layers", "mlp", "w_down"), "model.layers.{i}.mlp.down_proj.weight", lambda c, n: (d(c), f(c)), _t, _t),
        _vector_rule(("final_norm", "scale"), "model.norm.weight"),
    ]
    if cfg.qkv_bias:
        rules += [_bias_rule("q", q_heads), _bias_rule("k", kv_heads), _bias_rule("v", kv_heads)]
    if head == "value":
        rules.append(_Rule(("value_head", "kernel"), "score.weight", lambda c, n: (n, c.hidden_size), _t, _t))
    elif not cfg.tie_embeddings:
        rules.append(_Rule(("lm_head", "kernel"), "lm_head.weight", lambda c, n: (c.vocab_size, c.hidden_size),
                           _t, _t))
    return rules


def _o_bias_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.o_proj.bias"


# ------------------------------------------------------------------------------------------------ import
def load_hf(path: str | Path, *, layout=None, mesh=None, kind: str = "train",
            dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """Reads ``path/config.json`` and its safetensors into ``(cfg, params)``: a numpy tree in
    ``dtype`` (default ``cfg.param_dtype``), or, given ``layout`` and ``mesh``, laid out with
    :func:`nereus_jax.sharding.shard_params` for stage ``kind``."""
    path = Path(path)
    hf = read_hf_config(path)
    cfg = model_config_from_hf(hf, name=path.name or "hf")
    _, head = _family_and_head(hf)
    tensors = _read_tensors(path)
    params = _convert_in(tensors, cfg, head, _num_labels(tensors, hf, head))
    params = _cast(params, _np_dtype(dtype or cfg.param_dtype))
    if layout is None and mesh is None:
        return cfg, params
    if layout is None or mesh is None:
        raise ValueError("load_hf: pass both layout and mesh (or neither)")
    from nereus_jax.sharding import shard_params  # sharding imports models: keep the import local

    return cfg, shard_params(params, cfg, layout, mesh, kind=kind)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise HFImportError(f"{path} is not a directory; pass the checkpoint directory (config.json + *.safetensors)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HFImportError(f"{path} has no config.json")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise HFImportError(f"{config_file} is not valid JSON: {e}") from e


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    files = _tensor_files(path)
    out: dict[str, np.ndarray] = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if key in out:
                    raise HFImportError(f"tensor {key!r} appears in more than one file under {path}")
                out[key] = f.get_tensor(key)
    return out


def _tensor_files(path: Path) -> list[Path]:
    index = path / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise HFImportError(f"{index} lists files that are missing: {missing}")
        return files
    if (path / _SINGLE).is_file():
        return [path / _SINGLE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFImportError(f"{path} has no *.safetensors files (nor {_INDEX}); only safetensors checkpoints load")
    return files


def _num_labels(tensors: Mapping[str, np.ndarray], hf: Mapping[str, Any], head: str) -> int:
    if head != "value":
        return 1
    if "score.weight" not in tensors:
        raise HFImportError("tensor 'score.weight' is missing (sequence-classification checkpoint)")
    n = int(tensors["score.weight"].shape[0])
    expected = len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels", n)
    if n != expected:
        raise HFImportError(f"tensor 'score.weight' has {n} rows but config.json declares {expected} labels")
    return n


def _convert_in(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, head: str, num_labels: int) -> dict:
    params: dict = {}
    for rule in _rules(cfg, head):
        if rule.per_layer:
            value = np.stack([_take(tensors, rule, cfg, num_labels, i) for i in range(cfg.num_layers)])
        else:
            value = _take(tensors, rule, cfg, num_labels, None)
        _set(params, rule.ours, value)
    if cfg.family == "llama" and cfg.qkv_bias:
        _check_zero_o_bias(tensors, cfg)
    return params


def _take(tensors: Mapping[str, np.ndarray], rule: _Rule, cfg: ModelConfig, num_labels: int,
          layer: int | None) -> np.ndarray:
    name = rule.hf.format(i=layer)
    if name not in tensors:
        raise HFImportError(f"tensor {name!r} is missing from the checkpoint")
    x = tensors[name]
    expected = rule.hf_shape(cfg, num_labels)
    if tuple(x.shape) != expected:
        raise HFImportError(f"tensor {name!r} has shape {tuple(x.shape)}, expected {expected} from config.json")
    return np.ascontiguousarray(rule.to_ours(x, cfg))


def _check_zero_o_bias(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> None:
    """Llama's attention_bias also biases o_proj, which our decoder lacks: accept it only when zero."""
    for i in range(cfg.num_layers):
        bias = tensors.get(_o_bias_name(i))
        if bias is not None and np.any(bias != 0):
            raise HFImportError(f"tensor {_o_bias_name(i)!r} is non-zero; supported: attention_bias with a zero "
                                "o_proj bias (nereus_jax has no output-projection bias)")


# ------------------------------------------------------------------------------------------------ export
def save_hf(path: str | Path, cfg: ModelConfig, params: Mapping, *, head: str | None = None,
            max_shard_bytes: int | None = None, extra_config: Mapping[str, Any] | None = None) -> Path:
    """Writes ``config.json`` and safetensors (one file, or shards of at most ``max_shard_bytes`` plus an
    index) that transformers' ``from_pretrained`` loads. ``params`` may be numpy or laid-out jax arrays
    (gathered first); tensors keep their dtype. A tied model writes no ``lm_head.weight``."""
    from nereus_jax.sharding import gather_params  # sharding imports models: keep the import local

    host = gather_params(params, cfg)
    head = head or ("value" if "value_head" in host else "lm")
    if (head == "value") != ("value_head" in host) or head not in _HEAD_SUFFIX:
        raise ValueError(f"save_hf: head={head!r} does not fit a tree with top-level keys {sorted(host)}")
    num_labels = int(host["value_head"]["kernel"].shape[1]) if head == "value" else 1
    tensors = _convert_out(host, cfg, head, num_labels)
    hf = hf_config_from_model(cfg, head=head, num_labels=num_labels, extra=extra_config)
    hf["dtype"] = np.dtype(host["embed"]["embedding"].dtype).name
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_stale_weights(path)
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    _write_tensors(path, tensors, max_shard_bytes)
    return path


def _convert_out(host: Mapping, cfg: ModelConfig, head: str, num_labels: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for rule in _rules(cfg, head):
        value = _get(host, rule.ours, rule.hf)
        layers = range(cfg.num_layers) if rule.per_layer else [None]
        for i in layers:
            x = np.ascontiguousarray(rule.to_hf(value if i is None else value[i], cfg))
            assert x.shape == rule.hf_shape(cfg, num_labels), (rule.hf, x.shape)
            out[rule.hf.format(i=i)] = x
    if cfg.family == "llama" and cfg.qkv_bias:
        zeros = np.zeros((cfg.hidden_size,), host["embed"]["embedding"].dtype)
        out.update({_o_bias_name(i): zeros for i in range(cfg.num_layers)})
    return out


def _write_tensors(path: Path, tensors: Mapping[str, np.ndarray], max_shard_bytes: int | None) -> None:
    shards = _split_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(dict(tensors), path / _SINGLE, metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(int(x.nbytes) for x in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / _INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _split_shards(tensors: Mapping[str, np.ndarray], max_bytes: int | None) -> list[dict[str, np.ndarray]]:
    """Greedy, in order; a tensor larger than ``max_bytes`` gets a shard of its own."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, x in tensors.items():
        if max_bytes is not None and shards[-1] and size + x.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = x
        size += x.nbytes
    return shards


def _remove_stale_weights(path: Path) -> None:
    """Drops a previous export's weight files, so no stale shard or index outlives this one."""
    for f in path.iterdir():
        if f.name in (_SINGLE, _INDEX) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f.name):
            f.unlink()


# ------------------------------------------------------------------------------------------------ helpers
def _set(tree: dict, keys: tuple[str, ...], value) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def _get(tree: Mapping, keys: tuple[str, ...], hf_name: str):
    try:
        for key in keys:
            tree = tree[key]
    except KeyError:
        raise ValueError(f"parameter {'/'.join(keys)} (for {hf_name}) is missing from the tree") from None
    return np.asarray(tree)


def _cast(params: dict, dtype: np.dtype) -> dict:
    return {k: _cast(v, dtype) if isinstance(v, dict) else np.asarray(v, dtype=dtype) for k, v in params.items()}


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(jnp.dtype(name))  # jnp.dtype knows bfloat16 (ml_dtypes), which numpy arrays then carry
