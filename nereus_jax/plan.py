"""What-if planning without GPUs: model + algorithm + cluster + workload -> the chosen execution plan.

    python -m nereus_jax.plan --model llama3.1-8b --algorithm ppo --gpus 64 --hardware h200 --response-length 4096
    python -m nereus_jax.plan --model qwen2.5-1.5b --algorithm grpo --gpus 16 --hardware a100 \\
        --response-length 2048 --prompt-length 1024 --batch 128 --samples-per-prompt 8 --json
    python -m nereus_jax.plan --model llama3.1-8b --gpus 64 --calibration runs/demo

Prints the plan as a table (per model-stage: tp, pp, ep, dp, micro-batch, remat, devices and predicted
seconds; ep > 1 only for a mixture of experts' scoring and training), memory per GPU, the predicted step
latency and how long the decision took; ``--json`` prints
one JSON object instead (``plan``, ``step_latency_s``, ``stage_latency_s``, ``memory_per_device_bytes``,
``decision_ms``, ``calibration``, ...). ``--calibration RUN_DIR`` (or the run's calibration.json) plans with
the efficiencies and size terms (n_1/2) a finished run calibrated instead of the hardware table's priors, on
that run's hardware; the table's header and the JSON's ``calibration`` (null without one) name the file.
Every prompt and response has the given length (the worst case the cost model plans for). Exit status:
0 planned, 1 no plan fits (the message names the model-stage and bytes short), 2 bad arguments (one line on
stderr naming the flag and what to change; nothing is planned).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from nereus_jax.config import ConfigError, available_models, resolve_model
from nereus_jax.elastic.costs.calibration_file import CalibrationError, read_calibration
from nereus_jax.elastic.costs.model import CostModel
from nereus_jax.elastic.hardware import HARDWARE, HardwareError, get_hardware
from nereus_jax.elastic.planner import InfeasiblePlanError, Planner, PlanResult
from nereus_jax.elastic.workload import Workload, WorkloadError
from nereus_jax.rl.registry import ALGORITHMS, algorithm_spec

GIB = 2**30


class PlanArgumentError(ValueError):
    """Command-line values that cannot describe a planning problem (the message names the flag to change)."""


class _Parser(argparse.ArgumentParser):
    """Argument errors on one line, like every other bad input (argparse prints its usage block first)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m nereus_jax.plan", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3.1-8b", help=f"model preset ({', '.join(available_models())})")
    p.add_argument("--algorithm", default="ppo", help=f"RL algorithm ({', '.join(ALGORITHMS)})")
    p.add_argument("--gpus", type=int, default=64, help="devices in the pool")
    p.add_argument("--hardware", default=None,
                   help=f"hardware table entry ({', '.join(HARDWARE)}; default: the calibration's, else h200)")
    p.add_argument("--calibration", default=None, metavar="RUN_DIR",
                   help="plan with the cost model a run calibrated: its directory (calibration.json in it) or the "
                        "file; default: the hardware table's priors")
    p.add_argument("--response-length", type=int, default=4096, help="tokens per response")
    p.add_argument("--prompt-length", type=int, default=512, help="tokens per prompt")
    p.add_argument("--batch", type=int, default=512, help="prompts per RL step")
    p.add_argument("--samples-per-prompt", type=int, default=None,
                   help="responses per prompt (default: 8 for grpo/rloo, 1 otherwise)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="plan for LoRA adapters of this rank on every projection (0: full fine-tuning)")
    p.add_argument("--shard-optimizer", action=argparse.BooleanOptionalAction, default=True,
                   help="training stages with dp > 1 keep 1/dp of the optimizer state per replica (ZeRO-1), as a "
                        "job does by default (plan.shard_optimizer)")
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory kept free")
    p.add_argument("--runners-up", type=int, default=3, help="how many runners-up to show")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def _memory_lines(result: PlanResult) -> list[str]:
    """Peak memory per device, consecutive devices with the same peak on one line."""
    runs: list[list] = []
    for device, peak in result.memory_per_device_bytes.items():
        gib = round(peak / GIB, 2)
        if runs and runs[-1][2] == gib and runs[-1][1] == device - 1:
            runs[-1][1] = device
        else:
            runs.append([device, device, gib])
    return [f"  devices {a}-{b}: {gib:.2f} GiB" if a != b else f"  device {a}: {gib:.2f} GiB" for a, b, gib in runs]


def _report(result: PlanResult, args: argparse.Namespace, workload: Workload) -> str:
    lines = [f"{args.model} {args.algorithm} on {args.gpus} x {args.hardware}: {workload.prompts_per_step} prompts x "
             f"{workload.samples_per_prompt} samples, {workload.prompt_length.max} + {workload.response_length.max} "
             "tokens", _cost_model_line(args), "", result.table(), "",
             "memory per GPU (peak: resident state of every model-stage on it + the largest working set):",
             *_memory_lines(result), ""]
    for i, r in enumerate(result.runners_up, 1):
        changes = [f"{s} {c}" for s, c in r.choices.items() if c != result.choices[s]]
        if r.groups != result.groups:
            changes.append("run order " + " -> ".join(" | ".join("+".join(g) for g in phase) for phase in r.groups))
        lines.append(f"runner-up {i}: {r.step_latency_s:.3f} s; " + "; ".join(changes))
    gap = "proven optimal" if result.gap == 0 else f"within {100 * result.gap:.2f}% of the optimum (proven)"
    lines.append(f"decision: {result.decision_ms:.1f} ms, {gap}")
    return "\n".join(lines)


def _cost_model_line(args: argparse.Namespace) -> str:
    cal = args.calibration_data
    if cal is None:
        return f"cost model: the hardware table's priors for {args.hardware}"
    made = ", ".join(f"{k} {cal[k]}" for k in ("model", "steps") if cal.get(k) is not None)
    return f"cost model: calibration {cal['path']}" + (f" ({made})" if made else "")


def _json(result: PlanResult, args: argparse.Namespace, workload: Workload) -> str:
    out = result.to_json()
    cal = args.calibration_data
    out.update(model=args.model, algorithm=args.algorithm, gpus=args.gpus,
               calibration=cal["path"] if cal is not None else None,
               workload={"prompts_per_step": workload.prompts_per_step,
                         "samples_per_prompt": workload.samples_per_prompt,
                         "prompt_length": workload.prompt_length.max,
                         "response_length": workload.response_length.max})
    return json.dumps(out)


def _check_numbers(args: argparse.Namespace) -> None:
    """Sizes positive, --runners-up non-negative, --headroom a fraction: before any planning."""
    for name in ("gpus", "batch", "prompt_length", "response_length", "samples_per_prompt"):
        value = getattr(args, name)
        if value is not None and value < 1:
            default = " (or omit it: 8 for grpo/rloo, 1 otherwise)" if name == "samples_per_prompt" else ""
            raise PlanArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {value}{default}")
    if args.runners_up < 0:
        raise PlanArgumentError(f"--runners-up must be >= 0, got {args.runners_up}")
    if not 0 <= args.headroom < 1:
        raise PlanArgumentError(f"--headroom must be in [0, 1) (a fraction of device memory), got {args.headroom}")


def _check_context(args: argparse.Namespace, limit: int) -> None:
    """A prompt plus its response must fit the model's context (its KV cache and positions)."""
    total = args.prompt_length + args.response_length
    if total > limit:
        raise PlanArgumentError(
            f"--prompt-length ({args.prompt_length}) + --response-length ({args.response_length}) = {total} "
            f"exceeds max_position_embeddings ({limit}) of --model {args.model}: shorten them or use a "
            "longer-context model")


def _problem(args: argparse.Namespace):
    """The model config, workload and planner the arguments describe; any bad argument raises first."""
    try:
        cfg = resolve_model(args.model)
    except ConfigError as error:
        raise PlanArgumentError(f"--model: {error}") from None
    if args.lora_rank < 0:
        raise PlanArgumentError(f"--lora-rank must be >= 0 (0: full fine-tuning), got {args.lora_rank}")
    if args.lora_rank:
        cfg = dataclasses.replace(cfg, lora_rank=args.lora_rank, lora_alpha=2.0 * args.lora_rank)
    if args.algorithm not in ALGORITHMS:
        raise PlanArgumentError(f"--algorithm: unknown algorithm '{args.algorithm}'; valid: {', '.join(ALGORITHMS)}")
    spec = algorithm_spec(args.algorithm)
    cost_model = _cost_model(args)
    _check_numbers(args)
    _check_context(args, cfg.max_position_embeddings)
    samples = args.samples_per_prompt or (8 if spec.needs_group else 1)
    if spec.needs_group and samples < 2:
        raise PlanArgumentError(f"--algorithm {args.algorithm} compares a prompt's samples: --samples-per-prompt >= 2")
    workload = Workload.fixed(args.batch, args.prompt_length, args.response_length, samples,
                              greedy_baseline=spec.needs_greedy_baseline, shard_optimizer=args.shard_optimizer)
    return cfg, workload, Planner(cost_model, headroom=args.headroom, runners_up=args.runners_up)


def _cost_model(args: argparse.Namespace) -> CostModel:
    """The hardware table's priors for --hardware, or --calibration's cost model (on the file's hardware, which
    --hardware may only repeat). Sets ``args.hardware`` and ``args.calibration_data`` (None: no calibration)."""
    args.calibration_data = None
    try:
        hardware = get_hardware(args.hardware) if args.hardware is not None else None
    except HardwareError as error:
        raise PlanArgumentError(f"--hardware: {error}") from None
    if args.calibration is None:
        hardware = hardware or get_hardware("h200")
        args.hardware = hardware.name
        return CostModel(hardware)
    try:
        cal = read_calibration(args.calibration)
    except CalibrationError as error:
        raise PlanArgumentError(f"--calibration: {error}") from None
    if hardware is not None and hardware.name != cal["hardware"]:
        raise PlanArgumentError(
            f"--hardware {hardware.name} differs from the hardware of --calibration {cal['path']} "
            f"({cal['hardware']}): drop --hardware to plan on {cal['hardware']}, or give a calibration from a run "
            f"on {hardware.name}")
    args.hardware, args.calibration_data = cal["hardware"], cal
    return CostModel(cal["hardware"], cal["efficiency"], cal["half_sizes"])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg, workload, planner = _problem(args)
    except (PlanArgumentError, WorkloadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        result = planner.plan(cfg, args.algorithm, workload, args.gpus)
    except InfeasiblePlanError as error:
        print(f"no feasible plan: {error}", file=sys.stderr)
        return 1
    print(_json(result, args, workload) if args.json else _report(result, args, workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
