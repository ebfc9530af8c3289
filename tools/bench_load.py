"""Benchmark the loading cost of starting a job from a Hugging Face checkpoint: a ``qwen2.5-1.5b``-shaped
random bf16 checkpoint (written by ``save_hf``, sharded) laid out on 8 CPU devices as actor-train
(tp=2 x dp=4, float32 master weights), actor-gen (tp=2 x dp=4) and ref-infer (tp=4 x dp=2, kv heads stored
twice) in the compute dtype (bfloat16), the way ``StageState.place`` does it: each device reads its own
shard with ``units_from_source`` (streaming). Against it, in the same run, the naive path:
``load_hf`` of the whole checkpoint to host numpy, then ``EMU.create`` per replica from that tree.

    python tools/bench_load.py                       # 4 of the preset's 28 layers (fits 24 GiB, baseline included)
    python tools/bench_load.py --num-layers 2        # quicker
    python tools/bench_load.py --smoke               # tiny shapes, a few seconds (tests/test_bench_load.py)
    python tools/bench_load.py --param-dtype bfloat16 --num-layers 6    # actor-train in bf16: more layers fit
    python tools/bench_load.py --optimizer --num-layers 1 --train 2x1   # actor-train with its Adam state (1 replica)
    python tools/bench_load.py --hugetlb             # the loads with glibc's hugepage tunable (fewer page faults)

Each load runs in a fresh subprocess (streaming first, then naive), so each has its own peak RSS (VmHWM
of /proc/self/status, reset when loading starts). On CPU the "devices" are host RAM, so the peak includes
the laid-out state itself: the figure that matters is the *transient* part, peak RSS - RSS before loading
- bytes of the live laid-out arrays (their shards, deduplicated per device and buffer), over the
checkpoint's size; the goal (<= 1.5x) applies to it. As the state grows during the load, that figure
hides a transient that passes early, so the JSON adds the largest extra memory of any one slice read
(exact, VmHWM reset per read) and an upper bound sampled every 10 ms against the arrays alive then
(``rss_note`` says which is which). The full 28-layer model does not fit this machine: float32
actor-train tp=2 x dp=4 alone holds 16 bytes per parameter (24.7 GB), so ``--num-layers`` cuts decoder
layers (each with the preset's shapes; the embedding stays whole, so small layer counts weigh it more)
and actor-train loads its parameters only unless ``--optimizer``. The script estimates both peaks first
and refuses a setting that would not fit the memory available now. The JSON lists every loaded leaf's
shape and dtype per stage.

Machine references measured in the same run: a sequential read of the checkpoint files (nothing is
dropped from the page cache; ``fincore`` says how much was cached before each read), a host memcpy (into
paged-in and into fresh memory) and a bf16 -> float32 cast of a large numpy array. Wall seconds include
waiting for a CPU on a shared machine, so CPU seconds and page faults are reported too. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PRESET = "qwen2.5-1.5b"
DEFAULT_LAYERS = 4
GOAL_TRANSIENT_OVER_CKPT = 1.5
STAGES = ("actor-train", "actor-gen", "ref-infer")
GIB = 2**30
HUGETLB = "glibc.malloc.hugetlb=1"
TIMING_NOTE = (
    "seconds are wall-clock and include waiting for a CPU when the machine is shared (loadavg); cpu_s "
    "(user + sys) is the load's own work, sys mostly the kernel zeroing the new state's pages (minor_faults). "
    "Each stage reads the checkpoint's bytes once (bytes_read_over_ckpt ~ 3 for three stages; column slices "
    "closer than 8 KiB are read with their holes)."
)
RSS_NOTE = (
    "On CPU the devices' arrays live in host RAM, so peak_rss includes the laid-out state. transient = "
    "peak_rss - rss_before - live_bytes (the live arrays' shard bytes, deduplicated per device and buffer) "
    "is what the loading path needs beyond the state it produces at its peak; the goal (<= 1.5x the "
    "checkpoint's size) applies to transient_over_ckpt. It hides a transient that passes while the state is "
    "still small, so two more: read_max_extra (exact: VmHWM reset at each read, minus RSS at its start and "
    "the slice's bytes) and transient_max_upper (the largest RSS - rss_before - bytes of the JAX arrays alive "
    "at each 10 ms sample; an upper bound: buffers being filled for an array not yet made count as transient, "
    "in streaming at most one leaf of one replica, stages.*.largest_leaf_bytes)."
)


# ------------------------------------------------------------------------------------------ arguments
def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-layers", type=int, default=None,
                   help=f"decoder layers (the preset's shapes; default {DEFAULT_LAYERS}, the preset has 28)")
    p.add_argument("--param-dtype", default="float32", help="actor-train's parameter dtype (float32 master weights)")
    p.add_argument("--optimizer", action="store_true", help="actor-train with its AdamW state (initialised on device)")
    p.add_argument("--train", default="2x4", help="actor-train layout, TPxDP")
    p.add_argument("--gen", default="2x4", help="actor-gen layout, TPxDP")
    p.add_argument("--ref", default="4x2", help="ref-infer layout, TPxDP")
    p.add_argument("--max-shard-bytes", type=int, default=None,
                   help="safetensors shard size (256 MiB; 64 KiB with --smoke); a larger tensor gets its own file")
    p.add_argument("--ckpt", help="use (or keep) the checkpoint in this directory (written when missing)")
    p.add_argument("--hugetlb", action="store_true",
                   help="run the loads with glibc's transparent-hugepage tunable (fewer page faults)")
    p.add_argument("--force", action="store_true", help="run even when the estimated peak exceeds available memory")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, a few seconds")
    p.add_argument("--role", choices=("make", "streaming", "naive"), help=argparse.SUPPRESS)  # internal: a child
    args = p.parse_args(argv)
    if args.num_layers is None:
        args.num_layers = 2 if args.smoke else DEFAULT_LAYERS
    if args.max_shard_bytes is None:
        args.max_shard_bytes = 2**16 if args.smoke else 2**28
    return args


def _layout(text: str) -> tuple[int, int]:
    tp, dp = (int(v) for v in text.lower().split("x"))
    return tp, dp


def _model(args):
    """The preset with ``num_layers`` layers (tiny widths of the same structure under --smoke)."""
    import dataclasses

    from nereus_jax.config import resolve_model

    cfg = dataclasses.replace(resolve_model(PRESET), num_layers=args.num_layers, param_dtype=args.param_dtype)
    if args.smoke:
        cfg = dataclasses.replace(cfg, vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                  intermediate_size=128)
    return cfg


def _stage_layouts(args) -> dict[str, tuple[int, int]]:
    return dict(zip(STAGES, (_layout(args.train), _layout(args.gen), _layout(args.ref)), strict=True))


def _specs(args, cfg) -> dict:
    """Each stage's StateSpec as the job builds them (``runtime.step.stages._specs``); actor-train's optimizer on
    request."""
    from nereus_jax.elastic.spec import StateSpec
    from nereus_jax.runtime.step import losses

    optimizer = losses.make_optimizer(1e-5) if args.optimizer else None
    return {"actor-train": StateSpec(cfg, "train", optimizer=optimizer),
            "actor-gen": StateSpec(cfg, "gen", dtype=cfg.compute_dtype),
            "ref-infer": StateSpec(cfg, "infer", dtype=cfg.compute_dtype)}


# ----------------------------------------------------------------------------------------- memory probes
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_hwm() -> bool:
    """Resets VmHWM to the current RSS (``5`` to /proc/self/clear_refs); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _read_io() -> dict[str, int]:
    """rchar (bytes through read/pread syscalls, page cache or not) and read_bytes (from storage)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value)
    return {"rchar": out["rchar"], "read_bytes": out["read_bytes"]}


class Sampler:
    """Samples this process's memory every ``interval`` seconds in a thread: peak RssAnon and RssFile, and
    the largest excess of RSS over ``rss_before`` plus the bytes of the JAX arrays alive at that moment."""

    def __init__(self, rss_before: int, interval: float = 0.01):
        self.rss_before, self.interval = rss_before, interval
        self.peak_rss = self.peak_anon = self.peak_file = self.max_excess = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        first = live_now()
        s = proc_status()
        live = max(first, live_now())  # an array made between the two reads is not counted as excess
        self.peak_rss = max(self.peak_rss, s["VmRSS"])
        self.peak_anon, self.peak_file = max(self.peak_anon, s["RssAnon"]), max(self.peak_file, s["RssFile"])
        self.max_excess = max(self.max_excess, s["VmRSS"] - self.rss_before - live)
        self.samples += 1

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def live_now() -> int:
    """Bytes every live JAX array holds on its devices (one shard per device of its sharding)."""
    import jax

    total = 0
    for x in jax.live_arrays():
        with contextlib.suppress(RuntimeError):  # deleted meanwhile
            total += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize * len(x.sharding.device_set)
    return total


def live_bytes(arrays) -> int:
    """Bytes the arrays hold on their devices: every addressable shard once per (device, buffer)."""
    seen, total = set(), 0
    for x in arrays:
        for shard in x.addressable_shards:
            key = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                total += shard.data.nbytes
    return total


class ReadProbe:
    """A parameter source around another that measures each read exactly: VmHWM is reset when a read
    starts, so after it VmHWM - RSS at its start - the slice's bytes is the extra host memory that one read
    needed (raw bytes, cast copies). ``peak`` keeps the process's VmHWM from before each reset."""

    def __init__(self, source):
        self.source, self.peak, self.reads, self.max_extra, self.max_extra_at = source, 0, 0, 0, None

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    def read(self, path, index=None, dtype=None):
        self.peak = max(self.peak, proc_status()["VmHWM"])
        _reset_hwm()
        start = proc_status()["VmRSS"]
        out = self.source.read(path, index, dtype)
        extra = proc_status()["VmHWM"] - start - out.nbytes
        if extra > self.max_extra:
            self.max_extra, self.max_extra_at = extra, ["/".join(path), list(out.shape), str(out.dtype)]
        self.reads += 1
        return out


