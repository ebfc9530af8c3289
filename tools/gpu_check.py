"""One-command GPU check: the runtime's headline figures on the device it runs on, each against the
physical limit measured in the same run. Writes ONE JSON file, ``$OUT/gpu_check.json`` (``$OUT`` unset:
``runs/gpu_check``), rewritten after every section so a run cut short keeps what it measured, and prints the
same JSON object as its last line.

    bash tools/gpu_check.sh                        # the real run (~8 minutes on an H200); OUT=... sets the folder
    bash tools/gpu_check.sh --smoke                # tiny shapes, under a minute on 2 CPU cores (the test runs this)
    bash tools/gpu_check.sh --sections decode,train --budget decode=300
    bash tools/gpu_check.sh --set decode_batches=32,128 --set model=qwen3-0.6b   # other shapes (Shapes' fields)
    # on a lent device machine, from the repo root (PYTHONPATH = the checkout, no install; JSON under $OUT):
    #   run(command="bash tools/gpu_check.sh", timeout_s=600)

The ceilings, measured first (always):

- ``matmul_tflops``: one big square matmul in the model's compute dtype (bf16; 8192^3, median of 20 calls);
  MFU figures are against it, not the datasheet.
- ``copy_bandwidth_gb_s``: a 1 GiB device array through the jitted elementwise ``x + 1`` (reads 1 GiB,
  writes 1 GiB: bytes read + written over the median time); the HBM rooflines are against it.

The sections (``--sections``, default all) run in the order host, prefill, train, decode, each with a time
budget (``--budget``; defaults decode 270 s, train 120, prefill 45, host 45: about 8 minutes with the ceilings
and the compiles). No section starts after ``--max-seconds`` (480); decode, last, goes batch by batch and skips
a batch that would likely end past its budget. A section that fails or is skipped leaves its figures null with
the reason in ``reasons`` and the others go on; ``seconds`` has each section's wall time, ``complete`` says
whether the run got to the end.

- ``decode``: a ``llama3.2-1b``-shaped model (configs/models/, random weights, bf16 compute) in a paged
  engine (page 16, a pool of every slot's full capacity, admission "preempt") at 64 and 256 slots, on the copy
  task's long-tailed Pareto(1) lengths (``tools/bench_engine.py``'s ``longtail_workload``: 32-token prompts,
  forced lengths min(4096, floor(16 / (1 - u))), every length >= 16) through ``bench_engine.longtail_window``:
  a window of ``--decode-steps`` decode steps from an empty state, run once to compile every program it uses,
  then timed. ``tokens_per_s`` is every generated token over the window's wall time (prefill and the driver
  included). ``roofline_tokens_per_s`` is the same tokens over the HBM floor of the window's decode steps:
  each step reads the weights once (bf16; an untied embedding's table is a gather, not counted) and every
  live sequence's KV so far (the token at index i >= 1 of a response is decoded reading 32 + i positions),
  that many bytes over ``copy_bandwidth_gb_s``. ``fraction_of_roofline`` = tokens_per_s / roofline.
- ``prefill``: one engine ``prefill`` call of 16 prompts x 1024 tokens (median of 5): ``prefill_tokens_per_s``
  and ``prefill_mfu`` (2 x matmul params x tokens + causal attention FLOPs over ``matmul_tflops``).
- ``train``: ``nereus_jax.runtime.step.losses.make_train_step`` with the PPO ``actor_loss`` (AdamW, float32 master
  weights, bf16 compute, donated state), 64 rows of 64 prompt + 448 response tokens split into micro-batches of
  ``micro_batch_tokens`` 8192 (``accumulation_steps``: 4 of 16 rows), median of 3 steps after a compiling
  one. ``train_mfu``: model FLOPs (6 x matmul params x tokens + 3 x the causal attention forward, 2 x 2 x
  layers x heads x head_dim x seq^2 / 2 per sequence) per second over ``matmul_tflops``.
- ``host``: device <-> pinned_host through the transition executor: the ``infer`` state of a 4-layer
  ``llama3.2-1b``-shaped model (float32, ~2 GiB) parked and brought back with the graphs
  ``TransitionGraph.build`` makes between plans that differ only in ``memory`` (device vs pinned_host), as
  ``StageState._move`` does, run by ``TransitionExecutor``; against a raw ``jax.device_put`` of the same leaves to
  the same shardings. ``host_bandwidth``: ``executor_gb_s`` and ``device_put_gb_s`` (both directions' bytes
  over both directions' time, the best of 3 alternating rounds), ``ratio`` (executor / device_put), and each
  direction. Null with a reason where the device has no pinned_host memory.

``--smoke``: the same code on tiny shapes (the ``tiny`` model, a few decode steps at 4 and 8 slots, small
matmul and copy): checks that every section runs and the JSON is complete, on CPU in well under a minute; its
figures mean nothing. A figure that could not be measured is null, with its reason in ``reasons``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_engine  # noqa: E402  (tools/bench_engine.py: the long-tail workload and its window)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nereus_jax.config import AlgorithmConfig, ModelConfig, resolve_model  # noqa: E402
from nereus_jax.engine import Generator, JaxEngine, make_requests  # noqa: E402
from nereus_jax.models import count_params, init_params  # noqa: E402

SECTIONS = ("decode", "prefill", "train", "host")
ORDER = ("host", "prefill", "train", "decode")  # decode last: it alone can stop early (per batch) when time is short
BUDGET_S = {"decode": 270.0, "prefill": 45.0, "train": 120.0, "host": 45.0}  # ~8 minutes with the ceilings


@dataclasses.dataclass(frozen=True)
class Shapes:
    model: str
    decode_batches: tuple[int, ...]
    decode_steps: int
    decode_prefill_batch: int  # prompts per engine prefill call (the same at every batch: programs in common)
    longest: int  # response lengths are capped here (the engine holds 32 + longest positions per slot)
    prefill_rows: int
    prefill_len: int
    train_rows: int
    train_prompt: int
    train_response: int
    micro_batch_tokens: int
    matmul_n: int
    copy_bytes: int
    host_layers: int | None  # the host section's model has this many layers (None: the model's own)
    repeats: int


REAL = Shapes(model="llama3.2-1b", decode_batches=(64, 256), decode_steps=256, decode_prefill_batch=32,
              longest=bench_engine.LONGEST, prefill_rows=16, prefill_len=1024, train_rows=64, train_prompt=64,
              train_response=448, micro_batch_tokens=8192, matmul_n=8192, copy_bytes=2**30, host_layers=4,
              repeats=20)
SMOKE = Shapes(model="tiny", decode_batches=(4, 8), decode_steps=4, decode_prefill_batch=4, longest=48,
               prefill_rows=4, prefill_len=32, train_rows=8, train_prompt=16, train_response=48,
               micro_batch_tokens=256, matmul_n=256, copy_bytes=2**22, host_layers=None, repeats=3)


# ------------------------------------------------------------------------------------------------ helpers
def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_s(fn, *args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` after one warm-up call (``bench_engine.timed``)."""
    return bench_engine.timed(fn, *args, repeats=repeats)


