"""Asynchronous (one-step-off) RL against synchronous RL on the long-tail copy task; prints one JSON object
on its last line.

    .venv312/bin/python tools/bench_async.py                       # 3 + 3 interleaved runs of 40 steps (4-7 min)
    .venv312/bin/python tools/bench_async.py --steps 2 --runs 1    # a smoke run
    .venv312/bin/python tools/bench_async.py trainer.prompts_per_step=8   # config overrides after the flags
    .venv312/bin/python tools/bench_async.py --single-thread-devices      # each XLA:CPU program on one core
    .venv312/bin/python tools/bench_async.py --decode-steps-per-call 8    # 8 decode steps per engine dispatch

The job is ``configs/async_tiny.yaml`` (PPO, tiny actor, 8 CPU virtual devices, actor-gen on devices 0-3, the
training stages on 4-7), run with ``trainer.mode=sync`` and ``trainer.mode=async`` (max_staleness 1): same
prompts, samples and updates; pair i of runs uses ``rollout.seed=i`` in both modes (one seed repeated gives
bit-identical runs, so it says nothing about accuracy). Runs alternate (sync, async, sync, ...) so that load from other
processes hits both alike; each goes through ``run_job`` (warm start shared through one cache folder, so the
supervised phase runs once; no SFT control, no TensorBoard). A warm-up pair (``--warmup-steps``, not
counted) fills JAX's persistent compilation cache, so ``rl_seconds`` is mostly steps, not compiles.

Figures (medians over runs; seconds are wall seconds of the RL phase, ``rl_seconds``):

- ``sync_s``, ``async_s``, ``speedup`` = sync_s / async_s; ``accuracy_sync``, ``accuracy_async``: held-out
  greedy accuracy after RL (fractions), the mean over the paired seeds.
- ``speedup_median_step``: the same ratio for the median step (async: the interval between updates),
  which compile or load spikes disturb less.
- ``speedup_steady``, ``ideal_speedup_steady``: the same from step 5 on (summed step intervals), leaving out
  the first steps, which load every program from the compilation cache (seconds each; overlapped in async).
- ``ideal_speedup``: the overlap limit from the sync runs' own stage times, sum(gen + rest) /
  sum(max(gen, rest)) over steps (gen = actor-gen seconds, rest = every other stage); ``ideal_speedup_pipelined``
  pairs generation of step g+1 with the rest of step g, as one-step-off does. ``gain_fraction_of_ideal`` =
  (speedup - 1) / (ideal_speedup - 1).
- ``machine_overlap``: what this machine gives two threads now: a jitted matmul loop on device 0 and one on
  device 4, run one after the other vs concurrently (time ratio; 2.0 = two free cores, 1.0 = none), measured
  before every run, so it sees the same load as the runs. ``dispatch_overlap``: the same with 300 short calls
  per thread (about a decode step each), so Python, dispatch and the GIL take part as in the job.
- ``core_bound_speedup``: cpu_count / sync's ``cores_used``: the bound on async if the cores were the limit (both
  modes do the same CPU work; overlap can only fill the core time sync leaves idle), the machine's physical limit
  for this comparison.
- ``gil_bound_speedup``: sync_s / sync's ``python_s``: the bound on async if Python were the limit (the two
  threads' Python and dispatch seconds serialise on the GIL). ``python_s`` per mode (in ``profile``): the CPU
  seconds of the job's own threads (``time.thread_time``; XLA computes on threads of its own), and
  ``python_fraction`` = python_s / rl_seconds.
- ``xla_flags``: the XLA flags of this process, the same for both modes (``--single-thread-devices`` adds
  ``--xla_cpu_multi_thread_eigen=false`` before JAX starts: every program runs on one core, so each virtual
  device acts as one accelerator and programs on disjoint devices can only overlap across cores).
- ``decode_steps_per_call``: ``--decode-steps-per-call K`` (both modes, warm-up included): the engine runs K
  decode steps per dispatch (``rollout.decode_steps_per_call``; null: the config's value). Same tokens as K=1.
- ``profile``: where the time goes per mode: the generator's working seconds (sum of actor-gen) and waiting
  seconds (rl_seconds - working), the learner's working seconds (the other stages) and the rest (rl_seconds -
  working: waits, the controller, bookkeeping), ``rollout_wait_s`` (async: the learner's measured wait for a
  step's rollouts; sync: 0) and ``boundary_s`` (the controller's seconds at step boundaries), and
  the process's CPU seconds over the RL phase (``cores_used`` = CPU seconds / wall seconds).
- ``simulator_async``: SIMULATED, not measured: the simulator's async (one-step-off, actor-gen on its own
  devices) policies ``async_fixed`` / ``async_nereus`` and the async oracle against sync ``nereus`` on the first
  ``--sim-steps``
  steps of ``configs/sim/paper_drift.yaml`` on the a100 hardware table (``simulated: true``, ``hardware``);
  mean step latency per policy (async: the interval between weight syncs) and the reductions. Null with
  ``--sim-steps 0``.

Reading it: the speedup is bounded by ``ideal_speedup`` (the overlap the stage times allow) and by
``core_bound_speedup`` (the cores sync leaves idle); async's own costs (the two threads waiting for each
other's cores and for the GIL) come off those. Measured figures: docs/results.md, "Asynchronous RL".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

SINGLE_THREAD_FLAG = "--xla_cpu_multi_thread_eigen=false"  # each program on one core: a device = one accelerator
_SINGLE = [SINGLE_THREAD_FLAG] if "--single-thread-devices" in sys.argv[1:] else []  # before JAX starts
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
                                    *_SINGLE]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import nereus_jax.runtime.run as run_mod  # noqa: E402
from nereus_jax.config import Config, load_config  # noqa: E402

GEN = "actor-gen"
STARTUP_STEPS = 5  # the first steps load (or compile) programs per prompt-length bucket: excluded from *_steady
RL_CPU: dict[str, float] = {}  # CPU seconds of the latest RL phase: process, and the calling thread's own


def job_config(mode: str, steps: int, cache_dir: str, config: str, overrides: list[str]) -> Config:
    fixed = [f"trainer.mode={mode}", f"trainer.steps={steps}", "trainer.sft_control=false",
             "logging.progress=false", "logging.tensorboard=false", f"logging.cache_dir={cache_dir}"]
    return load_config(config, overrides + fixed)


def _time_rl_cpu() -> None:
    """Wraps run_job's RL loop so that the process CPU time of the RL phase lands in RL_CPU."""
    inner = run_mod.rl_steps

    def timed(*args, **kwargs):  # run_job's arguments, whatever they are
        job = args[0] if args else kwargs["job"]
        cpu, own, engines = time.process_time(), time.thread_time(), job.engine_thread_cpu_s
        yield from inner(*args, **kwargs)
        RL_CPU["seconds"], RL_CPU["thread"] = time.process_time() - cpu, time.thread_time() - own
        RL_CPU["engines"] = job.engine_thread_cpu_s - engines  # the engines' own threads (several replicas)

    run_mod.rl_steps = timed


