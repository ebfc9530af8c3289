"""Plot a finished (or running) job's metrics: reward and accuracy, KL, response length, per-stage seconds.

    python tools/plot_run.py RUN_DIR                   # writes RUN_DIR/run.png
    python tools/plot_run.py RUN_DIR --out plot.png    # somewhere else

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object a step, as ``python -m nereus_jax.train`` writes it: at
least ``step``, ``reward_mean``, ``accuracy``, ``kl``, ``response_length_mean``; ``stage_seconds`` is a dict
model-stage -> seconds) and, when present, ``RUN_DIR/summary.json`` (its held-out accuracies are drawn as
dashed lines, its headline numbers go in the title). Draws one PNG with four panels, with matplotlib's Agg
backend only (no display needed, and no global pyplot state is touched, so notebooks can import it).

A missing or empty ``metrics.jsonl`` or a malformed line exits with status 2 and a message naming the file,
the line and the fix. From Python: ``plot_run(run_dir, out=None) -> path of the PNG``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

REQUIRED_KEYS = ("step", "reward_mean", "accuracy", "kl", "response_length_mean")


class PlotRunError(ValueError):
    """Bad input to the plot: the message names the file and what to do."""


def load_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The step records of ``RUN_DIR/metrics.jsonl`` in file order, each checked for the keys the plot needs."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isdir(run_dir):
        raise PlotRunError(f"run directory {run_dir!r} does not exist: give the RUN_DIR a job wrote "
                           "(python -m nereus_jax.train --run-dir RUN_DIR)")
    if not os.path.isfile(path):
        raise PlotRunError(f"{path} not found: RUN_DIR must be the folder of a run of python -m nereus_jax.train "
                           "(it writes metrics.jsonl there as soon as the first RL step ends)")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlotRunError(f"{path}, line {number}: not valid JSON ({e.msg}): {line.strip()[:80]!r}; "
                                   "each line must be one JSON object; delete or repair that line (a run killed "
                                   "mid-write can leave a truncated last line)") from None
            if not isinstance(record, dict):
                raise PlotRunError(f"{path}, line {number}: expected a JSON object (one step), got "
                                   f"{type(record).__name__}; delete or repair that line")
            missing = [k for k in REQUIRED_KEYS if k not in record]
            if missing:
                raise PlotRunError(f"{path}, line {number}: missing {', '.join(missing)} (a step needs "
                                   f"{', '.join(REQUIRED_KEYS)}); was it written by python -m nereus_jax.train?")
            for key in REQUIRED_KEYS:
                if not _is_number(record[key]):
                    raise PlotRunError(f"{path}, line {number}: {key}={record[key]!r} is not a finite number; "
                                       "repair or delete that line")
            stages = record.get("stage_seconds", {})
            if not isinstance(stages, dict) or not all(_is_number(v) for v in stages.values()):
                raise PlotRunError(f"{path}, line {number}: stage_seconds must map stage names to seconds, "
                                   f"got {stages!r}; repair or delete that line")
            records.append(record)
    if not records:
        raise PlotRunError(f"{path} is empty: the run has not finished a step yet; wait for the first step, or "
                           "start one with python -m nereus_jax.train --run-dir RUN_DIR trainer.steps=N")
    return records


def load_summary(run_dir: str) -> dict[str, Any] | None:
    """``RUN_DIR/summary.json`` (written when a run ends), or None if it is not there yet."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except json.JSONDecodeError as e:
        raise PlotRunError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); repair it, or delete it to plot "
                           "the metrics without the summary") from None
    if not isinstance(summary, dict):
        raise PlotRunError(f"{path}: expected a JSON object, got {type(summary).__name__}; repair or delete it")
    return summary


