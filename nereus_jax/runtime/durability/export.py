"""The tuned actor out of the run, as a Hugging Face checkpoint anything else can load and serve.

A run writes ``RUN_DIR/hf`` at its end (and ``<checkpoint>/<step>/hf`` with every checkpoint when
``checkpoint.export_hf=true``): ``config.json``, safetensors sharded at 5 GB with their index, the
tokenizer files and ``generation_config.json`` of the checkpoint the run started from (or, for the built-in
tokenizer, a generation config naming its eos). The folder is written under a temporary name and renamed
only when complete, so a reader never sees half an export. ``python -m nereus_jax.export CHECKPOINT_DIR
OUT_DIR`` does the same for any saved checkpoint.

    path = export_actor(job, "runs/x/hf")        # every process calls it; process 0 writes
    AutoModelForCausalLM.from_pretrained(path)   # in transformers
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nereus_jax.config import Config, ModelConfig
from nereus_jax.runtime.platform.distributed import is_primary

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def tokenizer_dir(cfg: Config) -> str | None:
    """The folder holding the run's tokenizer files: task.tokenizer_path's, else model.hf_path, else None."""
    if cfg.task.tokenizer_path:
        path = cfg.task.tokenizer_path
        return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return cfg.model.hf_path


def export_dtype(cfg: Config) -> str:
    """The dtype an export is written in: the starting checkpoint's weight dtype, else model.param_dtype."""
    if cfg.model.hf_path:
        from nereus_jax.models.hf import HFCheckpoint

        return HFCheckpoint(cfg.model.hf_path).dtype
    return cfg.model.param_dtype


def export_actor(job, out_dir: str | os.PathLike[str], adapter_dir: str | os.PathLike[str] | None = None
                 ) -> Path | None:
    """Writes the job's actor (actor-train's parameters) to ``out_dir`` as a Hugging Face checkpoint (with LoRA:
    the adapters merged in), and with LoRA and ``adapter_dir`` the adapters alone as a PEFT folder there. With
    several processes every process must call it (reading the parameters is a collective); process 0 writes.
    Returns the folder on the writing process, else None."""
    params = job.actor_host_params()
    if not is_primary():
        return None
    cfg = job.cfg
    if adapter_dir is not None and cfg.model.lora_rank:
        from nereus_jax.models.peft import write_adapter

        write_adapter(adapter_dir, cfg.model, params, base_model=cfg.model.hf_path)
    return write_hf(out_dir, cfg.model, params, dtype=export_dtype(cfg), tokenizer_from=tokenizer_dir(cfg),
                    eos_ids=job.tok.eos_ids, bos_id=job.tok.bos_id, pad_id=job.tok.pad_id)


def write_hf(out_dir: str | os.PathLike[str], model: ModelConfig, params: Mapping[str, Any], *, dtype: str,
             tokenizer_from: str | None = None, eos_ids: Sequence[int] = (), bos_id: int | None = None,
             pad_id: int | None = None) -> Path:
    """``params`` (a canonical host tree) as a Hugging Face checkpoint folder ``out_dir``, written whole
    under a temporary name and then renamed (an existing folder is replaced only once the new one is
    complete). A tree with LoRA adapters is written merged (``W + lora_alpha / r * A @ B``), as the base
    architecture."""
    from nereus_jax.models.hf import save_hf
    from nereus_jax.models.lora import base_config, merge_lora

    params, model = merge_lora(params, model), base_config(model)

    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_hf(partial, model, params, dtype=dtype)
        copied = _copy_tokenizer(tokenizer_from, partial)
        if "generation_config.json" not in copied:
            generation = {"eos_token_id": list(eos_ids) if len(eos_ids) > 1 else (eos_ids[0] if eos_ids else None),
                          "bos_token_id": bos_id, "pad_token_id": pad_id}
            (partial / "generation_config.json").write_text(
                json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2) + "\n")
        _replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _copy_tokenizer(source: str | None, dest: Path) -> list[str]:
    if not source or not os.path.isdir(source):
        return []
    names = [n for n in (*TOKENIZER_FILES, "generation_config.json") if os.path.isfile(os.path.join(source, n))]
    for name in names:
        shutil.copy2(os.path.join(source, name), dest / name)
    return names


def _replace(new: Path, out: Path) -> None:
    if not out.exists():
        new.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)
