"""Benchmark one re-plan on 8 CPU devices: our transition executor against one naive ``jax.device_put``
of everything, against checkpoint/restart with Orbax (save, then a NEW process that starts JAX and
restores into the new layout), and against the floor: a fresh numpy copy of the moved bytes.

The re-plan moves about 1 GiB of params + optimizer state: actor-train (params + Adam) changes TP,
tp2 x 4 replicas -> tp4 x 2 (in place), and ref-infer (params) changes DP, 2 -> 4 replicas. The new plan's
ranks are ordered by ``align_ranks`` (same device sets; each new replica takes the old ones strided, so
its Merge is a local slice); the planner's own order is timed too (``executor_planner_rank_order_s``).
It also times building + scheduling the graph of a simulated 1,024-GPU plan change (six model-stages,
8B models, metadata only).

    python tools/bench_transition.py                 # full size; the last line is one JSON object
    python tools/bench_transition.py --layers 1      # quick (about 1/6 of the bytes)
    python tools/bench_transition.py --gpu           # on a GPU: pinned_host offload/onload bandwidth too
    python tools/bench_transition.py --layers 1 --kv-heads 2 --skip-checkpoint            # tp4 stores kv heads twice
    python tools/bench_transition.py --layers 1 --kv-heads 2 --reverse --skip-checkpoint  # ... and drops the copies

With ``--kv-heads 2`` the move also changes how many times the kv heads are stored (the relayouts then
re-repeat them; one naive device_put cannot, so that figure is null).

On CPU every device is host RAM. XLA's CPU allocator takes 4 KiB page faults that numpy's
hugepage-advised copy does not, so the script re-executes itself with glibc's transparent-hugepage
tunable (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) unless --no-hugetlb; the JSON says which ran.
Timings are the minimum of --repeats runs (all runs are printed); others sharing the machine add noise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HUGETLB = "glibc.malloc.hugetlb=1"


def _setup_process(args) -> None:
    """Environment that must exist before JAX (and glibc's allocator) start."""
    if args.gpu:
        return
    if not args.no_hugetlb and HUGETLB not in os.environ.get("GLIBC_TUNABLES", ""):
        env = dict(os.environ, GLIBC_TUNABLES=":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), HUGETLB])))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=6, help="decoder layers (6: ~1 GiB moved)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (each method's minimum is reported)")
    p.add_argument("--no-hugetlb", action="store_true", help="keep glibc's default 4 KiB pages")
    p.add_argument("--skip-checkpoint", action="store_true", help="skip Orbax checkpoint/restart")
    p.add_argument("--gpu", action="store_true", help="on a GPU: offload/onload bandwidth to pinned_host")
    p.add_argument("--kv-heads", type=int, default=8,
                   help="kv heads of the 8-head model (2: tp4 stores each twice, so the move changes the repeat)")
    p.add_argument("--reverse", action="store_true", help="run the re-plan backwards (new plan -> old plan)")
    p.add_argument("--restore", help=argparse.SUPPRESS)  # internal: the restarted process
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = _args(argv)
    _setup_process(args)
    if args.restore:
        return _restore_child(args)
    if args.gpu:
        return _gpu_offload(args)
    return _bench(args)


# ------------------------------------------------------------------------------------------- the scenario
def _scenario(layers: int, kv_heads: int = 8, reverse: bool = False):
    import optax

    from nereus_jax.config import ModelConfig
    from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
    from nereus_jax.elastic.recipe import align_ranks
    from nereus_jax.elastic.spec import StateSpec
    from nereus_jax.model_stage import ModelStage
    from nereus_jax.sharding import Layout

    cfg = ModelConfig(name="bench", vocab_size=8192, hidden_size=512, num_layers=layers, num_heads=8,
                      num_kv_heads=kv_heads, intermediate_size=2048)
    actor, ref = ModelStage("actor", "train"), ModelStage("ref", "infer")
    specs = {actor: StateSpec(cfg, "train", optimizer=optax.adam(1e-5)), ref: StateSpec(cfg, "infer")}
    c = StagePlan.contiguous
    old = ExecutionPlan({actor: c(Layout(2), 4), ref: c(Layout(2), 2)})
    natural = ExecutionPlan({actor: c(Layout(4), 2), ref: c(Layout(2), 4)})
    if reverse:  # the aligned new plan is the start; its natural order (contiguous) is the target
        return cfg, specs, align_ranks(old, natural), old
    return cfg, specs, old, natural


def _host_states(cfg, specs):
    import jax
    import numpy as np

    from nereus_jax.models import init_params

    params = jax.tree.map(np.asarray, init_params(cfg, 0))
    out = {}
    for ms, spec in specs.items():
        state = {"params": params}
        if spec.optimizer is not None:
            opt = spec.optimizer.init(params)
            state["opt"] = jax.tree.map(lambda x: np.asarray(x) + np.asarray(0.25, x.dtype), opt)
        out[ms] = state
    return out


def _make_units(plan, specs, states, devices):
    import jax

    from nereus_jax.elastic.emu import EMU

    units = {ms: [EMU.create(ms, specs[ms], sp.layout, [devices[i] for i in r], states[ms]) for r in sp.replicas]
             for ms, sp in plan.items()}
    jax.block_until_ready([u.leaves for us in units.values() for u in us])
    return units


# ------------------------------------------------------------------------------------------- methods
def _time_executor(graph, units):
    import jax

    from nereus_jax.elastic.executor import TransitionExecutor

    executor = TransitionExecutor()
    t0 = time.perf_counter()
    out = executor.run(graph, units)
    jax.block_until_ready([u.leaves for us in out.values() for u in us])
    return time.perf_counter() - t0, executor.peak_extra_bytes, out


def _executor_runs(graph, old, specs, states, devices, repeats):
    import gc

    times, peaks = [], []
    for _ in range(repeats):
        units = _make_units(old, specs, states, devices)
        t, peak, out = _time_executor(graph, units)
        times.append(t)
        peaks.append(peak)
        del units, out
        gc.collect()
    return times, peaks


def _time_naive(plan_new, specs, units, devices):
    """One device_put of every new replica from the first old replica of its model-stage."""
    import jax

    from nereus_jax.elastic.measured import measure
    from nereus_jax.sharding import make_mesh

    before = measure(x for us in units.values() for u in us for x in u.leaves)
    t0 = time.perf_counter()
    out = {}
    for ms, sp in plan_new.items():
        src = units[ms][0].leaves
        out[ms] = [jax.device_put(src, specs[ms].shardings(make_mesh([devices[i] for i in r], sp.layout)))
                   for r in sp.replicas]
    jax.block_until_ready(out)
    elapsed = time.perf_counter() - t0
    peak = measure([x for us in units.values() for u in us for x in u.leaves]
                   + [x for rs in out.values() for r in rs for x in r])
    after = measure(x for rs in out.values() for r in rs for x in r)
    extra = sum(peak.values()) - max(sum(before.values()), sum(after.values()))
    return elapsed, extra


def _memcpy_floor(nbytes: int) -> float:
    """A fresh numpy copy of ``nbytes`` (the best of two, after touching the source)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        dst = np.empty_like(src)
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
        del dst
    return best


def _checkpoint_restart(args, specs, states, units, workdir: Path) -> tuple[float, float]:
    """Save one replica per model-stage with Orbax, then a new process restores into the new layout."""
    import jax
    import orbax.checkpoint as ocp

    path = workdir / "ckpt"
    t0 = time.perf_counter()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, {str(ms): us[0].state for ms, us in units.items()})
    ckptr.wait_until_finished()
    save_s = time.perf_counter() - t0
    del ckptr
    units.clear()  # the old job is gone before the new one starts
    jax.block_until_ready(0)
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), "--restore", str(path), "--layers", str(args.layers),
           "--kv-heads", str(args.kv_heads)] + (["--reverse"] if args.reverse else [])
    if args.no_hugetlb:
        cmd.append("--no-hugetlb")
    run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
    restart_s = time.perf_counter() - t0
    if run.returncode:
        raise RuntimeError(f"restore process failed:\n{run.stderr[-3000:]}")
    return save_s, restart_s


def _restore_child(args) -> dict:
    """The restarted job: start JAX, restore every model-stage into the new plan's layout (all replicas
    at once, as arrays replicated over a (dp, pp, tp) mesh), and exit."""
    import jax
    import orbax.checkpoint as ocp

    from nereus_jax.elastic.recipe import align_ranks
    from nereus_jax.sharding import make_mesh

    cfg, specs, old, natural = _scenario(args.layers, args.kv_heads, args.reverse)
    new = align_ranks(old, natural)
    devices = jax.devices()
    target = {}
    for ms, sp in new.items():
        spec = specs[ms]
        mesh = make_mesh([devices[d] for d in sp.devices], sp.layout, dp=sp.dp)
        leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                  for a, s in zip(spec.abstract(sp.layout), spec.shardings(mesh), strict=True)]
        target[str(ms)] = spec.unflatten(leaves)
    restored = ocp.StandardCheckpointer().restore(args.restore, target)
    jax.block_until_ready(restored)
    print(json.dumps({"restored": sorted(restored)}))
    return {}


# ------------------------------------------------------------------------------------------- schedule time
def _schedule_ms_1024(repeats: int = 20) -> float:
    """Build + schedule a simulated 1,024-GPU change of six model-stages (8B models, metadata only)."""
    import optax

    from nereus_jax.config import ModelConfig
    from nereus_jax.elastic.graph import TransitionGraph, plan_usage
    from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
    from nereus_jax.elastic.spec import StateSpec
    from nereus_jax.model_stage import ModelStage
    from nereus_jax.sharding import Layout

    cfg = ModelConfig(name="llama-8b-shape", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, intermediate_size=14336)
    train = StateSpec(cfg, "train", optimizer=optax.adam(1e-5))
    value = StateSpec(cfg, "train", head="value", optimizer=optax.adam(1e-5))
    gen, infer = StateSpec(cfg, "gen", dtype="bfloat16"), StateSpec(cfg, "infer", dtype="bfloat16")
    critic_infer = StateSpec(cfg, "infer", head="value", dtype="bfloat16")
    names = [("actor", "gen", gen), ("actor", "train", train), ("critic", "infer", critic_infer),
             ("critic", "train", value), ("ref", "infer", infer), ("reward", "infer", critic_infer)]
    stages = {ModelStage(m, s): spec for m, s, spec in names}
    ms = list(stages)
    c, half = StagePlan.contiguous, 512
    old = ExecutionPlan({ms[0]: c(Layout(8), 64), ms[1]: c(Layout(8, 2), 32, first=half),
                         ms[2]: c(Layout(4), 128), ms[3]: c(Layout(8, 2), 32, first=half),
                         ms[4]: c(Layout(4), 128, first=half), ms[5]: c(Layout(4), 128, first=half)})
    new = ExecutionPlan({ms[0]: c(Layout(4), 256), ms[1]: c(Layout(8, 1), 64),
                         ms[2]: c(Layout(8), 64, first=half), ms[3]: c(Layout(8, 4), 16),
                         ms[4]: c(Layout(8), 64), ms[5]: c(Layout(2), 256, first=half)})
    cap = 141 * 10**9
    assert max(max(plan_usage(old, stages).values()), max(plan_usage(new, stages).values())) <= cap
    times, graph = [], None
    for _ in range(repeats):
        graph = None  # freeing the previous graph is not part of building the next
        t0 = time.perf_counter()
        graph = TransitionGraph.build(old, new, stages, caps=cap)
        times.append(time.perf_counter() - t0)
    print(f"1,024-GPU graph: {len(graph.units)} units, {len(graph.steps)} steps; build+schedule "
          f"min {min(times) * 1e3:.2f} ms, median {sorted(times)[len(times) // 2] * 1e3:.2f} ms", file=sys.stderr)
    return min(times) * 1e3


# ------------------------------------------------------------------------------------------- main bench
def _bench(args) -> dict:
    import gc

    import jax

    from nereus_jax.elastic.graph import TransitionGraph
    from nereus_jax.elastic.recipe import align_ranks
    from nereus_jax.elastic.spec import transition_bytes

    devices = jax.devices()
    cfg, specs, old, natural = _scenario(args.layers, args.kv_heads, args.reverse)
    new = align_ranks(old, natural)  # the same device sets; ranks ordered so the merges are local slices
    states = _host_states(cfg, specs)
    moved = transition_bytes(old, new, specs, devices)
    graph = TransitionGraph.build(old, new, specs)
    log = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    log(f"old plan\n{old}\nnew plan (planner order {[r for sp in natural.values() for r in sp.replicas]}, "
        f"ranks aligned)\n{new}\n{graph}")
    log(f"moved {moved['moved_bytes'] / 2**30:.3f} GiB (cross-device {moved['cross_device_bytes'] / 2**30:.3f} GiB)")

    cold_s, _, out = _time_executor(graph, _make_units(old, specs, states, devices))  # compiles the relayouts
    _check_exact(out, specs, states)
    del out
    natural_graph = TransitionGraph.build(old, natural, specs)
    _time_executor(natural_graph, _make_units(old, specs, states, devices))  # compiles
    log(f"after the cold runs: {_rss_gib()}")
    # Rounds interleave the methods, so a burst of load from elsewhere on the machine hits them alike.
    ex_times, peaks, natural_times, naive, floor = [], [], [], [], []
    # One device_put cannot change how many times the kv heads are stored: no naive figure then.
    same_repeat = all(specs[ms].repeat(old[ms].layout) == specs[ms].repeat(sp.layout) for ms, sp in new.items())
    for _ in range(args.repeats):
        t, peak, out = _time_executor(graph, _make_units(old, specs, states, devices))
        del out
        ex_times.append(t)
        peaks.append(peak)
        floor.append(_memcpy_floor(moved["moved_bytes"]))
        natural_times.append(_time_executor(natural_graph, _make_units(old, specs, states, devices))[0])
        if same_repeat:
            naive.append(_time_naive(new, specs, _make_units(old, specs, states, devices), devices))
        gc.collect()
    log(f"after the timed rounds: {_rss_gib()}")
    ckpt = (float("nan"), float("nan"))
    if not args.skip_checkpoint:
        with tempfile.TemporaryDirectory(prefix="bench_transition_") as tmp:
            ckpt = _checkpoint_restart(args, specs, states, _make_units(old, specs, states, devices), Path(tmp))
        log(f"after checkpoint/restart: {_rss_gib()}")
    log(f"executor s: cold {cold_s:.3f}, warm {[round(t, 4) for t in ex_times]}; planner rank order "
        f"{[round(t, 4) for t in natural_times]}")
    log(f"naive device_put s: {[round(t, 4) for t, _ in naive]}")
    log(f"memcpy floor s: {[round(t, 4) for t in floor]}")
    log(f"checkpoint: save {ckpt[0]:.3f} s + restart-and-restore {ckpt[1]:.3f} s")
    executor_s, floor_s = min(ex_times), min(floor)
    naive_s = min(t for t, _ in naive) if naive else None
    restart_s = None if args.skip_checkpoint else ckpt[0] + ckpt[1]
    result = {
        "moved_bytes": moved["moved_bytes"],
        "executor_s": round(executor_s, 4),
        "naive_device_put_s": naive_s and round(naive_s, 4),
        "checkpoint_restart_s": restart_s and round(restart_s, 3),
        "memcpy_floor_s": round(floor_s, 4),
        "speedup_vs_checkpoint_restart": restart_s and round(restart_s / executor_s, 2),
        "ratio_to_memcpy_floor": round(executor_s / floor_s, 3),
        "executor_peak_extra_bytes": max(peaks),
        "naive_peak_extra_bytes": max(p for _, p in naive) if naive else None,
        "largest_unit_bytes": graph.largest_unit_bytes,
        "schedule_ms_1024_gpus": round(_schedule_ms_1024(), 3),
        "cross_device_bytes": moved["cross_device_bytes"],
        "executor_cold_s": round(cold_s, 4),
        "executor_median_s": round(sorted(ex_times)[len(ex_times) // 2], 4),
        "executor_planner_rank_order_s": round(min(natural_times), 4),
        "checkpoint_save_s": None if args.skip_checkpoint else round(ckpt[0], 3),
        "hugetlb": HUGETLB in os.environ.get("GLIBC_TUNABLES", ""),
        "kv_heads": args.kv_heads,
        "reverse": args.reverse,
    }
    print(json.dumps(result))
    return result


def _rss_gib() -> str:
    """Resident and peak resident memory of this process, for the log."""
    import resource

    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return f"rss {rss / 2**30:.2f} GiB (peak {peak / 2**30:.2f} GiB)"


def _check_exact(out, specs, states) -> None:
    import numpy as np

    for ms, units in out.items():
        want = specs[ms].flatten(states[ms])
        for u in units:
            for a, b in zip(want, specs[ms].flatten(u.to_host()), strict=True):
                if not np.array_equal(a, b):
                    raise AssertionError(f"{u} is not bit-exact")


# ------------------------------------------------------------------------------------------- GPU only
def _gpu_offload(args) -> dict:
    """Offload / onload bandwidth to pinned_host and a device->host->device round trip of 1 GiB, against
    the device's own copy bandwidth."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    if dev.platform != "gpu":
        raise SystemExit(f"--gpu needs a GPU, found {dev.platform}")
    n = 2**30
    x = jax.device_put(jnp.ones(n // 4, jnp.float32), dev)
    host, device = SingleDeviceSharding(dev, memory_kind="pinned_host"), SingleDeviceSharding(dev)
    copy = jax.jit(lambda a: a + 0)

    def timed(fn, reps=5):
        fn().block_until_ready()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn().block_until_ready()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    h = jax.device_put(x, host)
    result = {"bytes": n,
              "offload_GBps": n / timed(lambda: jax.device_put(x, host)) / 1e9,
              "onload_GBps": n / timed(lambda: jax.device_put(h, device)) / 1e9,
              "roundtrip_s": timed(lambda: jax.device_put(jax.device_put(x, host), device)),
              "device_copy_GBps": 2 * n / timed(lambda: copy(x)) / 1e9,
              "device": str(dev.device_kind)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
