"""What a simulated run reports: one JSON-ready dict, a table, and a plot of step latency per policy with
transitions marked. Every output says SIMULATED and names the hardware table the cluster was built from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nereus_jax.sim.records import PolicyRun
from nereus_jax.sim.simulation import Simulation

SIMULATED = "SIMULATED"


def headline(sim: Simulation) -> str:
    t, hw = sim.trace, sim.hw
    return (f"{SIMULATED} (not measured): trace '{t.name}', {t.steps} steps, pool {min(t.pools)}-{max(t.pools)} "
            f"devices ({t.pool_changes()} changes), on hardware table '{hw.name}': {hw.description}")


def result_json(sim: Simulation, runs: Mapping[str, PolicyRun], **extra: Any) -> dict:
    """The JSON object of ``python -m nereus_jax.simulate --json`` (see README, "Simulator")."""
    t, hw = sim.trace, sim.hw
    policies = policy_summaries(runs)
    out: dict[str, Any] = {
        "simulated": True,
        "hardware": hw.name,
        "hardware_description": hw.description,
        "trace": t.name,
        "trace_file": t.source,
        "steps": t.steps,
        "pool_min": min(t.pools),
        "pool_max": max(t.pools),
        "pool_changes": t.pool_changes(),
        "seed": t.seed,
        "controller": dict(t.controller),
        "policies": policies,
        "comparison": comparison(policies),
        "planner_calls": len(sim.caches.plan_ms),
        "planner_ms_mean": sum(sim.caches.plan_ms) / max(1, len(sim.caches.plan_ms)),
    }
    out.update(extra)
    return out


def policy_summaries(runs: Mapping[str, PolicyRun]) -> dict[str, dict]:
    """Each policy's summary, with the share of the oracle's gain over fixed it captured."""
    policies = {name: run.summary() for name, run in runs.items()}
    for summary in policies.values():
        summary["oracle_gain_captured"] = oracle_gain_captured(summary, policies)
    return policies


ORACLE_GAIN_FLOOR = 1e-3  # the oracle must beat fixed by more than this fraction for a captured share to mean much


def oracle_gain_captured(summary: Mapping[str, Any], policies: Mapping[str, Mapping[str, Any]]) -> float | None:
    """The fraction of the oracle's gain over ``fixed`` (mean step latency) that this policy captured: 1 as
    fast as the oracle, 0 as slow as fixed, negative slower than fixed. None without both references or
    where the oracle gains nothing (within ``ORACLE_GAIN_FLOOR`` of fixed)."""
    if "fixed" not in policies or "oracle" not in policies:
        return None
    fixed, oracle = policies["fixed"]["mean_step_s"], policies["oracle"]["mean_step_s"]
    if fixed - oracle <= ORACLE_GAIN_FLOOR * fixed:
        return None
    return (fixed - summary["mean_step_s"]) / (fixed - oracle)


def comparison(policies: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """nereus against each other synchronous policy: the fractional reduction of mean step latency
    (positive: nereus faster) and its excess over the oracle; async_nereus against async_fixed (the
    paper's async figure) and against sync nereus (the same fraction)."""
    out = async_comparison(policies)
    if "nereus" not in policies:
        return out
    ours = policies["nereus"]["mean_step_s"]
    for name, s in policies.items():
        if name == "nereus" or name.startswith("async_"):
            continue
        if name == "oracle":
            out["nereus_over_oracle"] = ours / s["mean_step_s"] - 1.0
        else:
            out[f"reduction_vs_{name}"] = 1.0 - ours / s["mean_step_s"]
    return out


def async_comparison(policies: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    if "async_nereus" not in policies:
        return {}
    ours = policies["async_nereus"]["mean_step_s"]
    out = {f"async_nereus_reduction_vs_{name}": 1.0 - ours / policies[name]["mean_step_s"]
           for name in ("async_fixed", "nereus", "fixed") if name in policies}
    if "async_oracle" in policies:
        out["async_nereus_over_async_oracle"] = ours / policies["async_oracle"]["mean_step_s"] - 1.0
        if "async_fixed" in policies:
            out["async_oracle_reduction_vs_async_fixed"] = (
                1.0 - policies["async_oracle"]["mean_step_s"] / policies["async_fixed"]["mean_step_s"])
    return out


def table(sim: Simulation, runs: Mapping[str, PolicyRun]) -> str:
    """A fixed-width table, one row per policy, under the SIMULATED headline."""
    base = runs["fixed"].summary()["mean_step_s"] if "fixed" in runs else None
    rows = [("policy", "mean step s", "vs fixed", "transitions (tp/pp)", "transition s", "overhead", "OOM",
             "restarts", "decision ms/step")]
    for name, run in runs.items():
        s = run.summary()
        vs = f"{(s['mean_step_s'] / base - 1) * 100:+.1f}%" if base else "-"
        rows.append((name, f"{s['mean_step_s']:.1f}", vs, f"{s['transitions']} ({s['layout_transitions']})",
                     f"{s['transition_s']:.1f}", f"{s['overhead_fraction'] * 100:.3f}%", str(s["oom_events"]),
                     str(s["restarts"]), f"{s['decision_ms_mean']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    notes = [f"{name}: {run.notes['layouts']}" for name, run in runs.items() if run.notes.get("layouts")]
    return "\n".join([headline(sim), *lines, *(f"  pinned layouts of {n}" for n in notes)])


def sweep_table(sim: Simulation, key: str, rows: Sequence[tuple[Any, Mapping[str, PolicyRun]]]) -> str:
    lines = [headline(sim), f"sweep {key}:"]
    for value, runs in rows:
        cells = []
        for name, run in runs.items():
            s = run.summary()
            cells.append(f"{name} {s['mean_step_s']:.1f} s/step, {s['transitions']} transitions "
                         f"({s['layout_transitions']} tp/pp), {s['transition_s']:.1f} s moving")
        lines.append(f"  {key}={value}: " + "; ".join(cells))
    return "\n".join(lines)


def plot(sim: Simulation, runs: Mapping[str, PolicyRun], out: str | Path) -> Path | None:
    """Step latency (transition and wasted time included) per step and policy; transitions marked.
    None when matplotlib is not installed (it is a test extra, not a dependency)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(10, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, run in runs.items():
        steps = [r.step for r in run.records]
        ys = [r.latency_s + r.transition_s + r.wasted_s + r.fill_s for r in run.records]
        (line,) = ax.plot(steps, ys, label=f"{name} ({run.summary()['mean_step_s']:.0f} s/step)",
                          linestyle="--" if name == "oracle" else "-")
        moved = [(r.step, y, any("layout" in e for e in r.events)) for r, y in zip(run.records, ys, strict=True)
                 if any("transition" in e for e in r.events)]
        for marker, size, keep in (("o", 18, lambda m: True), ("^", 60, lambda m: m[2])):
            pts = [m for m in moved if keep(m)]
            ax.scatter([m[0] for m in pts], [m[1] for m in pts], marker=marker, s=size, color=line.get_color())
    ax2 = ax.twinx()
    ax2.step(range(sim.trace.steps), sim.trace.pools, where="post", color="grey", alpha=0.35, label="pool")
    ax2.set_ylabel("devices in the pool (grey)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("step latency incl. transitions, s")
    ax.set_title(f"{SIMULATED} on hardware table '{sim.hw.name}': {sim.trace.name}  "
                 "(o: transition, ^: tp/pp change)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