# ------------------------------------------------------------------------------------------- children
def _setup_jax() -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _make(args) -> dict:
    """Writes a random bf16 checkpoint of the model with ``save_hf`` (sharded); values ~ N(0, 0.02)."""
    import jax
    import ml_dtypes
    import numpy as np

    from nereus_jax.models import abstract_params
    from nereus_jax.models.hf import save_hf

    cfg = _model(args)
    rng = np.random.default_rng(0)

    def random(shape, chunk=2**22):
        out = np.empty(shape, ml_dtypes.bfloat16)
        flat = out.reshape(-1)
        for i in range(0, flat.size, chunk):  # in chunks: no whole float32 copy
            flat[i:i + chunk] = rng.standard_normal(len(flat[i:i + chunk]), np.float32) * 0.02
        return out

    params = jax.tree.map(lambda s: random(tuple(s.shape)), abstract_params(cfg))
    save_hf(args.ckpt, cfg, params, dtype="bfloat16", max_shard_bytes=args.max_shard_bytes)
    return {"params": int(sum(x.size for x in jax.tree.leaves(params)))}


def _stream_stage(spec, layout, replicas, ckpt, name):
    from nereus_jax.elastic.sources import units_from_source
    from nereus_jax.model_stage import ModelStage

    return units_from_source(ModelStage.parse(name), spec, layout, replicas, ckpt)


