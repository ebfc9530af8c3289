"""Benchmark of pipeline parallelism: training step time vs pp and micro-batches, the bubble and the activation
memory of the GPipe and 1F1B schedules, for the standalone pipeline and for the job's own train step.

    .venv312/bin/python tools/bench_pipeline.py           # kernel pp {1, 2, 4} x m {1, 2, 4, 8} x both schedules,
                                                          # job pp {2, 4} x both at m = 8 (~10 min, 2 CPU cores)
    .venv312/bin/python tools/bench_pipeline.py --quick   # kernel m {1, 8}, fewer repeats
    .venv312/bin/python tools/bench_pipeline.py --smoke   # kernel pp 2 m {2, 8}, job pp 2 m 8, one repeat

Prints one JSON object on its last line: ``rows``, ``matmul_flops_per_s``, ``method`` and checks. Every row
has ``schedule`` ("gpipe" or "1f1b"), ``source`` ("kernel": the standalone pipeline on a next-token loss;
"job": the job's own actor-train program), ``pp``, ``microbatches``, ``step_s``, ``bubble_measured``,
``bubble_formula``, ``peak_activation_bytes`` (the compiled train program's ``memory_analysis()``
temporaries: activations, stashes and gradients in flight; parameters and inputs are arguments) and the
figures behind them.

Kernel workload: one training step (next-token loss; GPipe: ``jax.value_and_grad`` through
:func:`~nereus_jax.sharding.pipeline.pipeline_forward`; 1F1B:
:func:`~nereus_jax.sharding.pipeline.pipeline_value_and_grad`; SGD update, donated parameters) of an 8-layer
~8M-parameter llama-shaped model in float32, batch 16 x 32 tokens, tp = 1, on pp of the 8 virtual CPU
devices. Job workload: the job (GRPO, an 8-layer model, 16 sequences of 20 tokens, 8-row calls so
m = 8) with actor-train at pp and dp = 1, its train program built and compiled by the job itself.

The 8 devices share this machine's cores, so wall time shows the total work of all stages, not the
per-stage timeline; the bubble is measured from the schedule's per-stage busy/idle time instead:

1. which micro-batch each stage runs at each tick: kernel rows read it back from the running pipeline
   (:func:`~nereus_jax.sharding.pipeline.executed_schedule`, ``executed_1f1b_schedule``); job rows take the
   schedule's tick table for the job's (pp, m) and check the compiled train program loops over exactly its
   ticks (the while loop's known trip count in the HLO), the tables themselves being what the kernel rows
   and tests read back from running programs;
2. each stage's work per tick is timed alone on one device: GPipe, its layers forward + backward on one
   micro-batch (its forward and backward scans each take m + pp - 1 ticks; bubble ticks compute on zeros);
   1F1B, the forward half (its layers forward; on the last stage plus the head and the loss, forward and
   backward) and the backward half (the layers' ``jax.vjp`` from the stashed input: recompute + backward),
   idle halves skipped;
3. each tick ends in a ``ppermute``, so it lasts as long as its busiest stage: makespan = sum over ticks of
   the largest stage's work, bubble_measured = 1 - sum(stage work) / (pp x makespan).

``fraction_of_matmul_rate`` (kernel rows) compares the step's useful model FLOPs per second with a large
float32 matmul timed in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nereus_jax.config import ModelConfig, load_config  # noqa: E402
from nereus_jax.elastic.costs import pipeline_microbatches  # noqa: E402
from nereus_jax.model_stage import ACTOR_TRAIN  # noqa: E402
from nereus_jax.models import apply_layers, causal_mask, default_positions, init_params, output_head  # noqa: E402
from nereus_jax.rl.tasks import make_task  # noqa: E402
from nereus_jax.rl.tokenizer import CharTokenizer  # noqa: E402
from nereus_jax.runtime.step import losses  # noqa: E402
from nereus_jax.runtime.step.job import Job  # noqa: E402
from nereus_jax.sharding import Layout, make_mesh, shard_params  # noqa: E402
from nereus_jax.sharding.pipeline import (  # noqa: E402
    bubble_fraction,
    executed_1f1b_schedule,
    executed_schedule,
    gpipe_schedule,
    one_f_one_b_schedule,
    pipeline_forward_fn,
    pipeline_value_and_grad,
)

BENCH_MODEL = ModelConfig(name="bench-pp", vocab_size=512, hidden_size=256, num_layers=8, num_heads=8,
                          num_kv_heads=4, intermediate_size=1024)
BATCH, SEQ = 16, 32
# the job rows: GRPO on 1-digit addition, an 8-layer model, 8 prompts x 2 samples of 12 + 8 tokens, 8-row calls
# (micro_batch_tokens / 20) so m = pipeline_microbatches(8, pp) = 8 for pp 2 and 4; actor-train alone pipelined
JOB = ["model.num_layers=8", "model.hidden_size=128", "model.intermediate_size=512", "algorithm.name=grpo",
       "rollout.max_prompt_length=12", "rollout.max_response_length=8", "trainer.prompts_per_step=8",
       "rollout.samples_per_prompt=2", "trainer.micro_batch_tokens=160", "logging.progress=false",
       "task.num_digits=1", "task.eval_size=16", "plan.stages.actor-gen.dp=2", "plan.stages.actor-train.dp=1"]
JOB_PROMPT, JOB_ROWS = 12, 8


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


# ------------------------------------------------------------------------------------------ measurement
def measured_bubble(work: np.ndarray) -> float:
    """1 - busy / (pp x makespan) of a [ticks, pp] table of seconds each stage works in each tick; a tick
    lasts as long as its busiest stage (it ends in a ppermute)."""
    return 1.0 - float(work.sum()) / (work.shape[1] * float(work.max(axis=1).sum()))


def tick_work(schedule: str, record: np.ndarray, phase_s: dict) -> np.ndarray:
    """[ticks, pp] seconds of work from a tick table: GPipe ticks run forward + backward of one micro-batch
    (one tick of each scan); 1F1B ticks a forward half (the last stage adds the head and loss, forward and
    backward) and a backward half (recompute + backward)."""
    if schedule == "gpipe":
        return (record >= 0) * (phase_s["forward"] + phase_s["backward"])
    fwd = (record[..., 0] >= 0) * phase_s["forward"]
    fwd[:, -1] += (record[:, -1, 0] >= 0) * phase_s["head"]
    return fwd + (record[..., 1] >= 0) * phase_s["recompute_backward"]


def phase_seconds(cfg: ModelConfig, params: dict, pp: int, rows: int, seq: int, head_loss, reps: int) -> dict:
    """One stage's work on one micro-batch of ``rows`` x ``seq``, each timed alone on one device: forward;
    backward after a saved forward (GPipe's backward tick: vjp minus forward); recompute + backward (1F1B's
    backward half); the head and loss forward + backward (``head_loss(head_params, hidden)``)."""
    dev = jax.devices()[0]
    layers = jax.device_put(jax.tree.map(lambda x: x[: cfg.num_layers // pp], params["layers"]), dev)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (rows, seq, cfg.hidden_size)), dev)
    positions, mask = default_positions(x[..., 0], None), causal_mask(seq, None)
    stage = lambda layers, x: apply_layers(layers, cfg, x, positions, mask)  # noqa: E731

    def vjp(layers, x):
        y, back = jax.vjp(stage, layers, x)
        return back(y)

    head = jax.device_put({k: v for k, v in params.items() if k != "layers"}, dev)
    out = {"forward": timed(jax.jit(stage), layers, x, reps=reps),
           "recompute_backward": timed(jax.jit(vjp), layers, x, reps=reps),
           "head": timed(jax.jit(jax.grad(head_loss, argnums=(0, 1))), head, x, reps=reps)}
    out["backward"] = max(out["recompute_backward"] - out["forward"], 0.0)
    return out


def _next_token_loss(cfg: ModelConfig):
    def make_loss(forward_fn):
        def loss(params, mb):
            logp = jax.nn.log_softmax(forward_fn(params, cfg, mb["tokens"])[:, :-1], axis=-1)
            nll = -jnp.take_along_axis(logp, mb["tokens"][:, 1:, None], axis=-1)[..., 0]
            return jnp.sum(nll) / mb["denom"], {}

        return loss

    return make_loss


def _head_loss(make_loss, cfg: ModelConfig, mb: dict):
    """``(head params, hidden) -> loss``: the head and loss of one micro-batch, as 1F1B's last stage runs them."""
    def fn(head, hidden):
        forward_fn = lambda params, cfg, *a, **k: output_head(params, cfg, hidden)  # noqa: E731
        return make_loss(forward_fn)(head, mb)[0]

    return fn


