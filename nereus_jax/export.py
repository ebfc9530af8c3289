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
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nereus_jax.export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a run's checkpoint folder (latest step) or one step's folder")
    parser.add_argument("out", help="the Hugging Face checkpoint folder to write")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from nereus_jax.runtime.checkpoint import CheckpointError, restore_actor
    from nereus_jax.runtime.export import write_hf

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        print(f"error: {args.out!r} exists and is not a folder: choose another OUT_DIR", file=sys.stderr)
        return 2
    try:
        model, params, meta = restore_actor(args.checkpoint)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info = meta.get("export") or {}
    tokenizer = info.get("tokenizer_dir")
    if tokenizer and not os.path.isdir(tokenizer):
        print(f"warning: the run's tokenizer folder {tokenizer!r} is gone; the export has no tokenizer files",
              file=sys.stderr)
        tokenizer = None
    out = write_hf(args.out, model, params, dtype=info.get("dtype", model.param_dtype), tokenizer_from=tokenizer,
                   eos_ids=info.get("eos_ids", ()), bos_id=info.get("bos_id"), pad_id=info.get("pad_id"))
    print(f"exported step {meta['step']} of {meta['_root']} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
