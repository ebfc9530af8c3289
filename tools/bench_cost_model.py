"""Calibration of the cost model against the real PPO stage programs on this machine (8 virtual CPU devices).

    .venv312/bin/python tools/bench_cost_model.py                 # 6 layouts (~3-4 min on 2 CPU cores)
    .venv312/bin/python tools/bench_cost_model.py --layouts 1x1,2x2,1x2,2x1,1x4,4x1,1x8,2x4

Each layout ``TPxDP`` (pp = 1) runs the job's own stage computations of :mod:`nereus_jax.runtime.steps`
as jitted SPMD programs over a ("dp", "pp", "tp") mesh, exactly as ``runtime.job`` builds them (parameters
laid out by ``shard_params``, rows split over dp, ``split_micro`` micro-batches sized by
``accumulation_steps``):

- ``ref-infer``: ``response_logprobs`` of an lm-head model (``jax.lax.map`` over micro-batches), the same
  program as actor-infer; actor-infer is not reported separately because the cost model adds the actor's
  per-step weight sync to it, which this program does not do;
- ``critic-infer``: ``response_values`` of a value-head model;
- ``actor-train`` / ``critic-train``: ``make_train_step`` with the PPO ``actor_loss`` / ``critic_loss`` and
  ``make_optimizer`` (AdamW), donated state, gradients accumulated over the micro-batches.

actor-gen is skipped: the engine decodes in a host-driven loop of per-token programs whose length depends
on sampling, which ``gen_latency`` prices with assumptions (slots, steps) this benchmark cannot pin down
in the time budget; the JSON says so.

Each program is compiled and run once (warm-up), then timed as the median of ``--reps`` runs
(``block_until_ready``). One ``CostModel("cpu")`` observes every stage's measurement on the calibration
layouts (default the first two: 1x1 and 2x2) and predicts all layouts; the mean absolute percentage
error per stage is over the layouts NOT calibrated on. The uncalibrated prior's error is reported too.

Prints one JSON object on its last line: ``layouts_measured``, ``layouts_calibrated``, ``mape_by_stage``,
``mape``, ``target_met_by_stage``, ``rows`` (layout, stage, measured_s, predicted_s, prior_s, calibrated),
``efficiency`` (the fitted classes), ``matmul_flops_per_s`` (measured in this run) and ``skipped``.
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
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from nereus_jax.config import AlgorithmConfig, ModelConfig  # noqa: E402
from nereus_jax.elastic.costs import CostModel, Measurement, StageChoice  # noqa: E402
from nereus_jax.elastic.workload import Workload  # noqa: E402
from nereus_jax.models import count_params, init_params  # noqa: E402
from nereus_jax.runtime import steps  # noqa: E402
from nereus_jax.sharding import Layout, make_mesh, shard_params  # noqa: E402

# ~20M parameters: 4 layers of ~3M plus 2 x 4.2M embedding / lm head.
BENCH_MODEL = ModelConfig(name="bench-cost-20m", vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8,
                          num_kv_heads=2, intermediate_size=1536, max_position_embeddings=512)
ROWS, PROMPT, RESPONSE = 16, 64, 64
MICRO_BATCH_TOKENS = 1024  # -> 8 rows per call: 2 calls per replica at dp=1, 1 call at dp>=2
STAGES = ("ref-infer", "critic-infer", "actor-train", "critic-train")
DEFAULT_LAYOUTS = "1x1,2x2,1x2,2x1,1x4,4x1"  # TPxDP; the first --calibrate of them calibrate
TARGET = 0.15


def timed(fn, reps: int) -> float:
    """Median wall seconds of ``fn()`` after one warm-up (compile) call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops_per_s(n: int = 1024, reps: int = 5) -> float:
    """float32 [n, n] @ [n, n] on one device (all the machine's cores), FLOP/s."""
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n)), jax.devices()[0])
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / timed(lambda: f(a), reps=reps)


def host_batch(cfg: ModelConfig) -> dict:
    """One step's rollout batch, as the job hands it to scoring and training."""
    rng = np.random.default_rng(0)
    length = PROMPT + RESPONSE
    tokens = rng.integers(0, cfg.vocab_size, size=(ROWS, length), dtype=np.int32)
    mask = np.ones((ROWS, length), np.int32)
    response_mask = np.ones((ROWS, RESPONSE), np.float32)
    return {"tokens": tokens, "mask": mask, "response_mask": response_mask,
            "old_logp": rng.normal(-3.0, 0.5, (ROWS, RESPONSE)).astype(np.float32),
            "advantages": rng.normal(0.0, 1.0, (ROWS, RESPONSE)).astype(np.float32),
            "old_values": rng.normal(0.0, 1.0, (ROWS, RESPONSE)).astype(np.float32),
            "returns": rng.normal(0.0, 1.0, (ROWS, RESPONSE)).astype(np.float32),
            "denom": np.float32(response_mask.sum())}


def put(micro: dict, mesh) -> dict:
    """As ``runtime.job._put``: [accum, rows, ...] arrays split over dp on the rows axis."""
    rows = NamedSharding(mesh, PartitionSpec(None, "dp"))
    whole = NamedSharding(mesh, PartitionSpec())
    return {k: jax.device_put(v, rows if np.ndim(v) > 1 else whole) for k, v in micro.items()}


