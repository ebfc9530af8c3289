"""A run's calibrated cost model on disk: RUN_DIR/calibration.json, read back by ``python -m nereus_jax.plan
--calibration RUN_DIR`` so what-if planning uses the efficiencies and size terms a run measured.

    save_calibration("runs/demo", adapter.pricer.cost, steps=200, model="llama3.1-8b")
    planner = Planner(load_calibration("runs/demo"))

The file is one JSON object: ``format`` (this module's :data:`FORMAT`), ``hardware`` (the table entry the run
was priced on), ``efficiency`` (large-call efficiency per class), ``half_sizes`` (n_1/2 per size term) and
whatever the writer adds (``steps``, ``model``). Floats are written as Python's shortest repr, so a load gives
the saved values exactly. A write goes to a temporary file in the same folder that replaces the old one
(``os.replace``): a killed run leaves the previous file or the new one, never half a file. No JAX here.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any

from nereus_jax.elastic.costs.latency import SIZE_TERMS
from nereus_jax.elastic.costs.model import CostModel
from nereus_jax.elastic.hardware import EFFICIENCY_CLASSES, HardwareError, get_hardware

FORMAT = 1
FILENAME = "calibration.json"
_CORE = ("format", "hardware", "efficiency", "half_sizes")


class CalibrationError(ValueError):
    """A calibration file that cannot be used (the message names the path and the problem)."""


def calibration_path(path: str | os.PathLike) -> str:
    """The file ``path`` names: ``path``/calibration.json for a (run) directory, else ``path`` itself."""
    path = os.fspath(path)
    return os.path.join(path, FILENAME) if os.path.isdir(path) else path


def calibration_data(cost_model: CostModel, **meta: Any) -> dict[str, Any]:
    """The file's object for ``cost_model``; ``meta`` (e.g. ``steps``, ``model``) is added after the core keys."""
    clash = sorted(set(meta) & set(_CORE))
    if clash:
        raise ValueError(f"meta keys {clash} would overwrite the calibration itself")
    return {"format": FORMAT, "hardware": cost_model.hardware.name, "efficiency": cost_model.efficiency,
            "half_sizes": cost_model.half_sizes, **meta}


def save_calibration(path: str | os.PathLike, cost_model: CostModel, **meta: Any) -> str:
    """Write ``cost_model``'s calibration to ``path`` (a directory: ``path``/calibration.json) atomically;
    returns the file's path."""
    target = calibration_path(path)
    text = json.dumps(calibration_data(cost_model, **meta), indent=2, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                               dir=os.path.dirname(target) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def _numbers(path: str, key: str, values: Any, valid: tuple[str, ...], what: str, ok, bound: str) -> dict:
    if not isinstance(values, dict):
        raise CalibrationError(f"{path}: '{key}' must be an object ({what} -> number), got {type(values).__name__}")
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise CalibrationError(f"{path}: unknown {what} {unknown} in '{key}'; valid: {', '.join(valid)}")
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
            raise CalibrationError(f"{path}: {key}.{name} must be a finite number {bound}, got {v!r}")
    return {name: float(v) for name, v in values.items()}


def read_calibration(path: str | os.PathLike) -> dict[str, Any]:
    """The checked contents of the calibration at ``path`` (a run directory or the file); a
    :class:`CalibrationError` naming the path and the problem if it is missing, not JSON, of another format
    version, or names an unknown hardware, efficiency class or size term."""
    given = os.fspath(path)
    file = calibration_path(given)
    if not os.path.exists(file):
        if os.path.isdir(given):
            raise CalibrationError(f"{given}: no {FILENAME} in this directory (a run writes it when it finishes "
                                   "or stops): give a finished run's directory or the JSON file itself")
        raise CalibrationError(f"{file}: no such file or directory")
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"{file}: cannot be read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{file}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"{file}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise CalibrationError(f"{file}: calibration format {data.get('format')!r} is not supported (this "
                               f"version reads format {FORMAT}); rerun the job with this version to write one")
    if not isinstance(data.get("hardware"), str):
        raise CalibrationError(f"{file}: 'hardware' must name a hardware table entry, got {data.get('hardware')!r}")
    try:
        hardware = get_hardware(data["hardware"]).name
    except HardwareError as e:
        raise CalibrationError(f"{file}: {e}") from None
    efficiency = _numbers(file, "efficiency", data.get("efficiency"), EFFICIENCY_CLASSES, "efficiency class",
                          lambda v: v > 0, "> 0")
    half_sizes = _numbers(file, "half_sizes", data.get("half_sizes", {}), SIZE_TERMS, "size term",
                          lambda v: v >= 0, ">= 0")
    return {**data, "hardware": hardware, "efficiency": efficiency, "half_sizes": half_sizes, "path": file}


def load_calibration(path: str | os.PathLike) -> CostModel:
    """A CostModel with the calibration at ``path`` (a run directory or the file): its hardware table entry,
    efficiencies and n_1/2; classes or terms the file lacks keep the table's priors."""
    data = read_calibration(path)
    return CostModel(data["hardware"], data["efficiency"], data["half_sizes"])


__all__ = ["FILENAME", "FORMAT", "CalibrationError", "calibration_data", "calibration_path", "load_calibration",
           "read_calibration", "save_calibration"]
