"""Greedy held-out accuracy of a Hugging Face folder under transformers: the reference the RL job's own
engine is compared to (the same prompts, chat template, stop tokens, token budget and math reward).

    .venv311/bin/python tools/eval_hf.py RUN_DIR/hf runs/tiny-math/eval.jsonl
    .venv311/bin/python tools/eval_hf.py RUN_DIR/hf runs/tiny-math/eval.jsonl --max-new-tokens 48 --limit 64

Needs torch and transformers (the Python 3.11 environment: ``pip install -e '.[hf]'``). Prompts are the
file's rows read as the job reads them (:func:`nereus_jax.rl.tasks.load_prompt_file`), rendered with
``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``; generation is greedy, stops at the
eos ids of ``generation_config.json`` or after ``--max-new-tokens`` (default: ``rollout.max_response_length``
of ``--config``), and each response is scored by the job's math reward (:mod:`nereus_jax.rl.rewards`), so
both sides score identically. Prompts are batched by token length, so no row is padded (padding can move
a near-tie argmax). Prints one JSON line: ``{"accuracy": ..., "n": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "hf_grpo_tiny.yaml"


def load(model_dir: str | Path):
    """(model, tokenizer, eos ids) from a Hugging Face folder, in float32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
    return model, tokenizer, eos_ids


def prompt_ids(tokenizer, prompt) -> list[int]:
    """A problem's prompt as transformers renders it: the chat template for a message list, else the text."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    text = tokenizer.apply_chat_template([dict(m) for m in prompt], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def greedy_responses(model, tokenizer, prompts: Sequence[Sequence[int]], eos_ids: Sequence[int],
                     max_new_tokens: int, batch_size: int = 64) -> list[str]:
    """Greedy continuations (decoded, special tokens dropped), batched among prompts of equal length."""
    import torch

    by_length: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_length[len(p)].append(i)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    out: list[str] = [""] * len(prompts)
    for rows in by_length.values():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            ids = torch.tensor([list(prompts[i]) for i in chunk])
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids), pad_token_id=pad)
            for i, row in zip(chunk, gen[:, ids.shape[1]:].tolist(), strict=True):
                out[i] = tokenizer.decode(_until_eos(row, eos_ids), skip_special_tokens=True)
    return out


def _until_eos(ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    for n, t in enumerate(ids):
        if t in eos_ids:
            return list(ids[:n])
    return list(ids)


def evaluate(model_dir: str | Path, eval_file: str | Path, max_new_tokens: int, *, limit: int | None = None,
             batch_size: int = 64, timeout: float = 10.0) -> dict:
    """Greedy accuracy of ``model_dir`` on ``eval_file`` (JSONL/Parquet rows with prompt and answer)."""
    from nereus_jax.rl.tasks import load_prompt_file

    start = time.perf_counter()
    problems = load_prompt_file(str(eval_file))[:limit]
    model, tokenizer, eos_ids = load(model_dir)
    prompts = [prompt_ids(tokenizer, p.prompt) for p in problems]
    texts = greedy_responses(model, tokenizer, prompts, eos_ids, max_new_tokens, batch_size)
    correct = _score(problems, texts, timeout)
    return {"accuracy": sum(correct) / len(correct), "n": len(correct), "correct": sum(correct),
            "max_new_tokens": max_new_tokens, "model": str(model_dir), "eval_file": str(eval_file),
            "seconds": round(time.perf_counter() - start, 1), "responses": texts}


def _score(problems, texts: Sequence[str], timeout: float) -> list[bool]:
    """The job's ``task.reward=math`` verdicts (math-verify in a worker process, ``timeout`` s a call)."""
    from nereus_jax.config import TaskConfig
    from nereus_jax.rl.rewards import make_rewarder

    with make_rewarder(TaskConfig(reward="math", reward_timeout=timeout), None, workers=1) as rewarder:
        return rewarder.score(problems, texts).correct.tolist()


def response_length(config: str | Path) -> int:
    from nereus_jax.config import load_config

    return load_config(str(config)).rollout.max_response_length


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", help="a Hugging Face folder, e.g. RUN_DIR/hf")
    p.add_argument("eval_file", help="JSONL (or Parquet) rows {prompt, answer}, e.g. runs/tiny-math/eval.jsonl")
    p.add_argument("--max-new-tokens", type=int, help="default: rollout.max_response_length of --config")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the run's config (for --max-new-tokens)")
    p.add_argument("--limit", type=int, help="only the first N prompts")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--show", type=int, default=0, help="also print the first N responses")
    args = p.parse_args(argv)
    tokens = args.max_new_tokens or response_length(args.config)
    result = evaluate(args.model_dir, args.eval_file, tokens, limit=args.limit, batch_size=args.batch_size)
    responses = result.pop("responses")
    print(json.dumps(result | ({"responses": responses[: args.show]} if args.show else {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