# ------------------------------------------------------------------------------------------ kernel rows
def kernel_step(cfg: ModelConfig, mesh, m: int, schedule: str):
    make_loss = _next_token_loss(cfg)

    def grads(params, tokens_bt):
        denom = jnp.float32(tokens_bt.size - tokens_bt.shape[0])
        if schedule == "gpipe":
            return jax.value_and_grad(lambda p: make_loss(pipeline_forward_fn(mesh, m))(
                p, {"tokens": tokens_bt, "denom": denom})[0])(params)
        pieces = {"tokens": jnp.moveaxis(tokens_bt.reshape(-1, m, tokens_bt.shape[1]), 1, 0),
                  "denom": jnp.full((m,), denom)}
        (values, _), g = pipeline_value_and_grad(make_loss, params, pieces, mesh=mesh)
        return jnp.sum(values), g

    def step(params, tokens_bt):
        value, g = grads(params, tokens_bt)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, g), value

    return jax.jit(step, donate_argnums=0)


def kernel_row(cfg, params, tokens, pp: int, m: int, schedule: str, matmul_rate: float, reps: int) -> dict:
    mesh = make_mesh(jax.devices()[:pp], Layout(pp=pp))
    step = kernel_step(cfg, mesh, m, schedule)
    compiled = step.lower(shard_params(params, cfg, Layout(pp=pp), mesh), tokens).compile()
    state = [shard_params(params, cfg, Layout(pp=pp), mesh)]

    def run():
        state[0], value = step(state[0], tokens)
        return value

    step_s = timed(run, reps=reps)
    pieces = {"tokens": np.moveaxis(tokens.reshape(-1, m, SEQ), 1, 0),
              "denom": np.full((m,), tokens.size - len(tokens), np.float32)}
    if pp == 1:
        record = gpipe_schedule(1, m)[:1]  # one pass over the whole batch
    elif schedule == "gpipe":
        record = executed_schedule(state[0], cfg, tokens, mesh=mesh, microbatches=m)
    else:
        record = executed_1f1b_schedule(_next_token_loss(cfg), state[0], pieces, mesh=mesh)
    rows = BATCH // (m if pp > 1 else 1)
    head_mb = {"tokens": jnp.asarray(tokens[:rows]), "denom": jnp.float32(tokens.size)}
    phases = phase_seconds(cfg, params, pp, rows, SEQ, _head_loss(_next_token_loss(cfg), cfg, head_mb), reps)
    useful = model_flops(cfg, BATCH, SEQ)
    return {
        "schedule": schedule, "source": "kernel", "pp": pp, "microbatches": m, "step_s": round(step_s, 4),
        "bubble_measured": round(measured_bubble(tick_work(schedule, record, phases)), 4),
        "bubble_formula": round(bubble_fraction(pp, m), 4),
        "peak_activation_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "ticks": int(record.shape[0]), **_phase_fields(phases),
        "useful_gflop": round(useful / 1e9, 2), "fraction_of_matmul_rate": round(useful / step_s / matmul_rate, 3),
    }