def stage_series(records: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Seconds per step for every stage seen in any step (first-seen order); 0 where a step lacks it."""
    names: list[str] = []
    for r in records:
        names += [k for k in r.get("stage_seconds", {}) if k not in names]
    return {n: [float(r.get("stage_seconds", {}).get(n, 0.0)) for r in records] for n in names}


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Draw RUN_DIR's metrics into one PNG (default ``RUN_DIR/run.png``); returns its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = load_metrics(run_dir)
    summary = load_summary(run_dir)
    out = os.path.join(run_dir, "run.png") if out is None else out
    steps = [r["step"] for r in records]

    fig = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(fig)
    (ax_reward, ax_kl), (ax_len, ax_time) = fig.subplots(2, 2, sharex=True)

    # Wide and light under a thin line: on tasks whose reward is 1 exactly when correct, the two coincide.
    ax_reward.plot(steps, [r["reward_mean"] for r in records], linewidth=4, alpha=0.4, label="reward (mean)")
    ax_reward.plot(steps, [r["accuracy"] for r in records], marker=".", label="accuracy (sampled responses)")
    if summary is not None:
        for key, color, style in (("accuracy_before", "tab:purple", ":"), ("accuracy_after", "gray", "--")):
            if _is_number(summary.get(key)):
                ax_reward.axhline(summary[key], color=color, linestyle=style, linewidth=2 if style == ":" else 1.5,
                                  label=f"held-out (greedy) {key.removeprefix('accuracy_')} RL: {summary[key]:.3f}")
    ax_reward.set_title("reward and accuracy")
    ax_reward.legend(fontsize="small")

    ax_kl.plot(steps, [r["kl"] for r in records], marker=".", color="tab:red")
    ax_kl.set_title("KL to the reference")

    ax_len.plot(steps, [r["response_length_mean"] for r in records], marker=".", color="tab:green")
    ax_len.set_title("response length (mean tokens)")

    stages = stage_series(records)
    if stages:
        ax_time.stackplot(steps, list(stages.values()), labels=list(stages), alpha=0.8)
        ax_time.legend(fontsize="small", loc="upper right")
        totals = [sum(values) for values in zip(*stages.values(), strict=True)]
        if len(totals) >= 3 and totals[0] > 4 * max(statistics.median(totals[1:]), 1e-9):
            # The first step compiles everything; clip it so the steady-state steps stay readable.
            ax_time.set_ylim(0, 1.5 * max(totals[1:]))
            ax_time.annotate(f"step {steps[0]}: {totals[0]:.1f} s (compilation; clipped)", xy=(steps[0], 0),
                             xytext=(0.02, 0.92), textcoords="axes fraction", fontsize="small",
                             bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    else:
        ax_time.text(0.5, 0.5, "no stage_seconds in metrics.jsonl", ha="center", va="center",
                     transform=ax_time.transAxes)
    ax_time.set_title("seconds per step, by stage (stacked)")

    for ax in (ax_len, ax_time):
        ax.set_xlabel("RL step")
    for ax in (ax_reward, ax_kl, ax_len, ax_time):
        ax.grid(alpha=0.3)
    fig.suptitle(_title(run_dir, summary, len(records)))

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100, format="png")
    return out


def _title(run_dir: str, summary: dict[str, Any] | None, num_steps: int) -> str:
    if summary is None:
        return f"{run_dir}: {num_steps} steps (no summary.json yet)"
    head = " / ".join(str(summary[k]) for k in ("algorithm", "model", "task") if k in summary) or run_dir
    parts = [head, f"{num_steps} steps"]
    if _is_number(summary.get("accuracy_before")) and _is_number(summary.get("accuracy_after")):
        parts.append(f"held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}")
    if _is_number(summary.get("wall_s")):
        parts.append(f"{summary['wall_s']:.0f} s wall")
    return ", ".join(parts)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not (
        isinstance(value, float) and math.isinf(value))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot a nereus_jax run's metrics.jsonl into one PNG.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="folder holding metrics.jsonl (and summary.json)")
    parser.add_argument("--out", metavar="FILE.png", default=None, help="output PNG (default RUN_DIR/run.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except PlotRunError as e:
        print(f"plot_run: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
