"""Drift traces: a YAML file per experiment (``configs/sim/*.yaml``) -> one :class:`Trace`.

A trace says what the simulated job runs (models, algorithm, batch), on which simulated cluster
(a hardware table entry), and what drifts step by step: the response-length distribution (mean, p95;
keyframes linearly interpolated, the max a fixed multiple of p95, a seeded per-step jitter) and the
device pool (keyframes: the device count available from that step on, ids 0..n-1). Keyframes past the last
step still shape the interpolation, so ``steps`` may be overridden to simulate a prefix. It also carries
the controller and planner settings and the ground truth's seed and noise. Unknown keys are errors.

    trace = load_trace("configs/sim/paper_drift.yaml", overrides={"controller.gamma": 0.25})
    trace.workload(3), trace.pool(3)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from nereus_jax.config import config_dir
from nereus_jax.elastic.workload import LengthStats, Workload

ROLES = ("actor", "critic", "ref", "reward")
_TOP = {"name", "description", "hardware", "models", "algorithm", "steps", "workload", "response_length", "pool",
        "controller", "planner", "truth", "seed", "policies"}
_SECTIONS = {
    "workload": {"prompts_per_step", "samples_per_prompt", "packed", "prompt_length"},
    "response_length": {"keyframes", "max_over_p95", "jitter"},
    "controller": {"gamma", "length_drift", "efficiency_drift", "efficiency_window", "ema", "error_margin"},
    "planner": {"gap", "max_nodes", "headroom"},
    "truth": {"noise_cv", "straggler_per_device", "straggler_slowdown", "fragmentation"},
}


class TraceError(ValueError):
    """A trace file that cannot describe a run: the message names the key to change."""


@dataclass(frozen=True)
class Trace:
    """One simulated experiment, step by step."""

    name: str
    description: str
    hardware: str
    models: Mapping[str, str]                 # role -> model preset name
    algorithm: str
    workloads: tuple[Workload, ...]           # per step: what the step actually generated
    pools: tuple[int, ...]                    # per step: devices available (ids 0..n-1)
    controller: Mapping[str, float] = field(default_factory=dict)
    planner: Mapping[str, float] = field(default_factory=dict)
    truth: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0
    policies: tuple[str, ...] = ()
    source: str = ""

    @property
    def steps(self) -> int:
        return len(self.workloads)

    def workload(self, step: int) -> Workload:
        return self.workloads[step]

    def pool(self, step: int) -> tuple[int, ...]:
        return tuple(range(self.pools[step]))

    def pool_changes(self) -> int:
        return sum(a != b for a, b in zip(self.pools, self.pools[1:], strict=False))


def resolve_trace_path(name: str | Path) -> Path:
    """A path as given, else ``config_dir()/sim/<name>.yaml`` (a bare name such as ``paper_drift``)."""
    path = Path(name)
    if path.is_file():
        return path
    packaged = config_dir() / "sim" / f"{path.stem}.yaml"
    if packaged.is_file():
        return packaged
    known = ", ".join(sorted(p.stem for p in (config_dir() / "sim").glob("*.yaml")))
    raise TraceError(f"no trace file '{name}'; give a path or one of: {known}")


def load_trace(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Trace:
    """Read a trace file; ``overrides`` maps dotted keys (``controller.gamma``) to values."""
    path = resolve_trace_path(path)
    data = yaml.safe_load(path.read_text())
    for dotted, value in (overrides or {}).items():
        data = _override(data, dotted, value)
    return build_trace(data, source=str(path))


def _override(data: dict, dotted: str, value: Any) -> dict:
    data = copy.deepcopy(data)
    section, _, key = dotted.partition(".")
    if not key:
        if section not in _TOP:
            raise TraceError(f"unknown trace key '{dotted}'; valid: {', '.join(sorted(_TOP))}")
        data[section] = value
        return data
    if section not in _SECTIONS or key not in _SECTIONS[section]:
        valid = sorted(f"{s}.{k}" for s, ks in _SECTIONS.items() for k in ks)
        raise TraceError(f"unknown trace key '{dotted}'; valid: {', '.join(valid)}")
    data.setdefault(section, {})[key] = value
    return data


def build_trace(data: Mapping[str, Any], source: str = "") -> Trace:
    """A Trace from parsed YAML (see the module docstring)."""
    unknown = set(data) - _TOP
    if unknown:
        raise TraceError(f"unknown trace keys {sorted(unknown)}; valid: {', '.join(sorted(_TOP))}")
    for section, keys in _SECTIONS.items():
        bad = set(data.get(section) or {}) - keys
        if bad:
            raise TraceError(f"unknown keys {sorted(bad)} in '{section}'; valid: {', '.join(sorted(keys))}")
    steps = int(_need(data, "steps"))
    if steps < 1:
        raise TraceError(f"steps must be >= 1, got {steps}")
    seed = int(data.get("seed", 0))
    models = data.get("models") or {}
    models = {r: models for r in ROLES} if isinstance(models, str) else dict(models)
    return Trace(
        name=str(data.get("name", Path(source).stem)), description=str(data.get("description", "")).strip(),
        hardware=str(_need(data, "hardware")), models=models, algorithm=str(data.get("algorithm", "ppo")),
        workloads=_workloads(data, steps, seed), pools=_pools(_need(data, "pool"), steps),
        controller=dict(data.get("controller") or {}), planner=dict(data.get("planner") or {}),
        truth=dict(data.get("truth") or {}), seed=seed, policies=tuple(data.get("policies") or ()), source=source)


def _need(data: Mapping[str, Any], key: str) -> Any:
    if key not in data:
        raise TraceError(f"trace needs '{key}'")
    return data[key]


def _keyframes(frames: Any, steps: int, what: str) -> list[dict]:
    if not frames or not isinstance(frames, list):
        raise TraceError(f"'{what}' needs a list of keyframes ({{step: N, ...}})")
    frames = sorted((dict(f) for f in frames), key=lambda f: f["step"])
    if frames[0]["step"] != 0:
        raise TraceError(f"'{what}': the first keyframe must be at step 0, got {frames[0]['step']}")
    return frames


def _interpolate(frames: list[dict], key: str, steps: int) -> np.ndarray:
    xs = [f["step"] for f in frames]
    return np.interp(np.arange(steps), xs, [float(f[key]) for f in frames])


def _workloads(data: Mapping[str, Any], steps: int, seed: int) -> tuple[Workload, ...]:
    wl = dict(_need(data, "workload"))
    rl = dict(_need(data, "response_length"))
    frames = _keyframes(rl.get("keyframes"), steps, "response_length.keyframes")
    mean, p95 = _interpolate(frames, "mean", steps), _interpolate(frames, "p95", steps)
    ratio, jitter = float(rl.get("max_over_p95", 1.15)), float(rl.get("jitter", 0.0))
    noise = np.random.default_rng([seed, 1]).normal(0.0, jitter, steps) if jitter else np.zeros(steps)
    pl = dict(wl.get("prompt_length") or {})
    try:
        prompt = LengthStats(float(pl["mean"]), float(pl["p95"]), int(pl["max"]))
    except KeyError as missing:
        raise TraceError(f"workload.prompt_length needs mean, p95 and max ({missing} missing)") from None
    out = []
    for m, p, e in zip(mean, p95, noise, strict=True):
        factor = math.exp(e)
        top = int(math.ceil(p * factor * ratio))
        response = LengthStats(round(m * factor, 1), round(p * factor, 1), top)
        out.append(Workload(int(wl.get("prompts_per_step", 1024)), prompt, response,
                            int(wl.get("samples_per_prompt", 1)), packed=bool(wl.get("packed", True))))
    return tuple(out)


def _pools(frames: Any, steps: int) -> tuple[int, ...]:
    frames = _keyframes(frames, steps, "pool")
    out, i = [], 0
    for step in range(steps):
        while i + 1 < len(frames) and frames[i + 1]["step"] <= step:
            i += 1
        n = int(frames[i]["devices"])
        if n < 1:
            raise TraceError(f"pool: {n} devices at step {step}; a pool needs at least 1")
        out.append(n)
    return tuple(out)
