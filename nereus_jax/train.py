"""The nereus_jax job: ``python -m nereus_jax.train [CONFIG.yaml] [key.sub=value ...]``.

Until the RL job lands (PPO/GRPO), this entry point runs the foundation end to end on the configured
cluster: it builds the model of ``model`` (default: the tiny config), lays it out with
``plan.default`` (tp, pp; dp = the remaining devices) on ``cluster.num_devices`` devices (CPU virtual
devices by default), runs a sharded forward and a training gradient, and checks both against a
single-device run.

    python -m nereus_jax.train                         # tiny model, 8 CPU virtual devices
    python -m nereus_jax.train plan.default.tp=4       # other layout
    python -m nereus_jax.train --help                  # the config tree
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
    parser.add_argument("config", nargs="?", help="YAML config file or a name under configs/ (default: built-in)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    parser.add_argument("--run-dir", help="where to write summary.json (default: logging.run_dir or runs/<time>)")
    args = parser.parse_args(argv)
    if args.config and "=" in args.config:  # only overrides were given
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def _set_platform(cfg: Config) -> None:
    """Must run before JAX is imported: CPU virtual devices are fixed at backend start."""
    if cfg.cluster.platform != "cpu":
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flag = f"--xla_force_host_platform_device_count={cfg.cluster.num_devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    _set_platform(cfg)
    from nereus_jax.runtime.foundation import run_foundation_check
    from nereus_jax.sharding import LayoutError

    start = time.perf_counter()
    try:
        summary = run_foundation_check(cfg)
    except LayoutError as e:
        print(f"layout error: {e}", file=sys.stderr)
        return 2
    summary["wall_s"] = round(time.perf_counter() - start, 3)
    run_dir = args.run_dir or cfg.logging.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