def _naive_stage(spec, layout, replicas, host, name):
    """The naive load: the whole host tree, cast per inference stage, one
    ``EMU.create`` (a device_put from host) per replica; actor-train's optimizer state initialised on host."""
    import jax
    import numpy as np

    from nereus_jax.elastic.emu import EMU
    from nereus_jax.model_stage import ModelStage

    if spec.kind == "train":
        state = {"params": host}
        if spec.optimizer is not None:
            state["opt"] = spec.optimizer.init(host)
    else:
        state = {"params": jax.tree.map(lambda x: np.asarray(x, spec.dtype), host)}
    ms = ModelStage.parse(name)
    return [EMU.create(ms, spec, layout, r, state) for r in replicas]


def _load(args) -> dict:
    """One load (``args.role``: streaming or naive) of every stage; its seconds, bytes read and memory."""
    _setup_jax()
    import jax

    from nereus_jax.models.hf import HFCheckpoint, load_hf
    from nereus_jax.sharding import Layout

    cfg, devices = _model(args), jax.devices()
    specs = _specs(args, cfg)
    jax.block_until_ready(jax.device_put(0.0, devices[-1]))  # the client is up before the baseline
    hwm_reset = _reset_hwm()
    before, io0, ru0, times, units, per_stage = proc_status(), _read_io(), _rusage(), {}, {}, {}
    with Sampler(before["VmRSS"]) as sampler:
        t0 = time.perf_counter()
        if args.role == "streaming":
            source = ReadProbe(HFCheckpoint(args.ckpt))
        else:
            _, source = load_hf(args.ckpt, dtype=cfg.param_dtype)
            times["load_hf"] = time.perf_counter() - t0
        for name, (tp, dp) in _stage_layouts(args).items():
            t = time.perf_counter()
            replicas = [devices[i * tp:(i + 1) * tp] for i in range(dp)]
            load = _stream_stage if args.role == "streaming" else _naive_stage
            units[name] = load(specs[name], Layout(tp=tp), replicas, source, name)
            jax.block_until_ready([u.leaves for u in units[name]])
            times[name] = time.perf_counter() - t
            per_stage[name] = {"rss_after": proc_status()["VmRSS"]}
        seconds = time.perf_counter() - t0
    after, io1, ru1 = proc_status(), _read_io(), _rusage()
    for name, us in units.items():
        per_stage[name]["live_bytes"] = live_bytes(leaf for u in us for leaf in u.leaves)
    probe = source if isinstance(source, ReadProbe) else None
    return {"seconds": seconds, "stage_seconds": times, "per_stage": per_stage,
            **{k: ru1[k] - ru0[k] for k in ru0}, "loadavg": os.getloadavg()[0],
            "bytes_read": probe.bytes_read if probe else None, "rchar": io1["rchar"] - io0["rchar"],
            "storage_read_bytes": io1["read_bytes"] - io0["read_bytes"], "rss_before": before["VmRSS"],
            "peak_rss": max(after["VmHWM"], probe.peak if probe else 0, sampler.peak_rss),
            "rss_after": after["VmRSS"], "hwm_reset": hwm_reset,
            "rss_anon_before": before["RssAnon"], "rss_file_before": before["RssFile"],
            "peak_rss_anon": sampler.peak_anon, "peak_rss_file": sampler.peak_file,
            "max_excess_over_live": sampler.max_excess, "samples": sampler.samples,
            "read_max_extra": probe.max_extra if probe else None, "reads": probe.reads if probe else None,
            "read_max_extra_at": probe.max_extra_at if probe else None,
            "live_bytes": live_bytes(leaf for us in units.values() for u in us for leaf in u.leaves),
            "stages": _loaded(units, specs)}


