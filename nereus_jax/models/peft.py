"""PEFT LoRA adapters in and out: ``adapter_config.json`` + ``adapter_model.safetensors`` <-> our adapter leaves.

PEFT stores, per layer and module, ``lora_A.weight`` [r, in_features] and ``lora_B.weight`` [out_features, r]
under ``base_model.model.model.layers.{i}.<self_attn|mlp>.<module>``; ours are stacked over layers with the
weight's own axes (``nereus_jax.models.lora``). Heads flatten as Hugging Face's projections do (head-major), so
an adapter written here loads with ``PeftModel.from_pretrained(base, path)`` on the starting checkpoint and
gives the same logits.

    write_adapter("runs/x/adapter", cfg, params, base_model="Qwen/Qwen3-0.6B")
    adapters = read_adapter("runs/x/adapter", cfg)      # {leaf name: stacked array}
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.models import lora

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers.{i}."


class AdapterError(ValueError):
    """A PEFT adapter folder that does not fit the model (names the file and the fix)."""


def _key(t: lora.Target, i: int, which: str) -> str:
    return _PREFIX.format(i=i) + f"{t.hf_module}.lora_{which}.weight"


def adapter_tensors(cfg: ModelConfig, params: Mapping) -> dict[str, np.ndarray]:
    """PEFT's tensors of the adapters in ``params`` (a canonical host tree)."""
    out = {}
    for t in lora.targets(cfg):
        group = params["layers"][t.group]
        a, b = np.asarray(group[t.a]), np.asarray(group[t.b])
        for i in range(cfg.num_layers):
            out[_key(t, i, "A")] = np.ascontiguousarray(a[i].reshape(-1, cfg.lora_rank).T)
            out[_key(t, i, "B")] = np.ascontiguousarray(b[i].reshape(cfg.lora_rank, -1).T)
    return out


def adapter_config(cfg: ModelConfig, base_model: str | None = None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``cfg``'s adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
            "target_modules": list(cfg.lora_targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def write_adapter(out_dir: str | os.PathLike[str], cfg: ModelConfig, params: Mapping, *,
                  base_model: str | None = None, dtype: str = "float32") -> Path:
    """Writes ``params``' adapters as a PEFT folder ``out_dir`` (written under a temporary name, then renamed:
    a reader never sees half of one). ``dtype``: the tensors' dtype on disk."""
    from safetensors.numpy import save_file

    if not cfg.lora_rank:
        raise AdapterError("the model has no adapters (model.lora_rank=0): nothing to write")
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        tensors = {k: _cast(v, dtype) for k, v in adapter_tensors(cfg, params).items()}
        save_file(tensors, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
        (partial / CONFIG_FILE).write_text(json.dumps(adapter_config(cfg, base_model), indent=2) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            partial.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


def read_adapter(path: str | os.PathLike[str], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A PEFT LoRA folder's adapters as our stacked leaves ({``wq_lora_a``: [layers, embed, r], ...}, float32),
    checked against ``cfg`` (rank, targets, shapes); its ``lora_alpha`` must equal ``cfg.lora_alpha``."""
    from safetensors.numpy import load_file

    folder = Path(path)
    try:
        meta = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"model.lora_path={str(path)!r} has no {CONFIG_FILE}: give a PEFT LoRA adapter "
                           "folder (adapter_config.json, adapter_model.safetensors)") from None
    except json.JSONDecodeError as e:
        raise AdapterError(f"{folder / CONFIG_FILE} is not valid JSON ({e})") from None
    if meta.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder / CONFIG_FILE}: peft_type {meta.get('peft_type')!r}; only LORA adapters load")
    for key, ours in (("r", cfg.lora_rank), ("lora_alpha", cfg.lora_alpha)):
        if float(meta.get(key, -1)) != float(ours):
            raise AdapterError(f"{folder / CONFIG_FILE} has {key}={meta.get(key)!r} but model.{_NAMES[key]}={ours}; "
                               f"set model.{_NAMES[key]}={meta.get(key)}")
    for flag in ("use_dora", "use_rslora"):
        if meta.get(flag):
            raise AdapterError(f"{folder / CONFIG_FILE}: {flag}=true is not supported (plain LoRA only)")
    if meta.get("rank_pattern") or meta.get("alpha_pattern") or meta.get("layers_to_transform"):
        raise AdapterError(f"{folder / CONFIG_FILE}: per-layer rank/alpha patterns and layers_to_transform are not "
                           "supported (one rank for every adapted projection)")
    weights = folder / WEIGHTS_FILE
    if not weights.exists():
        raise AdapterError(f"model.lora_path={str(path)!r} has no {WEIGHTS_FILE}")
    tensors = load_file(str(weights))
    theirs = set(meta.get("target_modules") or [])
    if theirs != set(cfg.lora_targets):
        raise AdapterError(f"{folder / CONFIG_FILE} adapts {sorted(theirs)} but model.lora_targets is "
                           f"{sorted(cfg.lora_targets)}; set model.lora_targets={sorted(theirs)}")
    out = {}
    for t in lora.targets(cfg):
        shape_a, shape_b = lora.adapter_shapes(cfg, lora._weight_shape(cfg, t), t)
        a, b = np.empty(shape_a, np.float32), np.empty(shape_b, np.float32)
        for i in range(cfg.num_layers):
            for which, dst in (("A", a), ("B", b)):
                key = _key(t, i, which)
                if key not in tensors:
                    raise AdapterError(f"{weights} has no tensor {key!r}: the adapter does not fit this model")
                x = np.asarray(tensors[key], np.float32)
                want = ((cfg.lora_rank, int(np.prod(shape_a[1:-1]))) if which == "A"
                        else (int(np.prod(shape_b[2:])), cfg.lora_rank))
                if x.shape != want:
                    raise AdapterError(f"{weights}: {key} has shape {list(x.shape)}, this model needs {list(want)}")
                dst[i] = x.T.reshape(dst.shape[1:])
        out[t.a], out[t.b] = a, b
    return out


_NAMES = {"r": "lora_rank", "lora_alpha": "lora_alpha"}


def adapter_source(cfg: ModelConfig, base: Any, seed: int = 0) -> lora.AdapterSource:
    """``base`` (a parameter source) with ``cfg``'s adapters: read from ``model.lora_path`` when set, else the
    ones a host tree ``base`` already holds, else fresh (A random, B zero: the model starts as the base)."""
    adapters = read_adapter(cfg.lora_path, cfg) if cfg.lora_path else {}
    tree = getattr(base, "tree", None)
    if not adapters and isinstance(tree, Mapping) and lora.has_adapters(tree.get("layers", {})):
        adapters = {k: v for g in tree["layers"].values() if isinstance(g, Mapping)
                    for k, v in g.items() if lora.is_adapter((k,))}
    return lora.AdapterSource(base, cfg, seed, adapters)