def one_run(cfg: Config, run_dir: str) -> dict:
    """run_job, then this run's figures from its summary and metrics.jsonl."""
    summary = run_mod.run_job(cfg, run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    gen = [m["stage_seconds"].get(GEN, 0.0) for m in metrics]
    rest = [sum(v for k, v in m["stage_seconds"].items() if k != GEN) for m in metrics]
    rl_s = summary["rl_seconds"]
    intervals = [m["step_seconds"] for m in metrics]  # async: the wall interval between learner updates
    # Python + dispatch seconds (the threads' own CPU; XLA computes on threads of its own): sync runs both roles on
    # the calling thread; async adds the generator thread's, and both threads share one GIL
    python_s = RL_CPU["thread"] + RL_CPU["engines"] + sum(m.get("generator_thread_cpu_s", 0.0) for m in metrics)
    return {"mode": cfg.trainer.mode, "rl_seconds": rl_s, "accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"], "gen_s": gen, "rest_s": rest, "interval_s": intervals,
            "gen_work_s": sum(gen), "gen_wait_s": rl_s - sum(gen), "learner_work_s": sum(rest),
            "learner_wait_s": rl_s - sum(rest), "step_s_median": statistics.median(intervals),
            "rollout_wait_s": sum(m.get("rollout_wait_seconds", 0.0) for m in metrics),
            "boundary_s": sum(m.get("boundary_seconds", 0.0) for m in metrics),
            "cpu_s": RL_CPU["seconds"], "cores_used": RL_CPU["seconds"] / rl_s,
            "python_s": python_s, "python_fraction": python_s / rl_s,
            "response_length_mean": statistics.mean(m["response_length_mean"] for m in metrics),
            "staleness_max": max(m.get("rollout_staleness_max", 0) for m in metrics),
            "warm_start_cache_hit": summary["warm_start_cache_hit"], "transitions": summary["transitions"]}


def ideal_speedup(gen: list[float], rest: list[float]) -> float:
    """Perfect overlap of generation with the rest of the same step: sum(gen + rest) / sum(max(gen, rest))."""
    return sum(g + r for g, r in zip(gen, rest, strict=True)) / sum(max(g, r) for g, r in zip(gen, rest, strict=True))


def ideal_pipelined(gen: list[float], rest: list[float]) -> float:
    """One-step-off on free cores: gen[0], then gen[g+1] beside rest[g], then rest[-1]."""
    overlapped = gen[0] + sum(max(g, r) for g, r in zip(gen[1:], rest[:-1], strict=True)) + rest[-1]
    return (sum(gen) + sum(rest)) / overlapped