def _rusage() -> dict[str, float]:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_user_s": r.ru_utime, "cpu_sys_s": r.ru_stime, "minor_faults": r.ru_minflt}


def _loaded(units: dict, specs: dict) -> dict:
    """What each stage actually holds: layout, replicas, and every leaf's global shape and dtype."""
    from nereus_jax.elastic.sources import param_paths

    out = {}
    for name, us in units.items():
        spec, first = specs[name], us[0]
        paths = ["/".join(p) for p in param_paths(spec)]
        leaves = first.leaves
        params = {p: [list(x.shape), str(x.dtype)] for p, x in zip(paths, leaves[:spec.n_params], strict=True)}
        opt = [[list(x.shape), str(x.dtype)] for x in leaves[spec.n_params:]]
        out[name] = {"layout": f"tp{first.layout.tp}", "dp": len(us), "params": params,
                     "param_count": int(sum(math.prod(x.shape) for x in leaves[:spec.n_params])),
                     "optimizer": bool(opt), "optimizer_leaves": len(opt),
                     "replica_bytes": int(sum(x.nbytes for x in leaves)),
                     "largest_leaf_bytes": int(max(x.nbytes for x in leaves)),
                     "devices": [[d.id for d in u.devices] for u in us]}
    return out


# --------------------------------------------------------------------------------------- machine probes
def file_read_bandwidth(files: list[Path], chunk: int = 16 * 2**20) -> dict:
    """Sequential read of ``files`` into one reused buffer (nothing is dropped from the page cache)."""
    import numpy as np

    buf, total = np.empty(chunk, np.uint8), 0
    t = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(memoryview(buf)):
                total += n
    seconds = time.perf_counter() - t
    return {"bytes": total, "seconds": seconds, "GBps": total / seconds / 1e9}


def cached_fraction(files: list[Path], nbytes: int) -> float | None:
    """The fraction of ``files`` (``nbytes`` in all) resident in the page cache (util-linux ``fincore``, whole
    pages, so capped at 1), None without it."""
    if not shutil.which("fincore"):
        return None
    res = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, files)],
                         capture_output=True, text=True)
    try:
        return min(1.0, sum(int(v) for v in res.stdout.split()) / nbytes)
    except ValueError:
        return None


