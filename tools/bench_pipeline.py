"""Benchmark of GPipe pipeline parallelism: training step time vs pp and micro-batches, and the bubble.

    .venv312/bin/python tools/bench_pipeline.py           # pp in {1, 2, 4} x m in {1, 2, 4, 8} (~3 min, 2 CPU cores)
    .venv312/bin/python tools/bench_pipeline.py --quick   # pp in {1, 2, 4} x m in {1, 4}, fewer repeats (~1.5 min)

Prints one JSON object on its last line: ``rows`` (``pp``, ``microbatches``, ``step_s``, ``bubble_measured``,
``bubble_formula`` and the figures behind them), ``matmul_flops_per_s`` and ``method``.

Workload: one training step (next-token loss, ``jax.value_and_grad`` through
:func:`~nereus_jax.sharding.pipeline.pipeline_forward`, SGD update, donated parameters) of an 8-layer
~8M-parameter llama-shaped model in float32, batch 16 x 32 tokens, tp = 1, on pp of the 8 virtual CPU
devices. The 8 devices share this machine's cores, so wall time shows the total work of all stages
(bubble ticks compute on zeros, so they cost as much as real ticks), not the per-stage timeline; the
bubble is measured from the schedule's per-stage busy/idle time instead:

1. the pipelined program runs and returns its own record of which micro-batch each stage processed at
   each tick (-1 = bubble) (:func:`~nereus_jax.sharding.pipeline.executed_schedule`);
2. one stage's work per tick (its pp-th of the layers, forward + backward, on one micro-batch) is timed
   alone on one device;
3. each stage is busy (its real ticks) x (tick time) out of a makespan of (ticks) x (tick time) (each tick
   ends in a ``ppermute`` barrier), so bubble_measured = 1 - sum(busy) / (pp x makespan); the backward is
   the transposed scan, the same tick table reversed.

``fraction_of_matmul_rate`` compares the step's useful model FLOPs per second with a large float32 matmul
timed in the same run; ``executed_fraction_of_matmul_rate`` counts the bubble's zero-work too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nereus_jax.config import ModelConfig  # noqa: E402
from nereus_jax.models import apply_layers, causal_mask, default_positions, init_params  # noqa: E402
from nereus_jax.sharding import Layout, make_mesh, shard_params  # noqa: E402
from nereus_jax.sharding.pipeline import (  # noqa: E402
    bubble_fraction,
    executed_schedule,
    pipeline_forward_fn,
)

BENCH_MODEL = ModelConfig(name="bench-pp", vocab_size=512, hidden_size=256, num_layers=8, num_heads=8,
                          num_kv_heads=4, intermediate_size=1024)
BATCH, SEQ = 16, 32


def timed(fn, *args, reps: int) -> float:
    """Median wall seconds of ``fn(*args)`` after one warm-up (compile) call; ``args`` are re-used."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops_per_s(n: int = 2048, reps: int = 5) -> float:
    """float32 [n, n] @ [n, n] on one device (all the machine's cores), FLOP/s."""
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n)), jax.devices()[0])
    return 2 * n**3 / timed(jax.jit(lambda a: a @ a), a, reps=reps)