def matmul_params(cfg: ModelConfig, raw: dict) -> int:
    """Parameters that take part in a matmul: all of them but an untied embedding table (a gather)."""
    return count_params(raw) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size)


def causal_attention_flops(cfg: ModelConfig, seq: int) -> float:
    """Forward FLOPs of one sequence's attention (QK^T and AV), causal: half of 2 x 2 x L x H x E x seq^2."""
    return 2.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq * seq


# ------------------------------------------------------------------------------------------------ ceilings
def ceilings(shapes: Shapes, dtype) -> dict:
    n = shapes.matmul_n
    ka, kb, kc = jax.random.split(jax.random.key(0), 3)
    a, b = (jax.random.normal(k, (n, n), dtype) for k in (ka, kb))
    matmul_s = median_s(jax.jit(jnp.matmul), a, b, repeats=shapes.repeats)
    elems = shapes.copy_bytes // jnp.dtype(jnp.bfloat16).itemsize
    x = jax.random.normal(kc, (elems,), jnp.bfloat16)
    copy_s = median_s(jax.jit(lambda v: v + jnp.asarray(1, v.dtype)), x, repeats=shapes.repeats)
    return {"matmul_tflops": 2.0 * n**3 / matmul_s / 1e12,
            "copy_bandwidth_gb_s": 2.0 * shapes.copy_bytes / copy_s / 1e9,
            "ceilings": {"matmul": f"{n}x{n}x{n} {jnp.dtype(dtype).name}, median of {shapes.repeats}",
                         "matmul_ms": 1e3 * matmul_s,
                         "copy": f"x + 1 over {shapes.copy_bytes} bytes of bfloat16 (read + written), "
                                 f"median of {shapes.repeats}", "copy_ms": 1e3 * copy_s}}