def _phase_fields(phases: dict) -> dict:
    return {f"{k}_s": round(v, 5) for k, v in phases.items()}


# ------------------------------------------------------------------------------------------ job rows
def job_row(pp: int, schedule: str, reps: int) -> dict:
    """The job's own actor-train program at pp (dp = 1) under ``schedule``: its step time (the job's
    stage_seconds), its compiled program's temporaries and tick loop, and the bubble of its tick table
    weighted by its model's per-stage work (the head and the actor loss for 1F1B's last stage)."""
    cfg = load_config(None, JOB + [f"plan.stages.actor-train.pp={pp}", f"trainer.pipeline_schedule={schedule}"])
    job = Job(cfg, make_task(cfg.task), CharTokenizer())
    try:
        seconds = [job.step(s).metrics["stage_seconds"]["actor-train"] for s in range(reps + 1)][1:]
        programs = job.stages.prepare_programs(job.plan, changed_only=False)
        programs = [c for key, c in programs.items() if key[0] == "train" and key[1] == ACTOR_TRAIN]
        params = jax.tree.map(np.asarray, job.actor_host_params())
    finally:
        job.close()
    (compiled,) = programs
    hlo = compiled.as_text()
    seq = cfg.rollout.max_prompt_length + cfg.rollout.max_response_length
    m = pipeline_microbatches(JOB_ROWS, pp)
    record = one_f_one_b_schedule(pp, m) if schedule == "1f1b" else gpipe_schedule(pp, m)
    ticks = record.shape[0]
    trip_counts = {int(n) for n in _known_trip_counts(hlo)}
    rows = JOB_ROWS // m
    phases = phase_seconds(cfg.model, params, pp, rows, seq, _job_head_loss(cfg, rows, seq), reps)
    return {
        "schedule": schedule, "source": "job", "pp": pp, "microbatches": m,
        "step_s": round(statistics.median(seconds), 4),
        "bubble_measured": round(measured_bubble(tick_work(schedule, record, phases)), 4),
        "bubble_formula": round(bubble_fraction(pp, m), 4),
        "peak_activation_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "ticks": ticks, "program_loops_over_ticks": ticks in trip_counts,
        "collective_permutes": hlo.count("collective-permute("), **_phase_fields(phases),
    }


