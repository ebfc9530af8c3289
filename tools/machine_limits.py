"""What the benchmarks in tools/ share: a program's XLA peak bytes, median seconds of a jitted call, the
machine's physical limits measured in the benchmark's own run (float32 matmul FLOP/s, copy bandwidth), and a
random actor-loss micro-batch, and the Qwen3-shaped models the training benchmarks run (float32).

    from machine_limits import actor_batch, copy_bytes_per_s, matmul_flops_per_s, median_seconds, peak_bytes
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from nereus_jax.config import ModelConfig

QWEN3_MODELS = {
    "qwen3-32k": ModelConfig(name="qwen3-h512-l4-v32k", family="qwen3", vocab_size=32768, hidden_size=512,
                             num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1536,
                             qk_norm=True, tie_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
    # --quick: the same family, small enough for a test
    "qwen3-8k": ModelConfig(name="qwen3-h256-l2-v8k", family="qwen3", vocab_size=8192, hidden_size=256,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768,
                            qk_norm=True, tie_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
}


def peak_bytes(compiled) -> int:
    """Per-device bytes of a compiled program from XLA's buffer assignment: arguments + temporaries + outputs
    that do not reuse a donated input."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` (blocked until ready) over ``repeats`` calls after one warm-up."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved_median_seconds(fns: dict, repeats: int) -> dict:
    """Median wall seconds of each of ``fns`` (name -> call, blocked until ready) over ``repeats`` rounds after
    one warm-up round, every round calling each once in turn: a baseline and its rival see the same moments
    of a shared host's load, where timing one after the other compares different loads."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def matmul_flops_per_s(n: int = 2048, repeats: int = 3) -> float:
    """float32 FLOP/s of a square n x n matmul."""
    a = jnp.asarray(np.random.default_rng(1).normal(size=(n, n)), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return 2.0 * n**3 / median_seconds(lambda: f(a), repeats)


def copy_bytes_per_s(n_bytes: int = 2**28, repeats: int = 3) -> float:
    """Bytes read + written per second by an elementwise pass over an ``n_bytes`` float32 array."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)  # reads and writes every byte once
    return 2.0 * n_bytes / median_seconds(lambda: f(x), repeats)


def actor_batch(vocab_size: int, rows: int, prompt: int, response: int) -> dict:
    """A seeded host micro-batch for the actor loss: random tokens, left padding on half the rows, old and
    reference log-probs near a uniform policy's (-log V), random advantages."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab_size, size=(rows, prompt + response)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[: rows // 2, : prompt // 2] = 0
    uniform = -float(np.log(vocab_size))
    return {"tokens": tokens, "mask": mask, "response_mask": np.ones((rows, response), np.float32),
            "old_logp": rng.normal(uniform, 0.1, (rows, response)).astype(np.float32),
            "ref_logp": rng.normal(uniform, 0.1, (rows, response)).astype(np.float32),
            "advantages": rng.normal(size=(rows, response)).astype(np.float32)}