# ------------------------------------------------------------------------------------------------ decode
def decode(cfg: ModelConfig, raw: dict, shapes: Shapes, copy_gb_s: float, deadline: float, reasons: dict,
           out: list, save) -> dict:
    """``{"decode": out}``, one entry per batch appended to ``out`` (and ``save()`` called) as each finishes. A
    batch is skipped (nulls, and a reason) when it would likely end past ``deadline``: a later batch is taken to
    cost 1.5x the one before it."""
    last = 0.0
    for batch in shapes.decode_batches:
        if time.perf_counter() + 1.5 * last > deadline:
            reasons[f"decode_batch_{batch}"] = ("skipped: the decode section's time budget would be spent "
                                                f"(the batch before took {last:.0f} s)")
            out.append({"batch": batch, "tokens_per_s": None, "roofline_tokens_per_s": None,
                        "fraction_of_roofline": None})
            continue
        t = time.perf_counter()
        try:
            out.append(decode_batch(cfg, raw, shapes, batch, copy_gb_s))
        except Exception as e:  # e.g. out of memory at the larger batch: keep the other batch's figures
            log(traceback.format_exc())
            reasons[f"decode_batch_{batch}"] = f"failed: {type(e).__name__}: {str(e)[:500]}"
            out.append({"batch": batch, "tokens_per_s": None, "roofline_tokens_per_s": None,
                        "fraction_of_roofline": None})
            gc.collect()
            save()
            continue
        gc.collect()  # the engine's KV pool goes before the next one is made
        last = time.perf_counter() - t
        log(f"decode batch {batch}: {out[-1]['tokens_per_s']:.0f} tokens/s, roofline "
            f"{out[-1]['roofline_tokens_per_s']:.0f} ({last:.0f} s with compiles)")
        save()
    return {"decode": out}


