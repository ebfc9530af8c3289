"""Drift traces: a YAML file per experiment (``configs/sim/*.yaml``) -> one :class:`Trace`.

A trace says what the simulated job runs (models, algorithm, batch), on which simulated cluster
(a hardware table entry), and what drifts step by step: the response-length distribution (mean, p95;
keyframes linearly interpolated, the max a fixed multiple of p95, a seeded per-step jitter) and the
device pool (keyframes: the device count available from that step on, ids 0..n-1), and for a
mixture-of-experts model the busiest expert's share of the routed tokens (``expert_load`` keyframes,
linearly interpolated: ``Workload.expert_load``). Keyframes past the last step still shape the
interpolation, so ``steps`` may be overridden to simulate a prefix. It also carries
the controller and planner settings and the ground truth's seed and noise.

Every value is checked when the trace is built, before anything is simulated: unknown keys, wrong types,
out-of-range settings, unknown hardware, algorithm or model presets, and sequences longer than a model's
``max_position_embeddings`` raise :class:`TraceError` naming the file, the key (and keyframe row) and
what to change.

    trace = load_trace("configs/sim/paper_drift.yaml", overrides={"controller.gamma": 0.25})
    trace.workload(3), trace.pool(3)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from nereus_jax._typed_tree import parse_yaml, show
from nereus_jax.config import ConfigError, config_dir, resolve_model
from nereus_jax.elastic.hardware import HardwareError, get_hardware
from nereus_jax.elastic.planner import phases_for
from nereus_jax.elastic.workload import LengthStats, Workload, WorkloadError
from nereus_jax.model_stage import job_roles, split_stage
from nereus_jax.rl.registry import ALGORITHMS

_TOP = {"name", "description", "hardware", "models", "algorithm", "steps", "workload", "response_length", "pool",
        "controller", "planner", "truth", "seed", "policies", "expert_load"}
_REQUIRED = ("steps", "hardware", "models", "workload", "response_length", "pool")
# The settings a trace may give the controller, the planner and the ground truth: key -> (kind, test, rule).
# Kinds: "real" (a finite number), "real|inf" (.inf allowed), "int", "bool", "range" ([low, high]).
_SETTINGS: dict[str, tuple[str, Callable[[Any], bool] | None, str]] = {
    "controller.gamma": ("real|inf", lambda v: v >= 0, ">= 0 (.inf admits any predicted gain)"),
    "controller.length_drift": ("real", lambda v: v >= 0, ">= 0 (a fraction of the reference length)"),
    "controller.expert_drift": ("real", lambda v: v >= 0, ">= 0 (a fraction of the reference expert load)"),
    "controller.efficiency_drift": ("real", lambda v: v >= 0, ">= 0 (a fraction)"),
    "controller.efficiency_window": ("int", lambda v: v >= 1, ">= 1 (steps)"),
    "controller.ema": ("real", lambda v: 0 < v <= 1, "in (0, 1]"),
    "controller.error_margin": ("bool", None, "true or false"),
    "planner.gap": ("real", lambda v: v >= 0, ">= 0 (a fraction of the optimum)"),
    "planner.max_nodes": ("int", lambda v: v >= 1, ">= 1"),
    "planner.headroom": ("real", lambda v: 0 <= v < 1, "in [0, 1) (a fraction of device memory)"),
    "truth.noise_cv": ("real", lambda v: v >= 0, ">= 0"),
    "truth.straggler_per_device": ("real", lambda v: 0 <= v <= 1, "in [0, 1] (a probability)"),
    "truth.straggler_slowdown": ("range", lambda v: 1 <= v[0] <= v[1], "[low, high] with 1 <= low <= high"),
    "truth.fragmentation": ("real", lambda v: v >= 0, ">= 0 (a fraction)"),
}
MAX_STEPS = 1_000_000  # a trace longer than this is a typo: the simulator plays every step
MAX_DEVICES = 1_000_000  # likewise for a pool: the planner enumerates the device ids
_SECTIONS = {
    "workload": {"prompts_per_step", "samples_per_prompt", "packed", "prompt_length", "mini_batches", "epochs",
                 "shard_optimizer"},
    "response_length": {"keyframes", "max_over_p95", "jitter"},
    "expert_load": {"keyframes"},
    **{s: {k.split(".")[1] for k in _SETTINGS if k.startswith(s + ".")} for s in ("controller", "planner", "truth")},
}


class TraceError(ValueError):
    """A trace file that cannot describe a run: the message names the file, the key and what to change."""


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
    if path.is_dir():
        raise TraceError(f"{name} is a directory: give a trace YAML file (e.g. configs/sim/paper_drift.yaml)")
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
    data = read_trace_file(path)
    try:
        for dotted, value in (overrides or {}).items():
            data = _override(data, dotted, value)
        return build_trace(data, source=str(path))
    except TraceError as error:
        raise TraceError(f"{path}: {error}") from None


def read_trace_file(path: Path) -> dict[str, Any]:
    """The top-level mapping of a trace YAML file (unreadable, non-text, invalid or non-mapping files raise)."""
    try:
        data = parse_yaml(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise TraceError(f"{path}: cannot read the trace file ({error.strerror})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a UTF-8 text file; give a trace YAML file") from None
    except yaml.YAMLError as error:
        raise TraceError(f"{path}: not valid YAML ({yaml_problem(error)}); fix the syntax there") from None
    if not isinstance(data, Mapping):
        raise TraceError(f"{path}: expected a mapping of trace keys at the top level (as in "
                         f"configs/sim/paper_drift.yaml), got {show(data)}")
    return dict(data)


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error on one line: where and what (PyYAML's own message spans several lines)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or " ".join(str(error).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


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
    data[section] = {**_section(data, section), key: value}
    return data


def build_trace(data: Mapping[str, Any], source: str = "") -> Trace:
    """A Trace from parsed YAML (see the module docstring); every value is checked here."""
    if not isinstance(data, Mapping):
        raise TraceError(f"expected a mapping of trace keys, got {show(data)}")
    unknown = set(data) - _TOP
    if unknown:
        raise TraceError(f"unknown trace keys {sorted(map(str, unknown))}; valid: {', '.join(sorted(_TOP))}")
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise TraceError(f"trace needs {', '.join(repr(k) for k in missing)} (see configs/sim/paper_drift.yaml)")
    sections = {s: _section(data, s) for s in _SECTIONS}
    steps = _integer(data["steps"], "steps", low=1, high=MAX_STEPS)
    seed = _integer(data.get("seed", 0), "seed", low=0)
    algorithm = _algorithm(data.get("algorithm", "ppo"))
    models = _models(data["models"], algorithm)
    workloads = _with_expert_load(_workloads(sections, steps, seed, algorithm), sections["expert_load"], models,
                                  algorithm)
    _check_context(workloads, models, algorithm)
    return Trace(
        name=str(data.get("name", Path(source).stem)), description=str(data.get("description", "")).strip(),
        hardware=_hardware(data["hardware"]), models=models, algorithm=algorithm, workloads=workloads,
        pools=_pools(data["pool"], steps), controller=_settings(sections, "controller"),
        planner=_settings(sections, "planner"), truth=_settings(sections, "truth"), seed=seed,
        policies=_policies(data.get("policies")), source=source)


def _section(data: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Section ``name`` as a mapping ({} if absent); not a mapping or unknown keys raise."""
    value = data.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TraceError(f"{name}: expected a mapping of {', '.join(sorted(_SECTIONS[name]))}, got {show(value)}")
    bad, valid = set(value) - _SECTIONS[name], ", ".join(sorted(_SECTIONS[name]))
    if bad:
        raise TraceError(f"unknown keys {sorted(map(str, bad))} in '{name}'; valid: {valid}")
    return dict(value)


