"""Trace-driven experiments on a SIMULATED cluster: the real controller, planner, cost model and transition
graph against a simulated cluster's ground truth (nereus_jax/sim). No GPUs needed; nothing is measured.

    python -m nereus_jax.simulate configs/sim/paper_drift.yaml                 # table + plot PNG
    python -m nereus_jax.simulate configs/sim/paper_drift.yaml --json          # one JSON object, one line
    python -m nereus_jax.simulate paper_drift --policies fixed,nereus,oracle   # a bare name finds configs/sim
    python -m nereus_jax.simulate paper_drift --sweep controller.gamma=0,0.25,0.5,0.75,1
    python -m nereus_jax.simulate paper_drift --set truth.noise_cv=0.05 --seed 3
    python -m nereus_jax.simulate paper_drift --policies async_fixed,async_nereus,nereus --json   # async vs sync

Policies: fixed (first-step TP/PP kept, DP scaled), fixed_best (best pinned TP/PP in hindsight), every_K
(re-plan every K steps), no_admission (admit any gain), nereus (Eq. 2 admission), oracle (best plan each
step, free transitions); async_fixed / async_nereus (one-step-off, actor-gen on its own devices, the step
latency the interval between weight syncs; nereus_jax/sim/asynchronous.py). The JSON has ``simulated: true``,
``hardware`` and, per policy, ``mean_step_s``, ``transitions``, ``transition_s``, ``overhead_fraction`` (a
fraction) and ``oom_events`` (async policies also ``sync_fallback_steps``, ``fill_s``); ``comparison`` has
``async_nereus_reduction_vs_async_fixed`` and ``..._vs_nereus`` when those ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import yaml

from nereus_jax.sim import POLICIES, PolicyError, Simulation, TraceError, load_trace, report


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nereus_jax.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a trace YAML file, or a name in configs/sim (paper_drift, paper_1024, ...)")
    p.add_argument("--policies", help=f"comma-separated (default: the trace's list, else {','.join(POLICIES)})")
    p.add_argument("--json", action="store_true", help="print one JSON object on one line (no table)")
    p.add_argument("--sweep", help="KEY=V1,V2,...: rerun per value (e.g. controller.gamma=0,0.25,0.5,0.75,1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a trace key")
    p.add_argument("--seed", type=int, help="the ground truth's seed (noise, stragglers, length jitter)")
    p.add_argument("--plot", help="where to write the PNG (default: sim_<trace>.png in the working directory)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    return p.parse_args(argv)


def _overrides(args) -> dict:
    out = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise TraceError(f"--set {item!r}: expected KEY=VALUE")
        out[key] = yaml.safe_load(value)
    if args.seed is not None:
        out["seed"] = args.seed
    return out


def main(argv=None) -> dict:
    args = _args(argv)
    try:
        return _main(args)
    except (TraceError, PolicyError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _main(args) -> dict:
    start = time.perf_counter()
    overrides = _overrides(args)
    trace = load_trace(args.trace, overrides)
    policies = [p for p in (args.policies or ",".join(trace.policies or POLICIES)).split(",") if p]
    if args.sweep:
        return _sweep(args, overrides, policies if args.policies else ["nereus"], start)
    sim = Simulation(trace)
    runs = sim.run(policies)
    png = None if args.no_plot else report.plot(sim, runs, args.plot or f"sim_{trace.name}.png")
    out = report.result_json(sim, runs, plot=str(png) if png else None, wall_s=time.perf_counter() - start)
    if args.json:
        print(json.dumps(out))
    else:
        print(report.table(sim, runs))
        print(f"plot: {png}" if png else "plot: not written (--no-plot, or matplotlib is not installed)")
    return out


def _sweep(args, overrides: dict, policies: list[str], start: float) -> dict:
    key, sep, values = args.sweep.partition("=")
    if not sep or not values:
        raise TraceError(f"--sweep {args.sweep!r}: expected KEY=V1,V2,...")
    rows, sim, base = [], None, None
    for raw in values.split(","):
        value = yaml.safe_load(raw)
        trace = load_trace(args.trace, {**overrides, key: value})  # validates the key and the value
        if key.startswith("controller."):  # same cluster and trace: share the truth and the planner's caches
            base = base or Simulation(trace)
            sim = base.with_controller(**trace.controller)
        else:
            sim = Simulation(trace)
        rows.append((value, sim.run(policies)))
    out = {"simulated": True, "hardware": sim.hw.name, "hardware_description": sim.hw.description,
           "trace": sim.trace.name, "sweep": {"key": key, "runs": [
               {"value": v, "policies": {n: r.summary() for n, r in runs.items()}} for v, runs in rows]},
           "wall_s": time.perf_counter() - start}
    if not args.no_plot:
        png = report.plot(sim, {f"{key}={v}": runs[policies[-1]] for v, runs in rows},
                          args.plot or f"sim_{sim.trace.name}_sweep.png")
        out["plot"] = str(png) if png else None
    if args.json:
        print(json.dumps(out))
    else:
        print(report.sweep_table(sim, key, rows))
        print(f"plot: {out.get('plot')}")
    return out


if __name__ == "__main__":
    main()