def decode_batch(cfg: ModelConfig, raw: dict, shapes: Shapes, batch: int, copy_gb_s: float) -> dict:
    """The long-tail window at ``batch`` slots against its HBM roofline."""
    t0, prompt = time.perf_counter(), bench_engine.PROMPT_LEN
    # more than the window can admit (a slot ends at most one sequence per 15 steps: lengths are >= 16, the first
    # token comes from the prefill), so the queue never runs dry
    requests = batch * (2 + -(-shapes.decode_steps // 15))
    prompts, lengths = bench_engine.longtail_workload(requests)
    prompts, lengths = prompts % cfg.vocab_size, np.minimum(lengths, shapes.longest)
    engine = JaxEngine(cfg, max_concurrent_decodes=batch, max_prefill_length=prompt,
                       max_target_length=prompt + shapes.longest,
                       max_prefill_batch=min(shapes.decode_prefill_batch, batch), page_size=16)
    gen = Generator(engine, engine.load_params(raw))

    def kv_positions_read(g: Generator) -> dict:  # each response token at index i >= 1 was decoded reading prompt + i
        n = g._run.lengths.astype(np.int64)  # the driver's per-row token counts (private; only read here)
        n = n[n > 1] - 1
        return {"kv_positions_read": int(np.sum(n * prompt + n * (n + 1) // 2))}

    def window() -> dict:
        return bench_engine.longtail_window(gen, prompts, lengths, shapes.decode_steps, observe=kv_positions_read,
                                            longest=shapes.longest)

    warm = window()  # compiles every program the (deterministic) window uses
    compiled = dict(engine.traces)
    run = window()
    gen._run = None  # the finished run refers back to the generator: break the cycle so the KV pool goes with it
    weight_bytes = matmul_params(cfg, raw) * engine.dtype.itemsize
    kv_bytes_per_position = engine.kv_page_bytes // engine.page_size
    floor_bytes = run["decode_steps"] * weight_bytes + run["kv_positions_read"] * kv_bytes_per_position
    roofline = run["tokens"] / (floor_bytes / (copy_gb_s * 1e9))
    return {"batch": batch, "tokens_per_s": run["tokens_per_s"], "roofline_tokens_per_s": roofline,
            "fraction_of_roofline": run["tokens_per_s"] / roofline,
            "tokens": run["tokens"], "seconds": run["seconds"], "decode_steps": run["decode_steps"],
            "step_ms": 1e3 * run["seconds"] / run["decode_steps"],
            "roofline_step_ms": 1e3 * floor_bytes / (copy_gb_s * 1e9) / run["decode_steps"],
            "concurrent_sequences": run["concurrent_sequences"], "preemptions": run["preemptions"],
            "weight_bytes_per_step": weight_bytes, "kv_bytes_read": run["kv_positions_read"] * kv_bytes_per_position,
            "kv_cache_bytes": engine.kv_cache_bytes, "requests": requests, "warmup_seconds": warm["seconds"],
            "recompiled_in_timed_window": dict(engine.traces) != compiled,
            "seconds_with_compile": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------------ prefill
def prefill(cfg: ModelConfig, raw: dict, shapes: Shapes, matmul_flops: float) -> dict:
    rows, length = shapes.prefill_rows, shapes.prefill_len
    engine = JaxEngine(cfg, max_concurrent_decodes=rows, max_prefill_length=length, max_target_length=length + 16,
                       max_prefill_batch=rows)
    params = engine.load_params(raw)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, length)).astype(np.int32)
    reqs = make_requests(rows, engine.max_stop_tokens, temperature=1.0, limit=16)
    call = lambda: engine.prefill(params=params, padded_tokens=tokens, true_length=length, requests=reqs)  # noqa: E731
    seconds = median_s(call, repeats=max(3, min(5, shapes.repeats)))
    flops = rows * (2.0 * matmul_params(cfg, raw) * length + causal_attention_flops(cfg, length))
    return {"prefill_tokens_per_s": rows * length / seconds, "prefill_mfu": flops / seconds / matmul_flops,
            "prefill": {"rows": rows, "prompt_tokens": length, "call_ms": 1e3 * seconds,
                        "tflops": flops / seconds / 1e12}}


# ------------------------------------------------------------------------------------------------ train
def train(cfg: ModelConfig, raw: dict, shapes: Shapes, matmul_flops: float) -> dict:
    from jax.sharding import NamedSharding, PartitionSpec

    from nereus_jax.elastic.topology import accumulation_steps
    from nereus_jax.runtime.step import losses
    from nereus_jax.sharding import Layout, make_mesh, shard_params

    rows, P, R = shapes.train_rows, shapes.train_prompt, shapes.train_response
    seq = P + R
    mesh = make_mesh(jax.devices()[:1], Layout(), dp=1)
    accum = accumulation_steps(rows, 1, seq, shapes.micro_batch_tokens)
    rng = np.random.default_rng(0)
    host = {"tokens": rng.integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32),
            "mask": np.ones((rows, seq), np.int32), "response_mask": np.ones((rows, R), np.float32),
            "old_logp": rng.uniform(-4.0, -0.5, (rows, R)).astype(np.float32),
            "advantages": rng.standard_normal((rows, R)).astype(np.float32), "denom": np.float32(rows * R)}
    micro = losses.put_micro(losses.split_micro(host, accum), mesh)
    optimizer = losses.make_optimizer(1e-6)
    # a copy: the step donates its state, and shard_params may hand back raw's own buffers
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), shard_params(raw, cfg, Layout(), mesh, kind="train"))
    whole = NamedSharding(mesh, PartitionSpec())
    opt_state = jax.jit(optimizer.init, out_shardings=whole)(params)
    # the step hands its state back in the shardings it came in: the second call reuses the first's program
    out_shardings = (jax.tree.map(lambda x: x.sharding, params), whole, whole)
    step = jax.jit(losses.make_train_step(losses.actor_loss(cfg, AlgorithmConfig(), P), optimizer, cfg),
                   donate_argnums=(0, 1), out_shardings=out_shardings)
    state = [params, opt_state]
    del params, opt_state

    def run():
        state[0], state[1], metrics = step(state[0], state[1], micro)
        return metrics

    metrics = jax.device_get(jax.block_until_ready(run()))  # compiles
    times = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t)
    seconds = float(np.median(times))
    tokens = rows * seq
    flops = 6.0 * matmul_params(cfg, raw) * tokens + 3.0 * rows * causal_attention_flops(cfg, seq)
    state.clear()
    programs = step._cache_size() if hasattr(step, "_cache_size") else None
    return {"train_mfu": flops / seconds / matmul_flops,
            "train": {"micro_batch_tokens": shapes.micro_batch_tokens, "accumulation_steps": accum, "rows": rows,
                      "prompt_tokens": P, "response_tokens": R, "tokens_per_step": tokens, "step_s": seconds,
                      "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12,
                      "loss": float(metrics["loss"]), "nonfinite": float(metrics["nonfinite"]),
                      "objective": "actor_loss (PPO, AlgorithmConfig defaults), AdamW",
                      "compiled_programs": programs}}


