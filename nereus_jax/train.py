"""The nereus_jax job: ``python -m nereus_jax.train [CONFIG.yaml] [key.sub=value ...] [--run-dir DIR]``.

With no config it runs ``configs/ppo_tiny.yaml``: a supervised warm start of the tiny actor (cached),
then PPO on 2-digit addition across the 8 CPU virtual devices, with a progress bar, a summary table,
``RUN_DIR/metrics.jsonl``, ``RUN_DIR/summary.json`` and TensorBoard events in ``RUN_DIR/tensorboard``.

    python -m nereus_jax.train                                   # PPO, tiny model, 8 CPU devices
    python -m nereus_jax.train grpo_tiny trainer.steps=20        # GRPO
    python -m nereus_jax.train --check-sharding                  # sharded forward/grad vs one device
    python -m nereus_jax.train --help                            # the config tree
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from nereus_jax.config import Config, ConfigError, describe, load_config


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m nereus_jax.train",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (override with key.sub=value):\n" + describe(),
    )
    parser.add_argument("config", nargs="?", help="YAML config file or a name under configs/ (default: ppo_tiny)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    parser.add_argument("--run-dir", help="run directory (default: logging.run_dir, else runs/<time>)")
    parser.add_argument("--check-sharding", action="store_true",
                        help="only check the sharded forward and gradient against one device, then exit")
    args = parser.parse_intermixed_args(argv)  # options anywhere among the overrides
    if args.config and "=" in args.config:  # only overrides were given
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def _set_platform(cfg: Config) -> None:
    """Must run before JAX is imported: CPU virtual devices are fixed at backend start."""
    if cfg.cluster.platform != "cpu":
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from nereus_jax.runtime.platform.distributed import detect

    if detect().multi:  # several processes: each one's CPU devices come from NEREUS_LOCAL_DEVICES
        return
    flag = f"--xla_force_host_platform_device_count={cfg.cluster.num_devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config or ("default" if args.check_sharding else "ppo_tiny"), args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from nereus_jax.runtime.platform.distributed import DistributedError, initialize

    try:
        _set_platform(cfg)
        initialize()  # joins the other processes under SLURM or NEREUS_COORDINATOR; no-op otherwise
    except DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or cfg.logging.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    start = time.perf_counter()
    try:
        summary = _check_sharding(cfg, run_dir) if args.check_sharding else _run(cfg, run_dir, start)
    except _user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "plan"}))
    if summary.get("stopped_by"):
        from nereus_jax.runtime.durability.checkpoint import resume_command

        argv = sys.argv[1:] if argv is None else argv
        how = (f"resume with:\n  {resume_command(argv, summary['resume_from'])}" if summary["resume_from"] else
               "no checkpoint to resume from (the steps before the stop were non-finite)")
        print(f"stopped by {summary['stopped_by']} after step {summary['stopped_after']}; {how}", file=sys.stderr)
    return 0 if summary.get("ok", True) else 1


def _run(cfg: Config, run_dir: str, start: float) -> dict:
    from nereus_jax.runtime.run import run_job

    return run_job(cfg, run_dir, started=start)


def _check_sharding(cfg: Config, run_dir: str) -> dict:
    from nereus_jax.runtime.platform.sharding_check import run_sharding_check

    summary = run_sharding_check(cfg)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors a user's input causes: reported as one line with exit status 2, no traceback."""
    from nereus_jax.hf_config import HFImportError
    from nereus_jax.rl.rewards import RewardFunctionError
    from nereus_jax.rl.tasks import PromptDataError
    from nereus_jax.rl.tokenizer import TokenizerError
    from nereus_jax.runtime.step.job import JobError
    from nereus_jax.sharding import LayoutError

    return (ConfigError, LayoutError, JobError, PromptDataError, TokenizerError, HFImportError, RewardFunctionError,
            FileNotFoundError)


if __name__ == "__main__":
    sys.exit(main())