# ------------------------------------------------------------------------------------- scalars
def _integer(value: Any, key: str, low: int | None = None, high: int | None = None) -> int:
    bad = isinstance(value, bool) or not isinstance(value, int)
    if bad or (low is not None and value < low) or (high is not None and value > high):
        bound = "" if low is None else f" >= {low}" if high is None else f" in [{low}, {high}]"
        raise TraceError(f"{key}: expected an integer{bound}, got {show(value)}")
    return value


def _number(value: Any, key: str, allow_inf: bool = False) -> float:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**1000:
        value = float(value)
    if not isinstance(value, float) or math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise TraceError(f"{key}: expected a {'number' if allow_inf else 'finite number'}, got {show(value)}")
    return value


def _boolean(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise TraceError(f"{key}: expected true or false, got {show(value)}")
    return value


def _range(value: Any, key: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TraceError(f"{key}: expected [low, high], got {show(value)}")
    return _number(value[0], f"{key}[0]"), _number(value[1], f"{key}[1]")


_KINDS: dict[str, Callable[[Any, str], Any]] = {
    "real": _number, "real|inf": lambda v, k: _number(v, k, allow_inf=True), "int": _integer, "bool": _boolean,
    "range": _range}


def _settings(sections: Mapping[str, Mapping[str, Any]], section: str) -> dict[str, Any]:
    """The checked values of a controller/planner/truth section (each key's kind and range in _SETTINGS)."""
    out = {}
    for name, raw in sections[section].items():
        key = f"{section}.{name}"
        kind, test, rule = _SETTINGS[key]
        value = _KINDS[kind](raw, key)
        if test is not None and not test(value):
            raise TraceError(f"{key}: must be {rule}, got {show(raw)}")
        out[name] = value
    return out


# ---------------------------------------------------------------------------- names and presets
def _hardware(value: Any) -> str:
    try:
        return get_hardware(str(value)).name
    except HardwareError as error:
        raise TraceError(f"hardware: {error}") from None


def _algorithm(value: Any) -> str:
    if value not in ALGORITHMS:
        raise TraceError(f"algorithm: unknown algorithm {show(value)}; valid: {', '.join(sorted(ALGORITHMS))}")
    return value


def _models(value: Any, algorithm: str) -> dict[str, str]:
    """Role -> preset name: one name for every role, or a mapping with a preset per role the algorithm runs."""
    roles = job_roles()  # of the declared model-stages
    if isinstance(value, str):
        value = dict.fromkeys(roles, value)
    if not isinstance(value, Mapping):
        raise TraceError(f"models: expected a preset name or a mapping of role -> preset ({', '.join(roles)}), "
                         f"got {show(value)}")
    unknown = set(value) - set(roles)
    if unknown:
        raise TraceError(f"models: unknown roles {sorted(map(str, unknown))}; valid: {', '.join(roles)}")
    missing = [r for r in _roles(algorithm) if r not in value]
    if missing:
        raise TraceError(f"models: algorithm {algorithm} needs a preset for role(s) {', '.join(missing)}")
    for role, name in value.items():
        _preset(name, f"models.{role}")
    return dict(value)


def _roles(algorithm: str) -> list[str]:
    """The roles whose models the algorithm's model-stages run."""
    return sorted({split_stage(stage)[0] for phase in phases_for(algorithm) for stage in phase})


def _preset(name: Any, key: str):
    if not isinstance(name, str):
        raise TraceError(f"{key}: expected a model preset name, got {show(name)}")
    try:
        return resolve_model(name)
    except ConfigError as error:
        raise TraceError(f"{key}: {error}") from None


def _policies(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise TraceError(f"policies: expected a list of policy names (e.g. [fixed, nereus, oracle]), got {show(value)}")
    return tuple(value)


# ---------------------------------------------------------------------------- keyframes and workloads
def _keyframes(frames: Any, what: str, values: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(row key, frame) sorted by step: each frame a mapping of exactly step + ``values``, the first at step 0."""
    shape = "{step: N, " + ", ".join(f"{v}: ..." for v in values) + "}"
    if not frames or not isinstance(frames, list):
        raise TraceError(f"{what}: expected a list of keyframes ({shape}), got {show(frames)}")
    rows = []
    for i, frame in enumerate(frames):
        key = f"{what}[{i}]"
        if not isinstance(frame, Mapping) or set(frame) != {"step", *values}:
            raise TraceError(f"{key}: expected a keyframe {shape}, got {show(frame)}")
        rows.append((key, {**frame, "step": _integer(frame["step"], f"{key}.step", low=0)}))
    rows.sort(key=lambda row: row[1]["step"])
    for (_, a), (key, b) in zip(rows, rows[1:], strict=False):
        if a["step"] == b["step"]:
            raise TraceError(f"{key}: a second keyframe at step {b['step']}; give one keyframe per step")
    if rows[0][1]["step"] != 0:
        raise TraceError(f"{rows[0][0]}: the first keyframe must be at step 0, got {rows[0][1]['step']}")
    return rows


def _interpolate(frames: list[dict], key: str, steps: int) -> np.ndarray:
    xs = [f["step"] for f in frames]
    return np.interp(np.arange(steps), xs, [f[key] for f in frames])


def _response_frames(section: Mapping[str, Any]) -> list[dict]:
    rows = _keyframes(section.get("keyframes"), "response_length.keyframes", ("mean", "p95"))
    for key, frame in rows:
        frame["mean"], frame["p95"] = _number(frame["mean"], f"{key}.mean"), _number(frame["p95"], f"{key}.p95")
        if not 1 <= frame["mean"] <= frame["p95"]:
            raise TraceError(f"{key}: need 1 <= mean <= p95 (tokens), got mean={frame['mean']:g}, p95={frame['p95']:g}")
    return [frame for _, frame in rows]


def _prompt_length(value: Any) -> LengthStats:
    key = "workload.prompt_length"
    if not isinstance(value, Mapping) or set(value) != {"mean", "p95", "max"}:
        raise TraceError(f"{key}: expected {{mean: N, p95: N, max: N}} (tokens), got {show(value)}")
    try:
        return LengthStats(_number(value["mean"], f"{key}.mean"), _number(value["p95"], f"{key}.p95"),
                           _integer(value["max"], f"{key}.max", low=1))
    except WorkloadError as error:
        raise TraceError(f"{key}: {error}") from None


def _spread(section: Mapping[str, Any]) -> tuple[float, float]:
    """response_length's max_over_p95 (the longest response / p95) and jitter (a per-step lognormal sigma)."""
    ratio = _number(section.get("max_over_p95", 1.15), "response_length.max_over_p95")
    jitter = _number(section.get("jitter", 0.0), "response_length.jitter")
    if not 1 <= ratio <= 100:
        raise TraceError(f"response_length.max_over_p95: must be in [1, 100] (longest response / p95), got {ratio:g}")
    if not 0 <= jitter <= 1:
        raise TraceError(f"response_length.jitter: must be in [0, 1] (a lognormal sigma), got {jitter:g}")
    return ratio, jitter


def _batch(section: Mapping[str, Any], algorithm: str) -> dict[str, Any]:
    """The workload section's Workload keywords except the lengths."""
    prompts = _integer(section.get("prompts_per_step", 1024), "workload.prompts_per_step", low=1)
    samples = _integer(section.get("samples_per_prompt", 1), "workload.samples_per_prompt", low=1)
    if ALGORITHMS[algorithm].needs_group and samples < 2:
        raise TraceError(f"workload.samples_per_prompt: algorithm {algorithm} compares a prompt's samples; "
                         f"set it >= 2, got {samples}")
    packed = _boolean(section.get("packed", True), "workload.packed")
    mini_batches = _integer(section.get("mini_batches", 1), "workload.mini_batches", low=1)
    if (prompts * samples) % mini_batches:
        raise TraceError(f"workload.mini_batches: {mini_batches} optimizer updates a step must split the step's "
                         f"{prompts * samples} sequences evenly; use a divisor of it")
    epochs = _integer(section.get("epochs", 1), "workload.epochs", low=1)
    shard = _boolean(section.get("shard_optimizer", False), "workload.shard_optimizer")
    return {"prompts_per_step": prompts, "samples_per_prompt": samples, "packed": packed, "mini_batches": mini_batches,
            "epochs": epochs, "shard_optimizer": shard}


def _workloads(sections: Mapping[str, Mapping[str, Any]], steps: int, seed: int,
               algorithm: str) -> tuple[Workload, ...]:
    frames = _response_frames(sections["response_length"])
    ratio, jitter = _spread(sections["response_length"])
    batch, prompt = _batch(sections["workload"], algorithm), _prompt_length(sections["workload"].get("prompt_length"))
    mean, p95 = _interpolate(frames, "mean", steps).tolist(), _interpolate(frames, "p95", steps).tolist()
    noise = np.random.default_rng([seed, 1]).normal(0.0, jitter, steps).tolist() if jitter else [0.0] * steps
    out = []
    for step, (m, p, e) in enumerate(zip(mean, p95, noise, strict=True)):
        factor = math.exp(e)
        try:
            response = LengthStats(round(m * factor, 1), round(p * factor, 1), int(math.ceil(p * factor * ratio)))
        except (WorkloadError, OverflowError) as error:
            raise TraceError(f"response_length at step {step}: {error}; change its keyframes") from None
        out.append(Workload(prompt_length=prompt, response_length=response, **batch))
    return tuple(out)


def _with_expert_load(workloads: tuple[Workload, ...], section: Mapping[str, Any], models: Mapping[str, str],
                      algorithm: str) -> tuple[Workload, ...]:
    """Each step's workload with its busiest-expert share from the ``expert_load`` keyframes (none: balanced)."""
    if not section:
        return workloads
    rows = _keyframes(section.get("keyframes"), "expert_load.keyframes", ("share",))
    dense = [r for r in _roles(algorithm) if not _preset(models[r], f"models.{r}").num_experts]
    if dense:
        raise TraceError(f"expert_load: models.{dense[0]} '{models[dense[0]]}' is not a mixture of experts; drop "
                         "expert_load or use a mixture-of-experts preset (e.g. qwen3-30b-a3b)")
    top = min(1.0 / _preset(models[r], f"models.{r}").num_experts_per_tok for r in _roles(algorithm))
    for key, frame in rows:
        frame["share"] = _number(frame["share"], f"{key}.share")
        if not 0 < frame["share"] <= top:
            raise TraceError(f"{key}.share: the busiest expert's share of routed tokens must be in (0, {top:g}] (a "
                             f"token's top-k experts are distinct: one expert gets at most 1 / num_experts_per_tok), "
                             f"got {frame['share']:g}")
    shares = _interpolate([frame for _, frame in rows], "share", len(workloads)).tolist()
    return tuple(wl.with_expert_load(share) for wl, share in zip(workloads, shares, strict=True))


def _check_context(workloads: tuple[Workload, ...], models: Mapping[str, str], algorithm: str) -> None:
    """Every step's longest prompt + response fits the context of every model the algorithm runs."""
    limit, role = min((_preset(models[r], f"models.{r}").max_position_embeddings, r) for r in _roles(algorithm))
    for step, wl in enumerate(workloads):
        if wl.max_tokens > limit:
            raise TraceError(
                f"response_length: at step {step} the longest response ({wl.response_length.max} tokens = p95 x "
                f"max_over_p95, jitter included) + workload.prompt_length.max ({wl.prompt_length.max}) = "
                f"{wl.max_tokens} exceeds max_position_embeddings ({limit}) of models.{role} "
                f"'{models[role]}': lower the keyframes' p95 or max_over_p95, or use a longer-context model")


def _pools(frames: Any, steps: int) -> tuple[int, ...]:
    rows = _keyframes(frames, "pool", ("devices",))
    for key, frame in rows:
        frame["devices"] = _integer(frame["devices"], f"{key}.devices", low=1, high=MAX_DEVICES)
    out, i = [], 0
    for step in range(steps):
        while i + 1 < len(rows) and rows[i + 1][1]["step"] <= step:
            i += 1
        out.append(rows[i][1]["devices"])
    return tuple(out)
