"""What a run shows and writes: a progress bar (step, reward, accuracy, KL, response length, per-stage
seconds, plan), ``RUN_DIR/metrics.jsonl`` (one object a step), TensorBoard events (tensorboardX), a Weights &
Biases run (``logging.wandb``), ``summary.json`` and a final summary table. With several processes only
process 0 (``primary``) shows and writes anything; the others compute the same metrics and stay quiet."""

from __future__ import annotations

import importlib
import json
import os
import sys
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nereus_jax.config import ConfigError

TB_FLUSH_SECS = 2  # about the longest a step's TensorBoard scalars wait before they reach the disk


class RunReport:
    """Owns the run directory's outputs and the console. The console works from the start; the run
    directory is created by :meth:`open` (called once the inputs are checked, so a run that fails on its
    inputs leaves no directory behind) or by the first step or summary written.

    ``tensorboard``: write each step's scalars to ``RUN_DIR/tensorboard`` with tensorboardX. ``wandb``: the
    keyword arguments of ``wandb.init`` (``project``, ``mode``, ``config``), or None for no W&B run; the run's
    files go to ``$WANDB_DIR``, else ``RUN_DIR``. The packages are imported here, on every process, so a
    missing one stops the job (a ConfigError) before any work, and on all processes alike."""

    def __init__(self, run_dir: str, total_steps: int, *, progress: bool = True, tensorboard: bool = True,
                 wandb: dict[str, Any] | None = None, primary: bool = True):
        self.run_dir, self.primary, self.total_steps = run_dir, primary, total_steps
        self._want_progress, self._wandb_init = progress, wandb
        self._tbx = _require("tensorboardX", "logging.tensorboard", "pip install tensorboardX") if tensorboard else None
        self._wandb = _require("wandb", "logging.wandb", "pip install 'nereus-jax[wandb]'") if wandb else None
        self._metrics = self._tb = self._run = self._progress = None
        if primary:
            self.console = Console(stderr=True)

    def open(self) -> None:
        """Creates the run directory, the metrics file, the TensorBoard writer, the W&B run and the progress
        bar."""
        if not self.primary or self._metrics is not None:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        self._metrics = open(os.path.join(self.run_dir, "metrics.jsonl"), "a")  # noqa: SIM115 - closed in close()
        if self._tbx is not None:
            # tensorboardX writes from a thread, which flushes every flush_secs (its flush() does not wait for
            # that thread): a live TensorBoard sees a step within seconds; close() writes whatever is left
            self._tb = self._tbx.SummaryWriter(os.path.join(self.run_dir, "tensorboard"), flush_secs=TB_FLUSH_SECS)
        if self._wandb is not None:
            self._run = self._wandb.init(dir=os.environ.get("WANDB_DIR", self.run_dir),
                                         name=os.path.basename(os.path.abspath(self.run_dir)), **self._wandb_init)
        if self._want_progress:
            self._progress = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.description}"),
                                      console=self.console, transient=False, disable=not sys.stderr.isatty())
            self._task = self._progress.add_task("", total=self.total_steps)
            self._progress.start()

    def log(self, message: str) -> None:
        if self.primary:
            self.console.print(message)

    def step(self, metrics: dict[str, Any]) -> None:
        if not self.primary:
            return
        self.open()
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()
        step, flat = int(metrics["step"]), scalars(metrics)
        if self._tb is not None:
            for tag, value in flat.items():
                self._tb.add_scalar(tag, float(value), step)
        if self._run is not None:
            self._run.log(flat, step=step)
        line = _step_line(metrics)
        if self._progress is not None and not self._progress.disable:
            self._progress.update(self._task, advance=1, description=line)
        else:
            self.console.print(f"step {metrics['step']}: {line}")

    def finish(self, summary: dict[str, Any]) -> None:
        if not self.primary:
            return
        self.open()
        if self._progress is not None:
            self._progress.stop()
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if self._run is not None:
            self._run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        table = Table(title=f"nereus_jax run summary ({self.run_dir})")
        table.add_column("quantity")
        table.add_column("value", justify="right")
        for key, value in summary.items():
            if not isinstance(value, (dict, list)):
                table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
        self.console.print(table)
        self.close()

    def close(self) -> None:
        if not self.primary or self._metrics is None:
            return
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        if self._run is not None:
            self._run.finish()


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """A step's numbers as TensorBoard and W&B get them: the top-level numbers but ``step`` (the x axis),
    and ``stage_seconds/<stage>`` for each stage's seconds."""
    flat = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
    flat.update({f"stage_seconds/{k}": v for k, v in metrics.get("stage_seconds", {}).items()})
    return flat


def _require(module: str, key: str, install: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}=true needs the {module} package, which cannot be imported ({e}): "
                          f"{install}, or set {key}=false") from None


def _step_line(m: dict[str, Any]) -> str:
    stages = " ".join(f"{k}={v:.2f}s" for k, v in m.get("stage_seconds", {}).items())
    return (f"reward={m['reward_mean']:.3f} acc={m['accuracy']:.3f} kl={m['kl']:.4f} "
            f"len={m['response_length_mean']:.1f} | {stages} | plan {m.get('plan_short', '')}")
