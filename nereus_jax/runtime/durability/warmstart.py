"""Supervised warm start: RL does not start from a random model, so the job first trains the actor on
the task's reference answers for ``trainer.warmup_sft_steps`` steps, caches the result on disk (keyed by
everything that determines it) and reuses it next time.

Exact-match accuracy under teacher forcing equals greedy-decoding accuracy for exact-match tasks: greedy
decoding emits the answer iff the argmax at every answer position (and the eos after it) is the answer's
token. :func:`teacher_forced_accuracy` measures it with one forward pass.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nereus_jax.config import Config, ModelConfig
from nereus_jax.elastic.topology import accumulation_steps
from nereus_jax.rl.batch import left_pad, right_pad
from nereus_jax.rl.tasks import Problem
from nereus_jax.runtime.step.initial_plan import with_micro_batch_tokens
from nereus_jax.runtime.step.losses import (
    make_optimizer,
    make_train_step,
    put_micro,
    response_logits,
    sft_loss,
    split_micro,
)
from nereus_jax.sharding import gather_params

SFT_INDEX_OFFSET = 1 << 40  # warm-start problems come from a part of the stream RL never reaches
VALIDATION_OFFSET = 1 << 41  # the warm start's validation split (never the held-out evaluation set)
CHECK_EVERY = 100  # supervised steps between validation checks when a target accuracy is set


def encode_prompts(problems: Sequence[Problem], tokenizer, prompt_len: int,
                   task_cfg=None) -> tuple[np.ndarray, np.ndarray]:
    """Prompt tokens as the job encodes them (chat template and bos where they apply, ``task_cfg``'s system
    prompt), left-padded to ``prompt_len``; too long is an error naming the fix."""
    system, chat = (task_cfg.system_prompt, task_cfg.chat_template) if task_cfg is not None else (None, None)
    seqs = [tokenizer.encode_prompt(p.prompt, system_prompt=system, chat=chat) for p in problems]
    longest = max(len(s) for s in seqs)
    if longest > prompt_len:
        raise ValueError(f"a prompt has {longest} tokens (with bos) but rollout.max_prompt_length={prompt_len}: "
                         "raise rollout.max_prompt_length or shorten the prompts")
    return left_pad(seqs, prompt_len, tokenizer.pad_id)


def encode_sft(problems: Sequence[Problem], tokenizer, prompt_len: int, response_len: int, task_cfg=None,
               tool_fraction: float = 0.0) -> dict:
    """Prompt + reference answer + eos as a training batch (the layout of nereus_jax.rl.batch). With
    ``tool_fraction``, evenly spread rows whose prompt is an arithmetic expression (``12+34=``) instead
    demonstrate the multi-turn rollout's plain calculator call: ``[calculator: 12+34]``, the tool's
    ``[result: 46]`` (context, no loss), then the answer and eos."""
    prompt, prompt_mask = encode_prompts(problems, tokenizer, prompt_len, task_cfg)
    answers, tool_spans = [], []
    for j, p in enumerate(problems):
        answer = tokenizer.encode(p.answer) + [tokenizer.eos_id]
        demo = _calculator_demo(p) if int((j + 1) * tool_fraction) > int(j * tool_fraction) else None
        if demo is not None and len(demo[0]) + len(demo[1]) + len(answer) <= response_len:
            call, result = tokenizer.encode(demo[0]), tokenizer.encode(demo[1])
            tool_spans.append((j, len(call), len(call) + len(result)))
            answer = call + result + answer
        answers.append(answer[: response_len - 1] + [tokenizer.eos_id] if len(answer) > response_len else answer)
    response, context = right_pad(answers, response_len, tokenizer.pad_id)
    response_mask = context.copy()
    for j, start, stop in tool_spans:
        response_mask[j, start:stop] = 0
    return {"tokens": np.concatenate([prompt, response], 1), "mask": np.concatenate([prompt_mask, context], 1),
            "response_mask": response_mask, "denom": np.float32(response_mask.sum())}


def _calculator_demo(problem: Problem) -> tuple[str, str] | None:
    """The plain calculator call and result that answer ``problem`` (None: its prompt is no expression whose
    value is the answer)."""
    from nereus_jax.rl.tools import ToolError, calculate  # noqa: PLC0415 - only with demonstrations

    if not isinstance(problem.prompt, str) or not problem.prompt.endswith("="):
        return None
    expr = problem.prompt[:-1]
    try:
        value = calculate(expr)
    except ToolError:
        return None
    return (f"[calculator: {expr}]", f"[result: {value}]") if value == problem.answer else None


def teacher_forced_accuracy(params, cfg: ModelConfig, batch: dict, prompt_len: int) -> float:
    """Fraction of rows whose greedy continuation is exactly the reference answer followed by eos."""
    logits = jax.jit(response_logits, static_argnums=(1, 4))(params, cfg, batch["tokens"], batch["mask"], prompt_len)
    hit = (np.asarray(jnp.argmax(logits, -1)) == batch["tokens"][:, prompt_len:]) | (batch["response_mask"] == 0)
    return float(np.mean(np.all(hit, axis=1)))


def cache_key(cfg: Config, vocab_size: int) -> str:
    """Hash of everything that determines the warm-started weights."""
    t = cfg.trainer
    parts = {"model": cfg.model.to_dict(), "task": cfg.task.to_dict(), "steps": t.warmup_sft_steps, "lr": t.sft_lr,
             "target": t.warmup_target_accuracy,
             "batch": t.sft_batch, "seed": t.seed, "vocab": vocab_size, "prompt": cfg.rollout.max_prompt_length,
             "response": cfg.rollout.max_response_length, "version": 1}
    if t.warmup_tool_fraction:
        parts["tool_fraction"] = t.warmup_tool_fraction
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def save_params(path: str, params: dict) -> None:
    """Writes a parameter tree atomically (temp file + rename): a crash never leaves half a file."""
    flat = {"/".join(str(k.key) for k in p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **flat)
    os.replace(tmp, path)


def load_params(path: str, like: dict) -> dict:
    """Reads a tree written by :func:`save_params` into the structure of ``like``."""
    with np.load(path) as data:
        return jax.tree_util.tree_map_with_path(lambda p, _: data["/".join(str(k.key) for k in p)], like)


def run_sft(params: dict, cfg: Config, task, tokenizer, mesh: Mesh,
            progress: Callable[[int, dict], None] | None = None, *, first_index: int = SFT_INDEX_OFFSET,
            max_seconds: float | None = None) -> dict:
    """``trainer.warmup_sft_steps`` supervised steps, data-parallel over ``mesh``'s dp axis, stopping early
    once validation accuracy reaches ``trainer.warmup_target_accuracy`` (checked every CHECK_EVERY steps).
    With ``max_seconds``: as many steps as fit in that time instead. ``params`` are donated."""
    t, m = cfg.trainer, cfg.model
    P, R = cfg.rollout.max_prompt_length, cfg.rollout.max_response_length
    dp = mesh.shape.get("dp", 1)
    opt, step = _sft_program(m, P, t.sft_lr, t.vocab_chunk)
    opt_state = opt.init(params)
    accum = accumulation_steps(t.sft_batch, dp, P + R, with_micro_batch_tokens(cfg).trainer.micro_batch_tokens)
    target = t.warmup_target_accuracy if max_seconds is None else 0.0
    valid = encode_sft([task.problem(VALIDATION_OFFSET + j) for j in range(256)], tokenizer, P, R,
                       cfg.task) if target else None
    start = time.perf_counter()
    for i in itertools.count():
        if (i >= t.warmup_sft_steps) if max_seconds is None else (time.perf_counter() - start >= max_seconds):
            break
        if target and i and i % CHECK_EVERY == 0 and teacher_forced_accuracy(params, m, valid, P) >= target:
            break
        problems = [task.problem(first_index + i * t.sft_batch + j) for j in range(t.sft_batch)]
        data = put_micro(split_micro(encode_sft(problems, tokenizer, P, R, cfg.task, t.warmup_tool_fraction), accum),
                         mesh)
        params, opt_state, metrics = step(params, opt_state, data)
        if progress is not None:
            progress(i, metrics)
    return params


@functools.lru_cache(maxsize=8)
def _sft_program(cfg: ModelConfig, prompt_len: int, lr: float, vocab_chunk: int):
    """One jitted supervised step per (model, prompt length, lr), shared by the warm start and the SFT
    control so the control does not compile it again."""
    opt = make_optimizer(lr)
    return opt, jax.jit(make_train_step(sft_loss(cfg, prompt_len, vocab_chunk=vocab_chunk), opt, cfg),
                        donate_argnums=(0, 1))


def cached_warm_start(params: dict, cfg: Config, task, tokenizer, mesh: Mesh, cache_dir: str,
                      progress=None) -> tuple[dict, bool]:
    """Warm-started params laid out like ``params``, from the cache if present. Returns (params, cache_hit)."""
    path = os.path.join(cache_dir, f"sft-{cache_key(cfg, tokenizer.vocab_size)}.npz")
    shardings = jax.tree.map(lambda x: x.sharding, params)
    from nereus_jax.runtime.platform.distributed import all_processes, is_primary

    if all_processes(os.path.exists(path)):  # several processes: a hit only if every one can read it
        host = load_params(path, gather_params(params, cfg.model))
        return _relayout(host, params, cfg, shardings), True
    trained = run_sft(params, cfg, task, tokenizer, mesh, progress)
    host = gather_params(trained, cfg.model)
    if is_primary():  # one writer (the file is the same on every process)
        save_params(path, host)
    return trained, False


def _relayout(host: dict, like: dict, cfg: Config, shardings) -> dict:
    from nereus_jax.sharding import expand_kv

    rep = like["layers"]["attn"]["wk"].shape[2] // cfg.model.num_kv_heads
    return jax.device_put(expand_kv(host, rep), shardings)
