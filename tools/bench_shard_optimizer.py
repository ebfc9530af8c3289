"""Memory and speed of one actor training step over dp replicas whose optimizer state is split over them
(``plan.shard_optimizer``, ZeRO-1) vs replicas that each hold the whole of it, in the same process, as the job's
train program runs it: one SPMD program on the mesh (dp, pp, tp) of 8 CPU devices, state donated.

    python tools/bench_shard_optimizer.py                  # Qwen3-shaped 512 x 4 layers, vocab 32k; dp 8, tp 1
    python tools/bench_shard_optimizer.py --dp 4 --tp 2    # any dp x tp x pp = 8
    python tools/bench_shard_optimizer.py --quick          # a small shape, 2 repeats (tests)

Per mode (``whole``: plan.shard_optimizer=false; ``split``: true):

- ``state_bytes_*``: one replica's resident state per device (``StateSpec.for_dp(dp).bytes_per_device``): the
  parameters, plus Adam's moments whole or 1/dp of them;
- ``peak_bytes_*``: XLA's buffer assignment of the compiled step per device (arguments + temporaries + outputs
  that do not reuse a donated input): resident state plus the step's working set;
- ``train_seconds_*``: the median of ``--repeats`` steps after a warm-up; ``same_result``: both modes' states after
  those steps equal bit for bit (the split only changes where Adam's moments live); ``matmul_fraction_*``: the
  step's matmul FLOPs over its seconds, as a fraction of the machine's float32 matmul rate.

On 8 CPU devices of one host the collectives are memory copies: the all-gather of the updated parameters that the
split adds is cheap here, and the moments' update runs on 1/dp of them. The machine's limits are measured in the
same run (float32 matmul FLOP/s, copy bandwidth). Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from machine_limits import (  # noqa: E402
    QWEN3_MODELS,
    actor_batch,
    copy_bytes_per_s,
    matmul_flops_per_s,
    median_seconds,
    peak_bytes,
)

from nereus_jax.config import AlgorithmConfig, ModelConfig  # noqa: E402
from nereus_jax.elastic.spec import StateSpec  # noqa: E402
from nereus_jax.models import init_params  # noqa: E402
from nereus_jax.runtime.step import losses  # noqa: E402
from nereus_jax.runtime.step.stages import stage_value_and_grad  # noqa: E402
from nereus_jax.sharding import Layout, make_mesh  # noqa: E402

LR = 2.0e-4
MODELS = QWEN3_MODELS


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-32k")
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--rows", type=int, default=128, help="rows of one update, split over dp")
    p.add_argument("--prompt", type=int, default=12)
    p.add_argument("--response", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="model qwen3-8k, 2 repeats")
    args = p.parse_args()
    if args.quick:
        args.model, args.repeats = "qwen3-8k", 2
    if args.dp * args.tp * args.pp != 8:
        p.error(f"--dp x --tp x --pp must be the 8 devices, got {args.dp * args.tp * args.pp}")
    return args


def _mode(cfg: ModelConfig, split: bool, args: argparse.Namespace, mesh, batch: dict) -> dict:
    layout = Layout(tp=args.tp, pp=args.pp)
    optimizer = losses.make_optimizer(LR)
    whole = StateSpec(cfg, "train", optimizer=optimizer, shard_optimizer=split)
    spec = whole.for_dp(args.dp)
    params = init_params(cfg, seed=0)
    state = {"params": params, "opt": losses.init_opt_state(optimizer, params, cfg)}
    shardings = spec.shardings(mesh)
    leaves = jax.device_put(whole.expand([np.asarray(x) for x in whole.flatten(state)], whole.repeat(layout)),
                            shardings)
    algo = AlgorithmConfig(name="ppo", kl_coef=0.001, kl_in_reward=True, clip_ratio=0.2, lam=0.95)
    make_loss = functools.partial(losses.actor_loss, cfg, algo, args.prompt)
    grad_fn = stage_value_and_grad(mesh, "train", make_loss)
    pins = jax.tree.unflatten(spec.params_def, shardings[: spec.n_params]) if spec.shards > 1 else None
    step = losses.make_minibatch_train_step(None, optimizer, cfg, value_and_grad=grad_fn, param_shardings=pins)

    def program(leaves, micro):
        s = spec.unflatten(leaves)
        p, o, metrics = step(s["params"], s["opt"], micro)
        return spec.flatten({"params": p, "opt": o}), metrics["loss"]

    micro = losses.put_minibatches(losses.split_minibatches(batch, 1, 1), mesh)
    compiled = jax.jit(program, donate_argnums=0, out_shardings=(shardings, None)).lower(leaves, micro).compile()
    box = {"leaves": leaves}

    def train():
        box["leaves"], loss = compiled(box["leaves"], micro)
        return loss

    seconds = median_seconds(train, args.repeats)
    final = [np.asarray(x) for x in box["leaves"]]
    return {"state_bytes": spec.bytes_per_device(layout), "peak_bytes": peak_bytes(compiled),
            "train_seconds": seconds, "final": final}


def run(args: argparse.Namespace) -> dict:
    cfg = MODELS[args.model]
    mesh = make_mesh(jax.devices()[:8], Layout(tp=args.tp, pp=args.pp), dp=args.dp)
    batch = actor_batch(cfg.vocab_size, args.rows, args.prompt, args.response)
    out = {name: _mode(cfg, name == "split", args, mesh, batch) for name in ("whole", "split")}
    flops, gbps = matmul_flops_per_s(), copy_bytes_per_s()
    w, s = out["whole"], out["split"]
    same = all(np.array_equal(a, b) for a, b in zip(w.pop("final"), s.pop("final"), strict=True))
    return {"model": cfg.name, "dp": args.dp, "tp": args.tp, "pp": args.pp, "rows": args.rows,
            **{f"{k}_{name}": v for name, m in out.items() for k, v in m.items()},
            "state_ratio": s["state_bytes"] / w["state_bytes"], "peak_ratio": s["peak_bytes"] / w["peak_bytes"],
            "speed_ratio": w["train_seconds"] / s["train_seconds"], "same_result": same,
            "machine_matmul_flops_per_s": flops, "machine_copy_bytes_per_s": gbps,
            **{f"matmul_fraction_{name}": _step_flops(cfg, args) / m["train_seconds"] / flops
               for name, m in out.items()}}


def _step_flops(cfg: ModelConfig, args: argparse.Namespace) -> float:
    """Matmul FLOPs of one training step over all replicas (3 x the forward: weights, lm head, attention): the
    8 CPU devices share the host's cores, so the machine's matmul rate bounds the step's whole work."""
    d, h, k, e, f, n = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                        cfg.num_layers)
    s = args.prompt + args.response
    tokens = args.rows * s
    weights = 2.0 * tokens * n * (2 * d * h * e + 2 * d * k * e + 3 * d * f) + 2.0 * args.rows * args.response * d * \
        cfg.vocab_size
    return 3.0 * (weights + 4.0 * tokens * n * s * h * e)


def main() -> None:
    print(json.dumps(run(_parse())))


if __name__ == "__main__":
    main()
