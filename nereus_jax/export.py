"""Export a saved checkpoint's actor as a Hugging Face checkpoint:
``python -m nereus_jax.export CHECKPOINT_DIR OUT_DIR``.

CHECKPOINT_DIR is a run's checkpoint folder (its latest complete step is used) or one step's folder.
OUT_DIR gets ``config.json``, safetensors (sharded at 5 GB, with the index), the tokenizer files and
``generation_config.json`` of the model the run started from; it is written under a temporary name and
renamed when complete. Runs on CPU; no devices of the training run are needed.

    python -m nereus_jax.export runs/demo/checkpoints runs/demo/export
    python -m nereus_jax.export runs/demo/checkpoints/40 /models/tuned-step40
"""

from __future__ import annotations

import argparse
import json
import os
import sys


class ExportError(ValueError):
    """A CHECKPOINT_DIR or OUT_DIR the export cannot use; the message names it and what to change."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nereus_jax.export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a run's checkpoint folder (latest step) or one step's folder")
    parser.add_argument("out", help="the Hugging Face checkpoint folder to write")
    parser.add_argument("--adapter", action="store_true",
                        help="write the LoRA adapters alone as a PEFT adapter folder (a run with model.lora_rank > 0)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        step_dir = check_paths(args.checkpoint, args.out)
        print(export(step_dir, args.out, adapter=args.adapter))
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def check_paths(checkpoint: str, out: str) -> str:
    """The step folder ``checkpoint`` names (its latest complete step, for a run's checkpoint folder), with
    readable metadata; an ExportError, before anything is read or written, when it has none or ``out``
    cannot be written."""
    step_dir = _step_dir(checkpoint)
    _read_meta(step_dir)
    _check_out(out, step_dir)
    return step_dir


def _step_dir(path: str) -> str:
    if not os.path.exists(path):
        raise ExportError(f"checkpoint folder {path!r} does not exist: give a run's checkpoint folder "
                          "(RUN_DIR/checkpoints, or checkpoint.dir) or one of its step folders")
    if not os.path.isdir(path):
        raise ExportError(f"checkpoint {path!r} is not a folder: give a run's checkpoint folder (RUN_DIR/checkpoints, "
                          "or checkpoint.dir) or one of its step folders")
    if os.path.basename(os.path.abspath(path)).isdigit() and os.path.isdir(os.path.join(path, "meta")):
        return path
    steps = sorted(int(n) for n in os.listdir(path) if n.isdigit() and os.path.isdir(os.path.join(path, n)))
    if not steps:
        partial = sorted(n for n in os.listdir(path) if "tmp" in n)
        why = f" (only unfinished saves: {partial})" if partial else ""
        raise ExportError(f"no complete checkpoint in {path!r}{why}: give a run's checkpoint folder holding a saved "
                          "step (checkpoint.every_steps > 0 writes them), or one step's folder")
    return os.path.join(path, str(steps[-1]))


def _read_meta(step_dir: str) -> dict:
    from nereus_jax.runtime.durability.orbax_errors import one_line

    file = os.path.join(step_dir, "meta", "metadata")
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ExportError(f"checkpoint {step_dir!r} is incomplete or damaged (its metadata: {one_line(e)}): "
                          "export an older step folder") from None
    if not isinstance(meta, dict):
        raise ExportError(f"checkpoint {step_dir!r} is damaged (its metadata is not a JSON object): export an older "
                          "step folder")
    return meta


def _check_out(out: str, step_dir: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"{out!r} exists and is not a folder: choose another OUT_DIR")
    here = os.path.abspath(out)
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise ExportError(f"OUT_DIR {out!r} cannot be made: {here!r} is a file; choose another OUT_DIR")
    root = os.path.realpath(os.path.dirname(os.path.abspath(step_dir)))
    if os.path.commonpath([root, os.path.realpath(out)]) == os.path.realpath(out):
        raise ExportError(f"OUT_DIR {out!r} holds the checkpoint being exported, and an export replaces OUT_DIR "
                          "whole: choose another OUT_DIR")


def export(step_dir: str, out: str, *, adapter: bool = False) -> str:
    """Writes the actor of the checkpoint at ``step_dir`` to ``out`` (merged, as a Hugging Face checkpoint; or
    with ``adapter`` its LoRA adapters as a PEFT folder); returns what to print."""
    from nereus_jax.runtime.durability.export import write_hf

    model, params, meta = _restore(step_dir)
    if adapter:
        from nereus_jax.models.peft import write_adapter

        if not model.lora_rank:
            raise ExportError(f"checkpoint {step_dir!r} was trained without LoRA (model.lora_rank=0): it has no "
                              "adapters; export it without --adapter")
        try:
            written = write_adapter(out, model, params, base_model=model.hf_path)
        except OSError as e:
            raise ExportError(f"cannot write OUT_DIR {out!r} ({e.strerror or e}): free space or choose another "
                              "OUT_DIR") from None
        return f"exported the LoRA adapters of step {meta['step']} of {meta['_root']} to {written}"
    info = meta.get("export") or {}
    tokenizer = info.get("tokenizer_dir")
    if tokenizer and not os.path.isdir(tokenizer):
        print(f"warning: the run's tokenizer folder {tokenizer!r} is gone; the export has no tokenizer files",
              file=sys.stderr)
        tokenizer = None
    try:
        written = write_hf(out, model, params, dtype=info.get("dtype", model.param_dtype), tokenizer_from=tokenizer,
                           eos_ids=info.get("eos_ids", ()), bos_id=info.get("bos_id"), pad_id=info.get("pad_id"))
    except OSError as e:
        raise ExportError(f"cannot write OUT_DIR {out!r} ({e.strerror or e}): nothing was written there; free "
                          "space or choose another OUT_DIR") from None
    return f"exported step {meta['step']} of {meta['_root']} to {written}"


def _restore(step_dir: str):
    """restore_actor, with a damaged checkpoint as one ExportError line (the file tensorstore could not read)."""
    from nereus_jax.config import ConfigError
    from nereus_jax.runtime.durability.checkpoint import CheckpointError, restore_actor
    from nereus_jax.runtime.durability.orbax_errors import one_line

    try:
        return restore_actor(step_dir)
    except CheckpointError as e:
        message = " ".join(str(e).split()).replace(os.path.abspath(step_dir), step_dir)  # its cause is one line
    except (KeyError, TypeError, ConfigError) as e:  # metadata that parses but lacks or garbles an entry
        message = (f"checkpoint {step_dir!r} is damaged (its metadata: {type(e).__name__}: {one_line(e)}): "
                   "export an older step folder")
    raise ExportError(message)


if __name__ == "__main__":
    sys.exit(main())
