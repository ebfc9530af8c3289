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

Exit status: 0 simulated; 2 bad input (a trace file, key, policy or flag): one line on stderr naming the file,
the key and what to change, before anything is simulated or written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import yaml

from nereus_jax._typed_tree import parse_yaml
from nereus_jax.sim import POLICIES, PolicyError, Simulation, TraceError, check_policy, load_trace, report
from nereus_jax.sim.trace import yaml_problem


class PlotPathError(ValueError):
    """A ``--plot`` path the PNG cannot be written to (a directory, or under a file or an unwritable folder)."""


class _Parser(argparse.ArgumentParser):
    """Argument errors on one line, like every other bad input (argparse prints its usage block first)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="python -m nereus_jax.simulate", description=__doc__,
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


def _value(flag: str, item: str, text: str):
    """A --set/--sweep value read as YAML (``0.5``, ``true``, ``[1.3, 2.0]``)."""
    try:
        return parse_yaml(text)
    except yaml.YAMLError as error:
        raise TraceError(f"{flag} {item!r}: the value {text!r} is not valid YAML ({yaml_problem(error)})") from None


def _overrides(args) -> dict:
    out = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TraceError(f"--set {item!r}: expected KEY=VALUE (e.g. --set controller.gamma=0.25)")
        out[key] = _value("--set", item, value)
    if args.seed is not None:
        out["seed"] = args.seed
    return out


def _policies(args, trace) -> list[str]:
    """The policies to run, each checked: --policies, else the trace's list, else POLICIES."""
    if args.policies is not None:
        names, where = [p for p in args.policies.split(",") if p], "--policies"
    else:
        names, where = list(trace.policies or POLICIES), f"{trace.source}: policies"
    if not names:
        raise PolicyError(f"{where}: name at least one policy (e.g. {','.join(POLICIES)})")
    for name in names:
        try:
            check_policy(name)
        except PolicyError as error:
            raise PolicyError(f"{where}: {error}") from None
    return names


def _plot_path(args, default: str) -> Path | None:
    """Where the PNG goes, checked before anything runs; None with --no-plot."""
    if args.no_plot:
        return None
    path = Path(args.plot or default)
    if path.is_dir():
        raise PlotPathError(f"--plot {path}: is a directory; give a file name (e.g. {path / default})")
    folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise PlotPathError(f"--plot {path}: cannot be written under {folder} (not a writable directory); "
                            "choose another path or pass --no-plot")
    return path


def main(argv=None) -> dict:
    args = _args(argv)
    try:
        return _main(args)
    except (TraceError, PolicyError, PlotPathError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _main(args) -> dict:
    start = time.perf_counter()
    overrides = _overrides(args)
    if args.sweep:
        return _sweep(args, overrides, start)
    trace = load_trace(args.trace, overrides)
    policies = _policies(args, trace)
    plot = _plot_path(args, f"sim_{trace.name}.png")
    sim = Simulation(trace)
    runs = sim.run(policies)
    png = None if plot is None else report.plot(sim, runs, plot)
    out = report.result_json(sim, runs, plot=str(png) if png else None, wall_s=time.perf_counter() - start)
    if args.json:
        print(json.dumps(out))
    else:
        print(report.table(sim, runs))
        print(f"plot: {png}" if png else "plot: not written (--no-plot, or matplotlib is not installed)")
    return out


def _sweep_traces(args, overrides: dict) -> tuple[str, list]:
    """The swept key and (value, trace) per value, every trace loaded (so checked) before any runs."""
    key, sep, values = args.sweep.partition("=")
    if not sep or not key or not values:
        raise TraceError(f"--sweep {args.sweep!r}: expected KEY=V1,V2,... (e.g. controller.gamma=0,0.5,1)")
    pairs = []
    for raw in values.split(","):
        value = _value("--sweep", args.sweep, raw)
        pairs.append((value, load_trace(args.trace, {**overrides, key: value})))
    return key, pairs


def _sweep(args, overrides: dict, start: float) -> dict:
    key, pairs = _sweep_traces(args, overrides)
    policies = _policies(args, pairs[0][1]) if args.policies is not None else ["nereus"]
    plot = _plot_path(args, f"sim_{pairs[0][1].name}_sweep.png")
    rows, sim, base = [], None, None
    for value, trace in pairs:
        if key.startswith("controller."):  # same cluster and trace: share the truth and the planner's caches
            base = base or Simulation(trace)
            sim = base.with_controller(**trace.controller)
        else:
            sim = Simulation(trace)
        rows.append((value, sim.run(policies)))
    out = {"simulated": True, "hardware": sim.hw.name, "hardware_description": sim.hw.description,
           "trace": sim.trace.name, "sweep": {"key": key, "runs": [
               {"value": v, "policies": report.policy_summaries(runs)} for v, runs in rows]},
           "wall_s": time.perf_counter() - start}
    if plot is not None:
        png = report.plot(sim, {f"{key}={v}": runs[policies[-1]] for v, runs in rows}, plot)
        out["plot"] = str(png) if png else None
    if args.json:
        print(json.dumps(out))
    else:
        print(report.sweep_table(sim, key, rows))
        print(f"plot: {out.get('plot')}")
    return out


if __name__ == "__main__":
    main()