def model_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Training FLOPs of one step (3 x forward): every matmul, attention scores and values included."""
    d, e, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = d * e * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * f
    tokens = batch * seq
    forward = 2 * tokens * (cfg.num_layers * per_layer + d * cfg.vocab_size)
    forward += cfg.num_layers * 4 * batch * seq * seq * cfg.num_heads * e
    return 3.0 * forward


def train_step(cfg: ModelConfig, mesh, microbatches: int):
    fwd = pipeline_forward_fn(mesh, microbatches)

    def loss(params, tokens_bt):
        logp = jax.nn.log_softmax(fwd(params, cfg, tokens_bt)[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1))

    def step(params, tokens_bt):
        value, grads = jax.value_and_grad(loss)(params, tokens_bt)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value

    return jax.jit(step, donate_argnums=0)


def stage_tick_s(cfg: ModelConfig, params: dict, pp: int, microbatches: int, reps: int) -> float:
    """One stage's work in one tick, alone on one device: its layers, forward + backward, one micro-batch."""
    dev = jax.devices()[0]
    layers = jax.device_put(jax.tree.map(lambda x: x[: cfg.num_layers // pp], params["layers"]), dev)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (BATCH // microbatches, SEQ, cfg.hidden_size)), dev)
    positions, mask = default_positions(x[..., 0], None), causal_mask(SEQ, None)

    def tick(layers, x):
        y, vjp = jax.vjp(lambda layers, x: apply_layers(layers, cfg, x, positions, mask), layers, x)
        return vjp(y)

    return timed(jax.jit(tick), layers, x, reps=reps)


def row(cfg, params, tokens, pp: int, m: int, matmul_rate: float, reps: int) -> dict:
    mesh = make_mesh(jax.devices()[:pp], Layout(pp=pp))
    sharded = shard_params(params, cfg, Layout(pp=pp), mesh)
    step = train_step(cfg, mesh, m)
    jax.block_until_ready(step(sharded, tokens))  # compile (donates ``sharded``)
    state = [shard_params(params, cfg, Layout(pp=pp), mesh)]

    def run():
        state[0], value = step(state[0], tokens)
        return value

    step_s = timed(run, reps=reps)
    record = executed_schedule(state[0], cfg, tokens, mesh=mesh, microbatches=m)
    tick_s = stage_tick_s(cfg, params, pp, m, reps)
    busy_s = (record >= 0).sum(axis=0) * tick_s
    makespan_s = record.shape[0] * tick_s
    useful = model_flops(cfg, BATCH, SEQ)
    layer_share = 1 - 2 * cfg.hidden_size * cfg.vocab_size * 3 * BATCH * SEQ / useful
    executed = useful * (1 + layer_share * (record.shape[0] / m - 1))
    return {
        "pp": pp, "microbatches": m, "step_s": round(step_s, 4),
        "bubble_measured": round(1 - float(busy_s.sum()) / (pp * makespan_s), 4),
        "bubble_formula": round(bubble_fraction(pp, m), 4),
        "ticks": int(record.shape[0]), "busy_ticks_per_stage": (record >= 0).sum(axis=0).tolist(),
        "stage_tick_s": round(tick_s, 5), "stage_timeline_s": round(makespan_s, 4),
        "executed_stage_work_s": round(pp * makespan_s, 4),
        "useful_gflop": round(useful / 1e9, 2), "executed_gflop": round(executed / 1e9, 2),
        "fraction_of_matmul_rate": round(useful / step_s / matmul_rate, 3),
        "executed_fraction_of_matmul_rate": round(executed / step_s / matmul_rate, 3),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="pp in {1, 2, 4} x m in {1, 4}, fewer repeats")
    args = parser.parse_args(argv)
    reps = 2 if args.quick else 3
    cfg = BENCH_MODEL
    params = jax.tree.map(np.asarray, init_params(cfg, seed=0))
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (BATCH, SEQ), 0, cfg.vocab_size), np.int32)
    matmul_rate = matmul_flops_per_s(reps=reps + 2)
    grid = [(1, 1)] + [(pp, m) for pp in (2, 4) for m in ((1, 4) if args.quick else (1, 2, 4, 8))]
    rows = []
    for pp, m in grid:
        rows.append(row(cfg, params, tokens, pp, m, matmul_rate, reps))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {
        "bench": "pipeline", "schedule": "gpipe", "jax": jax.__version__, "devices": len(jax.devices()),
        "cores": os.cpu_count(), "model": cfg.name, "batch": BATCH, "seq": SEQ, "tp": 1,
        "matmul_flops_per_s": round(matmul_rate), "rows": rows,
        "max_bubble_error": max(abs(r["bubble_measured"] - r["bubble_formula"]) for r in rows),
        "method": (
            "bubble_measured = 1 - sum_s busy_s / (pp * makespan): busy ticks per stage read back from the "
            "executing pipeline's own per-tick record (executed_schedule), each tick weighted by one stage's "
            "forward+backward on one micro-batch timed alone on one device (stage_tick_s); makespan = ticks x "
            "stage_tick_s (ppermute barrier per tick). Wall time (step_s) is not used for the bubble: the 8 "
            "virtual devices share the machine's cores and bubble ticks compute on zeros, so step_s tracks "
            "executed_stage_work_s (all stages' ticks, bubble included) rather than one stage's timeline."),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
