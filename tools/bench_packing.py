"""Benchmark of sequence packing (``trainer.packing``) on a train step; prints one JSON object on its last line.

    .venv312/bin/python tools/bench_packing.py            # ~3 minutes on 2 CPU cores
    .venv312/bin/python tools/bench_packing.py --smoke    # tiny shapes, seconds (tests/test_bench_packing.py)

Workload: 64 sequences of 32 prompt tokens with response lengths drawn as the copy task draws them
(Pareto(1) scaled to >= 16 and capped at 512: ``min(512, floor(16 / (1 - u)))``, so P(length >= n) = 16 / n:
most responses are short, a few run to the cap), on a ~6M-parameter llama-shaped model in float32 on one CPU
device. One actor update (PPO's clipped loss, token-mean, Adam) over the batch in the job's micro-batches
with ``micro_batch_tokens`` 8192, in the same process:

- padded: every row ``32 + 512`` tokens, micro-batches of ``8192 // 544`` rows (``accumulation_steps``);
- packed: the same sequences packed end to end (``nereus_jax.rl.packing``) into rows of 544 with segment
  ids, the fewest micro-batches whose packed rows fit the same budget.

``padded_tokens_per_s`` / ``packed_tokens_per_s`` count the real tokens (prompt + response, identical in both)
over the step's wall time (median of ``--repeats`` alternating runs, after a compile run each);
``speedup`` is their ratio (goal >= 1.5). ``max_abs_grad_diff``: the largest difference between the two
layouts' gradients (same parameters, summed over micro-batches), which should be float noise (<= 1e-5).
Against the machine: ``matmul_gflop_per_s`` is a 1024^3 float32 matmul's rate measured in this run, and each
layout's ``model_gflop_per_s`` counts the useful work it did (6 x non-embedding parameters x real tokens,
plus causal attention over each sequence's own tokens) over its step time, so ``fraction_of_matmul`` says how
close the step gets to what this machine's matmul units can do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nereus_jax.config import AlgorithmConfig, ModelConfig  # noqa: E402
from nereus_jax.elastic.topology import accumulation_steps  # noqa: E402
from nereus_jax.models import abstract_params, count_params, init_params  # noqa: E402
from nereus_jax.rl import packing  # noqa: E402
from nereus_jax.runtime.step import losses  # noqa: E402

BENCH_MODEL = ModelConfig(name="bench-6m", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4,
                          num_kv_heads=2, intermediate_size=768, tie_embeddings=True, max_position_embeddings=1024)
SMOKE_MODEL = ModelConfig(name="bench-smoke", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2,
                          num_kv_heads=1, intermediate_size=64, tie_embeddings=True, max_position_embeddings=256)


def long_tail_batch(sequences: int, prompt_len: int, longest: int, vocab: int, seed: int = 0) -> dict:
    """A rollout batch in the padded layout with copy-task (Pareto) response lengths >= 16, <= ``longest``."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(longest, np.floor(16.0 / (1.0 - rng.random(sequences)))).astype(np.int64)
    width = prompt_len + longest
    mask = (np.arange(width)[None] < (prompt_len + lengths)[:, None]).astype(np.int32)
    tokens = (rng.integers(3, vocab, (sequences, width)) * mask).astype(np.int32)
    resp = mask[:, prompt_len:]
    return {"tokens": tokens, "mask": mask, "response_mask": resp,
            "old_logp": (rng.normal(-8.3, 0.1, resp.shape) * resp).astype(np.float32),
            "ref_logp": (rng.normal(-8.3, 0.1, resp.shape) * resp).astype(np.float32),
            "advantages": (rng.normal(size=(sequences, 1)) * resp).astype(np.float32)}