def measure_layout(cfg: ModelConfig, tp: int, dp: int, host: dict, base: dict, reps: int) -> tuple[dict, StageChoice]:
    """Seconds per stage on a (dp, pp=1, tp) mesh, and the StageChoice it corresponds to."""
    layout = Layout(tp=tp)
    mesh = make_mesh(jax.devices()[: tp * dp], layout, dp=dp)
    accum = steps.accumulation_steps(ROWS, dp, PROMPT + RESPONSE, MICRO_BATCH_TOKENS)
    choice = StageChoice(tp=tp, pp=1, dp=dp, micro_batch=ROWS // dp // accum)
    micro = put(steps.split_micro(host, accum), mesh)
    algo = AlgorithmConfig()
    out = {}
    for model, head in (("ref", "lm"), ("critic", "value")):
        params = shard_params(base[head], cfg, layout, mesh, kind="infer")
        fn = steps.response_logprobs if head == "lm" else steps.response_values

        def program(p, tokens, mask, fn=fn):
            return jax.lax.map(lambda tm: fn(p, cfg, tm[0], tm[1], PROMPT), (tokens, mask))

        infer = jax.jit(program)
        out[f"{model}-infer"] = timed(lambda infer=infer, params=params: infer(params, micro["tokens"], micro["mask"]),
                                      reps)
        del params
    for model, head in (("actor", "lm"), ("critic", "value")):
        params = shard_params(base[head], cfg, layout, mesh, kind="train")
        optimizer = steps.make_optimizer(1e-6)
        opt_state = jax.jit(optimizer.init)(params)
        loss = steps.actor_loss(cfg, algo, PROMPT) if model == "actor" else steps.critic_loss(cfg, algo, PROMPT)
        train = jax.jit(steps.make_train_step(loss, optimizer, cfg), donate_argnums=(0, 1))
        state = [params, opt_state]

        def run(train=train, state=state):
            state[0], state[1], metrics = train(state[0], state[1], micro)
            return metrics

        out[f"{model}-train"] = timed(run, reps)
        del params, opt_state, state
    return out, choice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma-separated TPxDP (pp = 1)")
    ap.add_argument("--calibrate", type=int, default=2, help="how many of the first layouts calibrate")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per program (median)")
    args = ap.parse_args()
    layouts = [tuple(int(v) for v in s.split("x")) for s in args.layouts.split(",")]
    cfg = BENCH_MODEL
    t0 = time.perf_counter()
    flops = matmul_flops_per_s()
    print(f"matmul: {flops / 1e9:.1f} GFLOP/s", file=sys.stderr)
    base = {"lm": init_params(cfg, seed=0), "value": init_params(cfg, seed=1, head="value")}
    base = {k: jax.tree.map(np.asarray, v) for k, v in base.items()}
    host = host_batch(cfg)
    workload = Workload.fixed(ROWS, PROMPT, RESPONSE)

    measured: dict[str, dict[str, float]] = {}
    choices: dict[str, StageChoice] = {}
    for tp, dp in layouts:
        key = f"tp{tp}xdp{dp}"
        t = time.perf_counter()
        measured[key], choices[key] = measure_layout(cfg, tp, dp, host, base, args.reps)
        print(f"{key} {choices[key]}: " + ", ".join(f"{s} {v:.3f}s" for s, v in measured[key].items())
              + f"  ({time.perf_counter() - t:.0f}s)", file=sys.stderr)

    keys = list(measured)
    calib = keys[: args.calibrate]
    prior = CostModel("cpu")
    cm = CostModel("cpu")
    cm.observe([Measurement(cfg, stage, choices[k], workload, measured[k][stage]) for k in calib for stage in STAGES])

    rows, errors, prior_errors = [], {s: [] for s in STAGES}, {s: [] for s in STAGES}
    for k in keys:
        for stage in STAGES:
            pred = cm.stage_latency(cfg, stage, choices[k], workload).total
            pri = prior.stage_latency(cfg, stage, choices[k], workload).total
            meas = measured[k][stage]
            rows.append({"layout": k, "choice": str(choices[k]), "stage": stage, "measured_s": round(meas, 5),
                         "predicted_s": round(pred, 5), "prior_s": round(pri, 5), "calibrated": k in calib})
            if k not in calib:
                errors[stage].append(abs(pred - meas) / meas)
                prior_errors[stage].append(abs(pri - meas) / meas)
    mape_by_stage = {s: round(float(np.mean(v)), 4) for s, v in errors.items() if v}
    all_err = [e for v in errors.values() for e in v]
    result = {
        "model": cfg.name, "params": count_params(base["lm"]), "batch": f"{ROWS} rows x {PROMPT + RESPONSE} tokens",
        "micro_batch_tokens": MICRO_BATCH_TOKENS,
        "layouts_measured": keys, "layouts_calibrated": calib,
        "mape_by_stage": mape_by_stage, "mape": round(float(np.mean(all_err)), 4) if all_err else None,
        "target": TARGET, "target_met_by_stage": {s: v <= TARGET for s, v in mape_by_stage.items()},
        "prior_mape_by_stage": {s: round(float(np.mean(v)), 4) for s, v in prior_errors.items() if v},
        "efficiency": {c: round(v, 4) for c, v in cm.efficiency.items()},
        "matmul_flops_per_s": flops,
        "rows": rows,
        "skipped": {"actor-gen": "engine decode is a host-driven per-token loop; not measured",
                    "actor-infer": "same program as ref-infer; the cost model adds a weight sync it lacks"},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