def machine_overlap(iters: int = 3000, calls: int = 1) -> float:
    """Serial / concurrent seconds of two threads, each running ``calls`` jitted small-matmul loops of ``iters``
    iterations on its device (0 and 4), reading each result back. One long call measures free cores; many short
    calls (``dispatch_overlap``: 300 calls of 10, about a decode step each) add what the job's threads do at every
    step: Python and dispatch under one GIL."""
    def loop(x, w):
        return jax.lax.fori_loop(0, iters, lambda _, y: jnp.tanh(y @ w) @ w.T, x)

    fn = jax.jit(loop)
    devices = jax.devices()
    args = [jax.device_put((jnp.ones((64, 64)) * 0.01, jnp.ones((64, 256)) * 0.01), devices[i]) for i in (0, 4)]

    def work(a):
        for _ in range(calls):
            fn(*a).block_until_ready()

    for a in args:
        fn(*a).block_until_ready()
    t = time.perf_counter()
    for a in args:
        work(a)
    serial = time.perf_counter() - t
    threads = [threading.Thread(target=work, args=(a,)) for a in args]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return serial / (time.perf_counter() - t)


def dispatch_overlap() -> float:
    return machine_overlap(iters=10, calls=300)


SIM_TRACE, SIM_POLICIES = "paper_drift", ("nereus", "async_fixed", "async_nereus")


def simulated(steps: int = 12) -> dict | None:
    """SIMULATED sync-vs-async step latency on a prefix of the paper-shaped drift trace (~10 s; the whole
    trace: ``python -m nereus_jax.simulate paper_drift --policies async_fixed,async_nereus,nereus``). None
    when ``steps`` is 0."""
    if steps <= 0:
        return None
    from nereus_jax.sim import Simulation, load_trace, report
    from nereus_jax.sim.asynchronous import async_oracle

    start = time.perf_counter()
    sim = Simulation(load_trace(SIM_TRACE, {"steps": steps}))
    runs = sim.run(SIM_POLICIES)
    runs["async_oracle"] = async_oracle(sim, list(runs.values()))  # best plan per interval, free transitions
    keys = ("mean_step_s", "transitions", "transition_s", "oom_events", "sync_fallback_steps")
    summaries = {n: r.summary() for n, r in runs.items()}
    comparison = report.async_comparison(summaries)
    comparison["async_oracle_reduction_vs_async_fixed"] = (
        1 - summaries["async_oracle"]["mean_step_s"] / summaries["async_fixed"]["mean_step_s"])
    return {"simulated": True, "hardware": sim.hw.name, "hardware_description": sim.hw.description,
            "trace": sim.trace.name, "steps": steps, "note": report.headline(sim),
            "policies": {n: {k: s[k] for k in keys if k in s} for n, s in summaries.items()},
            "comparison": comparison, "wall_s": round(time.perf_counter() - start, 1)}