# ------------------------------------------------------------------------------------------------ host
def host(cfg: ModelConfig, shapes: Shapes) -> tuple[dict | None, str | None]:
    from nereus_jax.elastic.emu import EMU
    from nereus_jax.elastic.executor import TransitionExecutor
    from nereus_jax.elastic.graph import TransitionGraph
    from nereus_jax.elastic.plan import DEVICE, HOST, ExecutionPlan, StagePlan
    from nereus_jax.elastic.spec import StateSpec
    from nereus_jax.model_stage import ModelStage
    from nereus_jax.sharding import Layout, make_mesh

    dev = jax.devices()[0]
    kinds = [m.kind for m in dev.addressable_memories()]
    if HOST not in kinds:
        return None, f"{dev.platform} device {dev.device_kind!r} has no {HOST} memory (memories: {kinds})"
    if shapes.host_layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=shapes.host_layers)
    ms = ModelStage("actor", "infer")
    spec = StateSpec(cfg, "infer")
    layout, mesh = Layout(), make_mesh([dev], Layout())
    plans = {m: ExecutionPlan({ms: StagePlan.contiguous(layout, 1, memory=m)}) for m in (DEVICE, HOST)}
    graphs = {(a, b): TransitionGraph.build(plans[a], plans[b], {ms: spec})
              for a, b in ((DEVICE, HOST), (HOST, DEVICE))}
    shardings = {m: spec.shardings(mesh, m) for m in (DEVICE, HOST)}
    rng = np.random.default_rng(3)  # random bytes (never zeros), made on the host: no program to compile
    arrays = [rng.standard_normal(s.shape, np.float32).astype(s.dtype, copy=False) for s in spec.abstract(layout)]
    units = {ms: [EMU(ms, layout, (dev,), jax.device_put(arrays, shardings[DEVICE]), spec)]}
    plain = jax.device_put(arrays, shardings[DEVICE])  # the same bytes, for the raw device_put
    del arrays
    nbytes = sum(x.nbytes for x in plain)
    jax.block_until_ready([units[ms][0].leaves, plain])
    times = {(who, d): [] for who in ("executor", "device_put") for d in ("offload", "onload")}
    for r in range(1 + 3):  # the first round warms up (pinned allocations, any compiles) and is not counted
        for d, (src, dst) in (("offload", (DEVICE, HOST)), ("onload", (HOST, DEVICE))):
            seconds, units = _timed(TransitionExecutor().run, graphs[src, dst], units)
            assert units[ms][0].memory == dst
            if r:
                times["executor", d].append(seconds)
            seconds, plain = _timed(jax.device_put, plain, shardings[dst])
            if r:
                times["device_put", d].append(seconds)
    exact = all(bool(jnp.array_equal(a, b)) for a, b in zip(units[ms][0].leaves, plain, strict=True))
    rate = {who: 2 * nbytes / min(a + b for a, b in zip(times[who, "offload"], times[who, "onload"], strict=True)) / 1e9
            for who in ("executor", "device_put")}
    return {"executor_gb_s": rate["executor"], "device_put_gb_s": rate["device_put"],
            "ratio": rate["executor"] / rate["device_put"], "bytes": nbytes, "round_trips_exact": exact,
            **{f"{who}_{d}_gb_s": nbytes / min(ts) / 1e9 for (who, d), ts in times.items()},
            "method": "best of 3 rounds (offload + onload), after a warm-up round",
            "state": f"{cfg.name} infer state, {cfg.num_layers} layers, {spec.n_params} leaves, "
                     f"{jnp.dtype(spec.dtype).name}"}, None