def micro_batches(batch: dict, prompt_len: int, budget: int, packed: bool) -> tuple[dict, dict]:
    """The job's micro-batches of ``batch`` (one mini-batch), padded or packed, and what they hold."""
    rows, width = batch["tokens"].shape
    if not packed:
        accum = accumulation_steps(rows, 1, width, budget)
        return losses.split_minibatches(batch, 1, accum), {"micro_batches": accum, "token_slots": rows * width}
    layout = packing.pack(batch["tokens"], batch["mask"], prompt_len=prompt_len, mini=1, dp=1,
                          budget_rows=budget // width)
    return losses.split_packed(batch, layout, mini=1), {
        "micro_batches": layout.accum, "packed_rows_per_micro_batch": layout.rows,
        "token_slots": int(layout.tokens.size), "fill": round(layout.packed_tokens / layout.tokens.size, 3)}


def useful_flops(cfg: ModelConfig, batch: dict) -> float:
    """Training FLOPs of the real tokens: 6 x non-embedding parameters per token, plus causal attention
    (QK^T and PV, forward and backward: 12 x layers x heads x head_dim per query-key pair) within each
    sequence, plus the tied head (6 x vocab x hidden per token)."""
    n = batch["mask"].sum(1).astype(np.float64)
    params = count_params(abstract_params(cfg)) - cfg.vocab_size * cfg.hidden_size
    pairs = float((n * (n + 1) / 2).sum())
    tokens = float(n.sum())
    return (6 * params * tokens + 6 * cfg.vocab_size * cfg.hidden_size * tokens
            + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs)


def matmul_rate(n: int, repeats: int) -> float:
    """FLOP/s of an n x n x n float32 matmul on the default device (median of ``repeats``)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / float(np.median(times))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few seconds")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    cfg = SMOKE_MODEL if args.smoke else BENCH_MODEL
    sequences, prompt_len, longest, budget = (16, 8, 64, 512) if args.smoke else (64, 32, 512, 8192)
    repeats = 2 if args.smoke else args.repeats
    batch = long_tail_batch(sequences, prompt_len, longest, cfg.vocab_size)
    params = init_params(cfg, seed=0)
    optimizer = losses.make_optimizer(1e-5)
    loss = losses.actor_loss(cfg, AlgorithmConfig(name="ppo", kl_in_reward=False), prompt_len)
    step = jax.jit(losses.make_minibatch_train_step(loss, optimizer, cfg))
    opt_state = optimizer.init(params)

    def grads(params, micro):  # the update's gradient: summed over the micro-batches of its one mini-batch
        mbs = jax.tree.map(lambda x: x[0], micro)

        def one(acc, mb):
            return jax.tree.map(jnp.add, acc, jax.grad(lambda p: loss(p, mb)[0])(params)), None
        return jax.lax.scan(one, jax.tree.map(jnp.zeros_like, params), mbs)[0]

    layouts, grad_of = {}, {}
    for name in ("padded", "packed"):
        host, info = micro_batches(batch, prompt_len, budget, name == "packed")
        micro = jax.device_put(host)
        jax.block_until_ready(step(params, opt_state, micro))  # compile
        layouts[name] = (micro, info)
        grad_of[name] = jax.jit(grads)(params, micro)
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grad_of["packed"], grad_of["padded"])
    times = {"padded": [], "packed": []}
    for _ in range(repeats):
        for name, (micro, _) in layouts.items():
            t = time.perf_counter()
            jax.block_until_ready(step(params, opt_state, micro))
            times[name].append(time.perf_counter() - t)
    matmul = matmul_rate(256 if args.smoke else 1024, repeats)
    real = int(batch["mask"].sum())
    flops = useful_flops(cfg, batch)
    out = {"benchmark": "packing", "smoke": args.smoke, "device": str(jax.devices()[0].device_kind),
           "jax_version": jax.__version__, "model": cfg.name, "params": count_params(params),
           "sequences": sequences, "prompt_len": prompt_len, "max_response": longest, "micro_batch_tokens": budget,
           "real_tokens": real, "response_length_mean": round(float(batch["response_mask"].sum(1).mean()), 1),
           "response_length_max": int(batch["response_mask"].sum(1).max()),
           "matmul_gflop_per_s": round(matmul / 1e9, 2)}
    for name, (_, info) in layouts.items():
        seconds = float(np.median(times[name]))
        out[name] = {**info, "step_s": round(seconds, 4), "model_gflop_per_s": round(flops / seconds / 1e9, 2),
                     "fraction_of_matmul": round(flops / seconds / matmul, 3)}
        out[f"{name}_tokens_per_s"] = round(real / seconds, 1)
    out["speedup"] = round(out["packed_tokens_per_s"] / out["padded_tokens_per_s"], 3)
    out["max_abs_grad_diff"] = max(jax.tree.leaves(diff))
    out["goal_speedup"] = 1.5
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