def _known_trip_counts(hlo: str) -> list[str]:
    return re.findall(r'"known_trip_count":\{"n":"(\d+)"', hlo)


def _job_head_loss(cfg, rows: int, seq: int):
    """The job's actor loss (GRPO's settings) on one micro-batch of ``rows`` sequences, through the head."""
    resp = seq - JOB_PROMPT
    rng = np.random.default_rng(0)
    mb = {"tokens": jnp.asarray(rng.integers(3, cfg.model.vocab_size, (rows, seq)), jnp.int32),
          "mask": jnp.ones((rows, seq), jnp.int32), "response_mask": jnp.ones((rows, resp), jnp.float32),
          "old_logp": jnp.full((rows, resp), -3.0), "ref_logp": jnp.full((rows, resp), -3.0),
          "advantages": jnp.asarray(rng.normal(size=(rows, resp)), jnp.float32),
          "denom": jnp.float32(rows * resp), "seq_denom": jnp.float32(rows)}
    make_loss = lambda fwd: losses.actor_loss(cfg.model, cfg.algorithm, JOB_PROMPT, fwd)  # noqa: E731
    return _head_loss(make_loss, cfg.model, mb)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="kernel m in {1, 8}, fewer repeats")
    parser.add_argument("--smoke", action="store_true", help="kernel pp 2 m {2, 8}, job pp 2, one repeat")
    args = parser.parse_args(argv)
    reps = 1 if args.smoke else 2 if args.quick else 3
    cfg = BENCH_MODEL
    params = jax.tree.map(np.asarray, init_params(cfg, seed=0))
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (BATCH, SEQ), 0, cfg.vocab_size), np.int32)
    matmul_rate = matmul_flops_per_s(reps=reps + 2)
    ms = (2, 8) if args.smoke else (1, 8) if args.quick else (1, 2, 4, 8)
    pps = (2,) if args.smoke else (2, 4)
    grid = ([] if args.smoke else [(1, 1, "gpipe")]) + [(pp, m, s) for pp in pps for m in ms for s in ("gpipe", "1f1b")]
    rows = []
    for pp, m, schedule in grid:
        rows.append(kernel_row(cfg, params, tokens, pp, m, schedule, matmul_rate, reps))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for pp in pps:
        for schedule in ("gpipe", "1f1b"):
            rows.append(job_row(pp, schedule, reps))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    job_at_8 = {(r["pp"], r["schedule"]): r["peak_activation_bytes"] for r in rows
                if r["source"] == "job" and r["microbatches"] == 8}
    result = {
        "bench": "pipeline", "jax": jax.__version__, "devices": len(jax.devices()), "cores": os.cpu_count(),
        "model": cfg.name, "batch": BATCH, "seq": SEQ, "tp": 1, "matmul_flops_per_s": round(matmul_rate),
        "rows": rows,
        "max_bubble_error": max(abs(r["bubble_measured"] - r["bubble_formula"]) for r in rows),
        "max_bubble_error_by_source_schedule": {
            f"{src}/{sch}": max((abs(r["bubble_measured"] - r["bubble_formula"]) for r in rows
                                 if r["source"] == src and r["schedule"] == sch), default=None)
            for src in ("kernel", "job") for sch in ("gpipe", "1f1b")},
        "job_1f1b_peak_below_gpipe_at_m8": all(job_at_8[(pp, "1f1b")] < job_at_8[(pp, "gpipe")] for pp in pps),
        "method": (
            "bubble_measured = 1 - sum(stage work) / (pp * makespan) over the schedule's [ticks, pp] table, each "
            "tick as long as its busiest stage (a ppermute ends it). Tables: kernel rows read back from the running "
            "pipeline (executed_schedule / executed_1f1b_schedule); job rows take the table of the job's (pp, m) "
            "after checking its compiled train program loops over exactly that many ticks (HLO known_trip_count). "
            "Stage work per tick, timed alone on one device: GPipe forward + backward of one micro-batch; 1F1B "
            "forward half (+ head and loss forward and backward on the last stage) and backward half (recompute + "
            "backward), idle halves skipped. Wall time (step_s) is not used for the bubble: the 8 virtual devices "
            "share the machine's cores. peak_activation_bytes: compiled.memory_analysis().temp_size_in_bytes of "
            "the train program (job rows: the job's own, compiled by Job.prepare)."),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