def _timed(fn, *args):
    """(seconds, result) of ``fn(*args)``, waiting for every array in the result (EMUs' leaves included)."""
    t = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready([u.leaves for us in out.values() for u in us] if isinstance(out, dict) else out)
    return time.perf_counter() - t, out


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: a CPU smoke run of every section")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--budget", default="", help="per-section seconds, e.g. decode=300,train=90 (defaults: "
                        + ", ".join(f"{k}={v:.0f}" for k, v in BUDGET_S.items()) + ")")
    parser.add_argument("--max-seconds", type=float, default=480.0,
                        help="no section starts after this many seconds; decode stops between batches by then")
    parser.add_argument("--decode-steps", type=int, help="decode steps per timed window (default 256; smoke 4)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="change one of the shapes, e.g. --set model=qwen3-0.6b --set decode_batches=32,64,128 "
                             f"(fields: {', '.join(f.name for f in dataclasses.fields(Shapes))})")
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join("runs", "gpu_check"),
                        help="folder of gpu_check.json (default $OUT, else runs/gpu_check)")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    if not set(sections) <= set(SECTIONS):
        parser.error(f"--sections takes {', '.join(SECTIONS)}; got {args.sections}")
    budget = dict(BUDGET_S)
    for item in filter(None, args.budget.split(",")):
        name, _, seconds = item.partition("=")
        if name not in budget:
            parser.error(f"--budget: unknown section {name!r}")
        budget[name] = float(seconds)
    shapes = SMOKE if args.smoke else REAL
    if args.decode_steps:
        shapes = dataclasses.replace(shapes, decode_steps=args.decode_steps)
    for item in args.set:
        field, _, value = item.partition("=")
        if field not in {f.name for f in dataclasses.fields(Shapes)}:
            parser.error(f"--set: unknown field {field!r}")
        old = getattr(shapes, field)
        new = (tuple(int(v) for v in value.split(",")) if isinstance(old, tuple) else value if isinstance(old, str)
               else None if value.lower() in ("none", "null") else int(value))
        shapes = dataclasses.replace(shapes, **{field: new})
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.json")

    start = time.perf_counter()
    dev = jax.devices()[0]
    cfg = resolve_model(shapes.model)
    reasons: dict[str, str] = {}
    result: dict = {"device": str(dev.device_kind), "platform": dev.platform, "device_count": jax.device_count(),
                    "jax_version": jax.__version__, "smoke": args.smoke, "sections": sections, "complete": False,
                    "model": {"name": cfg.name, "compute_dtype": cfg.compute_dtype, "param_dtype": cfg.param_dtype},
                    "shapes": dataclasses.asdict(shapes),
                    "decode": [], "prefill_tokens_per_s": None, "train_mfu": None, "matmul_tflops": None,
                    "copy_bandwidth_gb_s": None, "host_bandwidth": None, "reasons": reasons, "seconds": {}}
    stats = getattr(dev, "memory_stats", lambda: None)()
    if stats and "bytes_limit" in stats:
        result["device_memory_bytes"] = int(stats["bytes_limit"])
    for key in ("prefill_tokens_per_s", "train_mfu", "host_bandwidth"):
        if key.split("_")[0] not in sections:
            reasons[key] = "section not selected (--sections)"
    if "decode" not in sections:
        reasons["decode"] = "section not selected (--sections)"

    def save() -> None:
        result["seconds"]["total"] = time.perf_counter() - start
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, path)

    def section(name: str, fn, *fn_args) -> None:
        """Runs ``fn(*fn_args)`` and puts the dict it returns into the result; a failure becomes a reason."""
        t = time.perf_counter()
        log(f"{name} ...")
        try:
            result.update(fn(*fn_args))
        except Exception as e:  # one section's failure must not lose the others' figures
            reasons[name] = f"failed: {type(e).__name__}: {str(e)[:500]}"
            log(traceback.format_exc())
        result["seconds"][name] = time.perf_counter() - t
        log(f"{name} done in {result['seconds'][name]:.1f} s")
        gc.collect()
        save()

    def do_host() -> dict:
        figures, reason = host(cfg, shapes)
        if reason:
            reasons["host_bandwidth"] = reason
        return {"host_bandwidth": figures}

    section("ceilings", ceilings, shapes, jnp.dtype(cfg.compute_dtype))
    raw = None
    for name in [name for name in ORDER if name in sections]:
        left = args.max_seconds - (time.perf_counter() - start)
        if left <= 0:
            reasons[name] = f"skipped: the run had spent --max-seconds ({args.max_seconds:.0f} s)"
        elif name == "host":
            section(name, do_host)
        elif result["matmul_tflops"] is None:
            reasons[name] = "skipped: no ceilings measured (see reasons['ceilings'])"
        else:
            raw = init_params(cfg, seed=0) if raw is None else raw
            flops = result["matmul_tflops"] * 1e12
            if name == "decode":
                deadline = time.perf_counter() + min(budget[name], left)
                section(name, decode, cfg, raw, shapes, result["copy_bandwidth_gb_s"], deadline, reasons,
                        result["decode"], save)
            else:
                section(name, prefill if name == "prefill" else train, cfg, raw, shapes, flops)
            if result["seconds"][name] > budget[name]:
                log(f"{name} took {result['seconds'][name]:.0f} s, over its budget of {budget[name]:.0f} s")
    raw = None
    if "prefill" in sections and result["prefill_tokens_per_s"] is None:
        reasons.setdefault("prefill_tokens_per_s", reasons.get("prefill", "not measured"))
    if "train" in sections and result["train_mfu"] is None:
        reasons.setdefault("train_mfu", reasons.get("train", "not measured"))
    if "host" in sections and result["host_bandwidth"] is None:
        reasons.setdefault("host_bandwidth", reasons.get("host", "not measured"))
    result["complete"] = True
    save()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