def _median(runs: list[dict], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def profile(runs: list[dict]) -> dict:
    keys = ("rl_seconds", "step_s_median", "gen_work_s", "gen_wait_s", "learner_work_s", "learner_wait_s", "cpu_s",
            "cores_used", "python_s", "python_fraction", "rollout_wait_s", "boundary_s")
    return {k: round(_median(runs, k), 3) for k in keys if all(k in r for r in runs)}


def summarize(sync: list[dict], asyn: list[dict], overlap: list[float], args, dispatch: list[float] = ()) -> dict:
    sync_s, async_s = _median(sync, "rl_seconds"), _median(asyn, "rl_seconds")
    speedup = sync_s / async_s
    ideal = statistics.median(ideal_speedup(r["gen_s"], r["rest_s"]) for r in sync)
    skip = STARTUP_STEPS if args.steps > 2 * STARTUP_STEPS else 0
    steady = {m: statistics.median(sum(r["interval_s"][skip:]) for r in runs) for m, runs in (("s", sync), ("a", asyn))}
    ideal_steady = statistics.median(ideal_speedup(r["gen_s"][skip:], r["rest_s"][skip:]) for r in sync)
    piped = statistics.median(ideal_pipelined(r["gen_s"], r["rest_s"]) for r in sync)
    sim = simulated(getattr(args, "sim_steps", 0))  # a namespace without the flag skips the simulation
    acc_sync = statistics.mean(r["accuracy_after"] for r in sync)  # mean over the paired seeds
    acc_async = statistics.mean(r["accuracy_after"] for r in asyn)
    return {"sync_s": round(sync_s, 3), "async_s": round(async_s, 3), "speedup": round(speedup, 4),
            "accuracy_sync": acc_sync, "accuracy_async": acc_async,
            "accuracy_gap": round(abs(acc_sync - acc_async), 4), "accuracy_before": _median(sync, "accuracy_before"),
            "speedup_median_step": round(_median(sync, "step_s_median") / _median(asyn, "step_s_median"), 4),
            "steady_from_step": skip, "speedup_steady": round(steady["s"] / steady["a"], 4),
            "ideal_speedup": round(ideal, 4), "ideal_speedup_steady": round(ideal_steady, 4),
            "ideal_speedup_pipelined": round(piped, 4),
            "gain_fraction_of_ideal": round((speedup - 1) / max(ideal - 1, 1e-9), 4),
            "machine_overlap": round(statistics.median(overlap), 3),
            "machine_overlap_all": [round(x, 3) for x in overlap],
            **({"dispatch_overlap": round(statistics.median(dispatch), 3),
                "dispatch_overlap_all": [round(x, 3) for x in dispatch]} if dispatch else {}),
            # async overlaps compute, but the two threads' Python + dispatch seconds serialise on the GIL: with
            # sync's Python seconds unchanged, async takes at least that long
            "gil_bound_speedup": round(sync_s / _median(sync, "python_s"), 4),
            # the CPU seconds are the same work in both modes: overlap can at most fill the cores sync leaves idle
            "core_bound_speedup": round((os.cpu_count() or 1) / _median(sync, "cores_used"), 4),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "flags_note": "both modes ran in this one process under these XLA flags (set before JAX started)",
            "profile": {"sync": profile(sync), "async": profile(asyn)},
            "per_run": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                         if k not in ("gen_s", "rest_s", "interval_s")} for r in _interleave(sync, asyn)],
            "steps": args.steps, "runs": args.runs, "config": args.config, "overrides": args.overrides,
            "decode_steps_per_call": getattr(args, "decode_steps_per_call", None),
            "simulator_async": sim,
            **({} if sim else {"simulator_note": "skipped (--sim-steps 0)"}),
            "load_avg": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count(), "jax": jax.__version__}


def _interleave(a: list, b: list) -> list:
    return [x for pair in zip(a, b, strict=True) for x in pair]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="RL steps per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (interleaved; medians reported)")
    parser.add_argument("--warmup-steps", type=int, default=8, help="steps of the uncounted warm-up pair (0: none)")
    parser.add_argument("--config", default="async_tiny")
    parser.add_argument("--sim-steps", type=int, default=12,
                        help="steps of the simulated paper_drift async comparison (0: skip)")
    parser.add_argument("--out", default="runs/bench_async", help="run folders, warm-start and compilation caches")
    parser.add_argument("--single-thread-devices", action="store_true",
                        help=f"run XLA:CPU programs on one core each ({SINGLE_THREAD_FLAG}, both modes): every virtual "
                             "device then acts as one accelerator, and two devices' programs can use both cores")
    parser.add_argument("--decode-steps-per-call", type=int, default=None, metavar="K",
                        help="rollout.decode_steps_per_call=K for both modes (default: the config's)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = parser.parse_args(argv)
    if args.decode_steps_per_call is not None:
        args.overrides = [*args.overrides, f"rollout.decode_steps_per_call={args.decode_steps_per_call}"]
    _time_rl_cpu()
    cache = os.path.abspath(os.path.join(args.out, "cache"))
    jax.config.update("jax_compilation_cache_dir", os.path.join(cache, "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # Pair i runs both modes with rollout.seed=i: runs of one mode with one seed are bit-identical (the job is
    # deterministic), so repeating a seed says nothing about accuracy; paired seeds compare training paths.
    cfgs = {(m, i): job_config(m, args.steps, cache, args.config, args.overrides + [f"rollout.seed={i}"])
            for m in ("sync", "async") for i in range(args.runs)}
    if args.warmup_steps:
        for mode in ("sync", "async"):
            one_run(job_config(mode, args.warmup_steps, cache, args.config, args.overrides),
                    os.path.join(args.out, stamp, f"warmup-{mode}"))
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    overlap, dispatch = [], []
    for i in range(args.runs):
        for mode in ("sync", "async"):
            overlap.append(machine_overlap())
            dispatch.append(dispatch_overlap())
            results[mode].append(one_run(cfgs[mode, i], os.path.join(args.out, stamp, f"{i}-{mode}")))
            r = results[mode][-1]
            print(f"run {i} {mode}: rl_seconds={r['rl_seconds']:.2f} accuracy={r['accuracy_after']:.3f} "
                  f"cores_used={r['cores_used']:.2f} python_fraction={r['python_fraction']:.2f} "
                  f"machine_overlap={overlap[-1]:.2f} dispatch_overlap={dispatch[-1]:.2f}", file=sys.stderr)
    out = summarize(results["sync"], results["async"], overlap, args, dispatch)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