def host_bandwidth(nbytes: int, repeats: int = 3) -> dict:
    """Best-of-``repeats`` host copies of about ``nbytes``, in bytes written per second: a numpy memcpy into
    memory already paged in, the same into fresh memory (its first-touch page faults included, as a load
    that allocates its state pays them), and a bf16 -> float32 cast."""
    import ml_dtypes
    import numpy as np

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    half = np.ones(nbytes // 4, ml_dtypes.bfloat16)

    def best(fn) -> float:
        fn()  # page the destination in
        return min(_timed(fn) for _ in range(repeats))

    copy_s = best(lambda: np.copyto(dst, src))
    fresh_s = best(lambda: np.copyto(np.empty_like(src), src))
    cast_s = best(lambda: np.copyto(dst, half, casting="unsafe"))
    return {"bytes": src.nbytes, "memcpy_GBps": src.nbytes / copy_s / 1e9,
            "memcpy_fresh_GBps": src.nbytes / fresh_s / 1e9, "cast_bf16_f32_GBps": dst.nbytes / cast_s / 1e9}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


# ----------------------------------------------------------------------------------------------- estimate
def estimate(args) -> dict:
    """Bytes of the laid-out state and the expected peaks (no allocation): the naive path adds the whole
    host tree in actor-train's dtype, one compute-dtype copy of it, and (with --optimizer) the Adam state
    on host; the streaming path about one parameter in actor-train's dtype."""
    from nereus_jax.sharding import Layout

    cfg = _model(args)
    specs = _specs(args, cfg)
    live = sum(specs[n].bytes_per_device(Layout(tp=tp)) * tp * dp for n, (tp, dp) in _stage_layouts(args).items())
    train = specs["actor-train"]
    params = sum(math.prod(leaf.shape) for leaf in train.leaves[:train.n_params])
    item, compute = train.leaves[0].dtype.itemsize, specs["actor-gen"].leaves[0].dtype.itemsize
    largest = max(math.prod(leaf.shape) for leaf in train.leaves[:train.n_params]) * item
    host = params * (item + compute) + (2 * params * 4 if args.optimizer else 0)
    base = 0.6 * GIB
    return {"params": params, "ckpt_bytes": params * 2, "live_bytes": live,
            "naive_peak": int(base + live + host), "streaming_peak": int(base + live + 2 * largest)}


# ---------------------------------------------------------------------------------------------- summary
def _per_run(run: dict, ckpt_bytes: int) -> dict:
    """One load's figures with the derived ones: transient bytes (peak - before - live at the end), the
    largest excess over the arrays alive at each sample, CPU seconds, and each over the checkpoint's size."""
    transient = run["peak_rss"] - run["rss_before"] - run["live_bytes"]
    read_extra = run["read_max_extra"]
    return {**run, "transient_bytes": transient, "transient_over_ckpt": transient / ckpt_bytes,
            "max_excess_over_live_over_ckpt": run["max_excess_over_live"] / ckpt_bytes,
            "read_max_extra_over_ckpt": None if read_extra is None else read_extra / ckpt_bytes,
            "peak_over_ckpt": run["peak_rss"] / ckpt_bytes,
            "peak_minus_before_over_ckpt": (run["peak_rss"] - run["rss_before"]) / ckpt_bytes,
            "cpu_s": run["cpu_user_s"] + run["cpu_sys_s"],
            "peak_rss_file_delta": run["peak_rss_file"] - run["rss_file_before"]}


def summarize(streaming: dict, naive: dict, ckpt_bytes: int, machine: dict, meta: dict) -> dict:
    """The JSON: both loads with their transient memory, the ratios streaming / naive, and the streaming
    load's throughput against the machine's file-read and memcpy bandwidth."""
    s, n = _per_run(streaming, ckpt_bytes), _per_run(naive, ckpt_bytes)
    stages = s.pop("stages")
    n.pop("stages")
    read_gbps, laid_gbps = s["bytes_read"] / s["seconds"] / 1e9, s["live_bytes"] / s["seconds"] / 1e9
    host = machine["host"]
    return {
        **meta, "ckpt_bytes": ckpt_bytes, "stages": stages,
        "seconds": s["seconds"], "bytes_read": s["bytes_read"], "bytes_read_over_ckpt": s["bytes_read"] / ckpt_bytes,
        "peak_rss_over_ckpt": s["peak_over_ckpt"], "transient_over_ckpt": s["transient_over_ckpt"],
        "transient_max_upper_over_ckpt": s["max_excess_over_live_over_ckpt"],
        "read_max_extra_over_ckpt": s["read_max_extra_over_ckpt"],
        "goal_transient_over_ckpt": GOAL_TRANSIENT_OVER_CKPT,
        "goal_met": s["transient_over_ckpt"] <= GOAL_TRANSIENT_OVER_CKPT,
        "rss_note": RSS_NOTE, "streaming": s, "naive": n,
        "streaming_over_naive": {
            "seconds": s["seconds"] / n["seconds"], "cpu_s": _ratio(s["cpu_s"], n["cpu_s"]),
            "peak_rss": s["peak_rss"] / n["peak_rss"], "transient": _ratio(s["transient_bytes"], n["transient_bytes"]),
            "transient_max_upper": _ratio(s["max_excess_over_live"], n["max_excess_over_live"])},
        "machine": machine,
        "throughput": {
            "read_GBps": read_gbps, "read_over_file_read": read_gbps / machine["file_read"]["GBps"],
            "laid_out_GBps": laid_gbps, "laid_out_over_memcpy": laid_gbps / host["memcpy_GBps"],
            "laid_out_over_memcpy_fresh": laid_gbps / host["memcpy_fresh_GBps"],
            "laid_out_per_cpu_s_GBps": s["live_bytes"] / s["cpu_s"] / 1e9},
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


# ------------------------------------------------------------------------------------------------ parent
def _child(args, role: str) -> dict:
    argv = [sys.executable, __file__, "--role", role, "--ckpt", str(args.ckpt), "--num-layers", str(args.num_layers),
            "--param-dtype", args.param_dtype, "--train", args.train, "--gen", args.gen, "--ref", args.ref,
            "--max-shard-bytes", str(args.max_shard_bytes)]
    argv += ["--smoke"] * args.smoke + ["--optimizer"] * args.optimizer
    env = dict(os.environ)
    if args.hugetlb:
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), HUGETLB]))
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.stderr.write(res.stderr)
        raise SystemExit(f"bench_load: the {role} child failed (exit {res.returncode})")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _checkpoint_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _timed_child(args, role: str, files: list[Path], ckpt_bytes: int) -> dict:
    """A load child, with how much of the checkpoint the page cache held when it started."""
    cached = cached_fraction(files, ckpt_bytes)
    out = _child(args, role)
    out["page_cache_before"] = cached
    return out


def _machine(args, files: list[Path], ckpt_bytes: int, available: int) -> dict:
    cached = cached_fraction(files, ckpt_bytes)
    return {"file_read": {**file_read_bandwidth(files), "page_cache_before": cached},
            "page_cache_note": "nothing is dropped: the files were just written (or given by --ckpt) and are "
                               "read once for file_read before the loads; page_cache_before: the fraction cached",
            "host": host_bandwidth(16 * 2**20 if args.smoke else 512 * 2**20),
            "mem_available_before": available, "cpu_count": os.cpu_count(), "loadavg": os.getloadavg()[0]}


def _bench(args) -> dict:
    est = estimate(args)
    available = mem_available()
    if max(est["naive_peak"], est["streaming_peak"]) > 0.85 * available and not args.force:
        raise SystemExit(f"bench_load: the naive load would peak near {est['naive_peak'] / GIB:.1f} GiB, "
                         f"{available / GIB:.1f} GiB are available now; lower --num-layers (or --force)")
    keep = args.ckpt is not None
    args.ckpt = Path(args.ckpt or tempfile.mkdtemp(prefix="bench_load_"))
    try:
        if not _checkpoint_files(args.ckpt):
            _child(args, "make")
        files = _checkpoint_files(args.ckpt)
        ckpt_bytes = sum(f.stat().st_size for f in files)
        machine = _machine(args, files, ckpt_bytes, available)
        streaming = _timed_child(args, "streaming", files, ckpt_bytes)
        naive = _timed_child(args, "naive", files, ckpt_bytes)
    finally:
        if not keep:
            shutil.rmtree(args.ckpt, ignore_errors=True)
    meta = {"preset": PRESET, "num_layers": args.num_layers, "preset_num_layers": 28, "smoke": args.smoke,
            "checkpoint": {"dtype": "bfloat16", "files": len(files), "max_shard_bytes": args.max_shard_bytes},
            "params": est["params"], "estimate": est, "optimizer": args.optimizer, "hugetlb": args.hugetlb,
            "optimizer_note": "actor-train loads params only" if not args.optimizer else
            "actor-train includes its AdamW state (initialised on device in streaming, on host in naive)",
            "timing_note": TIMING_NOTE}
    return summarize(streaming, naive, ckpt_bytes, machine, meta)


def main(argv=None) -> dict:
    args = _args(argv)
    if args.role == "make":
        out = _make(args)
    elif args.role:
        out = _load(args)
    else:
        out = _bench(args)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
