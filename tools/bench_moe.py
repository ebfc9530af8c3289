"""Speed and peak memory of one dropless mixture-of-experts layer (``layers.moe_mlp``: the pairs sorted by expert,
then the grouped matmul nereus_jax uses on this backend, ``layers.grouped_impl()``) against a dense SwiGLU layer
(``layers.swiglu``) of the same active FLOPs, forward and forward + backward, in the same process.

    python tools/bench_moe.py                  # 1,024 tokens, hidden 1,024, 32 experts, top-4, width 512 (~1.5 min)
    python tools/bench_moe.py --tokens 4096    # a realistic micro-batch per device (4x the time on CPU)
    python tools/bench_moe.py --qwen3-30b      # qwen3-30b-a3b.yaml's layer, 256 tokens (for a GPU; CPU: --tokens 16)
    python tools/bench_moe.py --quick          # a tiny shape, 2 repeats (tests)
    python tools/bench_moe.py --ep-mape        # also the cost model's MAPE on held-out ep layouts (~7 min more)

The two layers: the MoE layer routes every token to ``top_k`` of ``experts`` SwiGLU experts of width
``moe_width`` (Qwen3-MoE's router: float32 softmax, top-k, renormalised); the dense layer is one SwiGLU of width
``dense_width = top_k * moe_width``, so both do the same matmul FLOPs per token (``active_flops_per_token`` =
2 x 3 x hidden x dense_width; the MoE router's 2 x hidden x experts is reported apart). Forward: the layer's
output; train: the gradient of a sum-of-squares loss of the output w.r.t. the input and every weight (the
router's included). Random inputs (standard normal), random weights (normal x ``INIT_SCALE``), all seeded; one
sequence of ``--tokens`` tokens, float32 with exact ("highest") matmuls on every backend. Seconds are the median
of ``--repeats`` calls after a warm-up; peak bytes come from XLA's buffer assignment of each compiled program
(``memory_analysis``). The machine's limits are measured in the same run (a float32 square matmul's FLOP/s and a
large array copy's bandwidth); each layer's achieved FLOP/s counts its useful matmuls (forward 1x, train 3x; the
MoE router included) against the first.

The goal is ``train_ratio`` (MoE train tokens/s over the dense layer's) >= ``GOAL_RATIO_MIN`` (0.7); the
forward ratio is reported beside it. The MoE layer is checked against the masked-dense reference (every expert
run on every token, each weighted by the router's top-k weights scattered into a [tokens, experts] matrix):
``max_abs_diff_vs_masked_dense`` (output) and ``max_abs_grad_diff_vs_masked_dense`` (every gradient).

The grouped matmul (``moe_impl``): off CPU (GPU, TPU) ``lax.ragged_dot``, which lowers to XLA's ragged-dot
instruction there. On CPU it lowers to JAX's dense fallback (each group's rows masked into an [experts, rows, ...]
operand contracted over all experts: ``experts`` x the active FLOPs), so nereus_jax runs ``blocks`` there
(``layers.blocked_swiglu``: each expert's group cut into ``block_rows``-row blocks, one SwiGLU per block in a scan
with a hand-written backward; the active FLOPs plus at most a block of padding per expert, and every expert's
weights read once per block). ``ragged_dot_lowering`` says how ``lax.ragged_dot`` lowers here. Alternatives timed
beside it (``--no-alternatives`` skips them): ``ragged`` (``impl="ragged_dot"`` on this backend), ``onehot`` (the
masked-dense reference itself: experts / top_k x the active FLOPs, no sort) and ``blocked`` (not in nereus_jax:
sort, pad each expert's group to a multiple of ``--block`` rows, one batched matmul over the blocks with each
block's expert weights gathered). ``moe_weight_read_seconds_floor`` is the MoE layer's weights (every expert's:
each is routed some token) over the measured copy bandwidth: a floor on a forward that reads them once, which on
a CPU of low bandwidth can exceed the dense layer's whole forward (its weights are experts / top_k x smaller).

``--ep-mape`` adds the issue's second figure: the cost model's mean absolute percentage error on held-out
expert-parallel layouts (goal ``EP_MAPE_GOAL``, 10%), from ``tools/bench_cost_model.py --moe`` run as a
subprocess (it needs 8 virtual CPU devices, set before JAX starts): a tiny Qwen3-MoE's scoring and training
stage programs timed on ``TPxDPxPPxEP`` layouts, one ``CostModel("cpu")`` fitted on the first ones, errors on
the rest. ``ep_mape_by_stage`` / ``ep_mape`` are over the held-out layouts with ep > 1; ``ep_calibration`` is
that run's whole JSON (its per-layout rows included). ``--ep-layouts`` passes other layouts through.

Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from machine_limits import copy_bytes_per_s, matmul_flops_per_s, median_seconds, peak_bytes  # noqa: E402

from nereus_jax.config import resolve_model  # noqa: E402
from nereus_jax.models.layers import default_block_rows, experts_mlp, grouped_impl, route, swiglu  # noqa: E402

GOAL_RATIO_MIN = 0.7
EP_MAPE_GOAL = 0.10
INIT_SCALE = 0.02
QWEN3_30B = "qwen3-30b-a3b"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="tokens per device (default 1,024; --qwen3-30b 256)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-width", type=int, default=512, help="each expert's intermediate size")
    p.add_argument("--no-norm-topk", dest="norm_topk", action="store_false", help="keep the raw top-k weights")
    p.add_argument("--block", type=int, default=128, help="rows per block of the 'blocked' alternative")
    p.add_argument("--block-rows", type=int, default=None,
                   help="rows per block of the 'blocks' grouped matmul (default: layers.default_block_rows)")
    p.add_argument("--alternatives", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the onehot and blocked alternatives")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qwen3-30b", action="store_true",
                   help=f"configs/models/{QWEN3_30B}.yaml's hidden, experts, top-k, width and norm_topk")
    p.add_argument("--ep-mape", action="store_true", help="also run tools/bench_cost_model.py --moe (the cost "
                                                          "model's MAPE on held-out ep layouts; ~7 min on CPU)")
    p.add_argument("--ep-layouts", default=None, help="with --ep-mape: its --layouts (TPxDPxPPxEP, comma-separated)")
    p.add_argument("--quick", action="store_true", help="256 tokens, hidden 128, 8 experts, top-2, width 64, "
                                                        "block 16, 2 repeats")
    args = p.parse_args()
    if args.qwen3_30b:
        cfg = resolve_model(QWEN3_30B)
        args.hidden, args.experts, args.top_k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
        args.moe_width, args.norm_topk = cfg.moe_intermediate_size, cfg.norm_topk_prob
        args.tokens = 256 if args.tokens is None else args.tokens
    if args.quick:
        args.tokens, args.hidden, args.experts, args.top_k, args.moe_width = 256, 128, 8, 2, 64
        args.block, args.repeats = 16, 2
    args.tokens = 1024 if args.tokens is None else args.tokens
    return args


def masked_dense(x_btd, router_de, w_gate_edf, w_up_edf, w_down_efd, k: int, norm_topk: bool):
    """The reference (and the 'onehot' alternative): every expert on every token, each expert's output weighted
    by the token's routing weight for it (0 when not among its top k)."""
    weights, experts = route(x_btd, router_de, k, norm_topk)[:2]
    combine = jnp.sum(jax.nn.one_hot(experts, router_de.shape[-1], dtype=weights.dtype) * weights[..., None],
                      axis=-2)                                                      # [b, t, e]
    gate = jnp.einsum("btd,edf->btef", x_btd, w_gate_edf)
    up = jnp.einsum("btd,edf->btef", x_btd, w_up_edf)
    hidden = jax.nn.silu(gate) * up * combine[..., None]
    return jnp.einsum("btef,efd->btd", hidden, w_down_efd)


def blocked_moe(x_btd, router_de, w_gate_edf, w_up_edf, w_down_efd, k: int, norm_topk: bool, block: int):
    """The 'blocked' alternative: moe_mlp's sort, each expert's group padded to a multiple of ``block`` rows
    (static bound: ceil-sum <= (pairs + experts * (block - 1)) // block blocks), one batched matmul over blocks."""
    b, t, d = x_btd.shape
    e = router_de.shape[-1]
    pairs = b * t * k
    weights, experts = route(x_btd, router_de, k, norm_topk)[:2]
    flat_e = experts.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    sorted_e = flat_e[order]
    sizes = jnp.bincount(flat_e, length=e)
    starts = jnp.cumsum(sizes) - sizes
    padded = (sizes + block - 1) // block * block
    padded_ends = jnp.cumsum(padded)
    dest = padded_ends[sorted_e] - padded[sorted_e] + jnp.arange(pairs) - starts[sorted_e]  # row of each pair
    n_blocks = (pairs + e * (block - 1)) // block
    rows = jnp.zeros((n_blocks * block, d), x_btd.dtype).at[dest].set(x_btd.reshape(b * t, d)[order // k])
    block_e = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(n_blocks) * block, side="right"), e - 1)
    xb = rows.reshape(n_blocks, block, d)
    gate = jnp.einsum("nbd,ndf->nbf", xb, w_gate_edf[block_e])
    up = jnp.einsum("nbd,ndf->nbf", xb, w_up_edf[block_e])
    yb = jnp.einsum("nbf,nfd->nbd", jax.nn.silu(gate) * up, w_down_efd[block_e]).reshape(n_blocks * block, d)
    ys = jnp.zeros((pairs, d), x_btd.dtype).at[order].set(yb[dest]).reshape(b, t, k, d)
    return jnp.einsum("btkd,btk->btd", ys, weights)


def _inputs(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    d, e, f, dense_f = args.hidden, args.experts, args.moe_width, args.top_k * args.moe_width

    def w(*shape):
        return jnp.asarray(rng.normal(0.0, INIT_SCALE, shape), jnp.float32)

    x = jnp.asarray(rng.normal(size=(1, args.tokens, d)), jnp.float32)
    return {"x": x, "moe": (w(d, e), w(e, d, f), w(e, d, f), w(e, f, d)), "dense": (w(d, dense_f), w(d, dense_f),
                                                                                    w(dense_f, d))}


def _programs(layer, x, weights) -> dict:
    """The compiled forward and train (grads of sum(y^2) w.r.t. x and every weight) of ``layer(x, *weights)``."""
    fwd = jax.jit(layer)
    train = jax.jit(jax.grad(lambda x, *ws: jnp.sum(jnp.square(layer(x, *ws))), argnums=tuple(range(1 + len(weights)))))
    lowered = fwd.lower(x, *weights)
    return {"fwd": lowered.compile(), "train": train.lower(x, *weights).compile(), "text": lowered.as_text()}


def _xla_flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) if cost and "flops" in cost else None


def _measure(progs: dict, x, weights, repeats: int) -> dict:
    fwd, train = progs["fwd"], progs["train"]
    return {"fwd_seconds": median_seconds(lambda: fwd(x, *weights), repeats),
            "train_seconds": median_seconds(lambda: train(x, *weights), repeats),
            "fwd_peak_bytes": peak_bytes(fwd), "train_peak_bytes": peak_bytes(train),
            "xla_fwd_flops": _xla_flops(fwd), "xla_train_flops": _xla_flops(train)}


def _max_diff(a, b) -> float:
    return float(max(np.max(np.abs(np.asarray(u) - np.asarray(v))) for u, v in zip(jax.tree.leaves(a),
                                                                                  jax.tree.leaves(b), strict=True)))


def run(args: argparse.Namespace) -> dict:
    k, norm, n = args.top_k, args.norm_topk, args.tokens
    d, e, f, dense_f = args.hidden, args.experts, args.moe_width, args.top_k * args.moe_width
    jax.config.update("jax_default_matmul_precision", "highest")  # exact float32 matmuls on every backend
    inp = _inputs(args)
    x, mw, dw = inp["x"], inp["moe"], inp["dense"]
    impl = grouped_impl()
    block_rows = args.block_rows or default_block_rows(n * k, e)

    def moe(impl):
        def layer(x, router, *ws):
            return experts_mlp(x, route(x, router, k, norm), *ws, impl=impl, block_rows=block_rows)
        return layer

    layers = {"moe": moe(impl), "ragged": moe("ragged_dot"), "onehot": lambda x, *ws: masked_dense(x, *ws, k, norm),
              "blocked": lambda x, *ws: blocked_moe(x, *ws, k, norm, args.block)}

    names = ("moe", "onehot", "ragged", "blocked") if args.alternatives else ("moe", "onehot", "ragged")
    progs = {name: _programs(layers[name], x, mw) for name in names}
    progs["dense"] = _programs(swiglu, x, dw)
    # correctness on this shape: moe_mlp (and the blocked alternative) vs the masked-dense reference
    want_y, want_g = progs["onehot"]["fwd"](x, *mw), progs["onehot"]["train"](x, *mw)
    diffs = {name: (_max_diff(progs[name]["fwd"](x, *mw), want_y), _max_diff(progs[name]["train"](x, *mw), want_g))
             for name in names if name != "onehot"}
    timed = ("moe", "dense", "onehot", "ragged", "blocked") if args.alternatives else ("moe", "dense")
    out = {name: _measure(progs[name], x, dw if name == "dense" else mw, args.repeats) for name in timed}
    alt = {name: out.pop(name) for name in timed[2:]}
    native = "chlo.ragged_dot" in progs["ragged"]["text"]
    counts = np.bincount(np.asarray(route(x, mw[0], k, norm)[1]).reshape(-1), minlength=e)
    flops, gbps = matmul_flops_per_s(), copy_bytes_per_s()

    # matmul FLOPs per token, forward: gate, up and down of the k experts of width f / of the one of width k * f
    moe_active, dense_active = 2.0 * 3.0 * d * f * k, 2.0 * 3.0 * d * dense_f
    router = 2.0 * d * e
    m, dn = out["moe"], out["dense"]
    tps = {name: (n / r["fwd_seconds"], n / r["train_seconds"]) for name, r in {**out, **alt}.items()}
    fraction = lambda per_token, r: {"fwd": per_token * n / r["fwd_seconds"] / flops,
                                     "train": 3.0 * per_token * n / r["train_seconds"] / flops}
    train_ratio = tps["moe"][1] / tps["dense"][1]
    result = {
        "tokens": n, "hidden": d, "experts": e, "top_k": k, "moe_width": f, "dense_width": dense_f,
        "norm_topk": norm, "dtype": "float32", "repeats": args.repeats, "seed": args.seed, "init_scale": INIT_SCALE,
        "moe_fwd_tokens_per_s": tps["moe"][0], "dense_fwd_tokens_per_s": tps["dense"][0],
        "fwd_ratio": tps["moe"][0] / tps["dense"][0],
        "moe_train_tokens_per_s": tps["moe"][1], "dense_train_tokens_per_s": tps["dense"][1],
        "train_ratio": train_ratio, "goal_ratio_min": GOAL_RATIO_MIN, "goal_met": bool(train_ratio >= GOAL_RATIO_MIN),
        "active_flops_per_token": dense_active, "moe_active_flops_per_token": moe_active,
        "dense_active_flops_per_token": dense_active, "moe_router_flops_per_token": router,
        "moe_xla_fwd_flops_per_token": None if m["xla_fwd_flops"] is None else m["xla_fwd_flops"] / n,
        "dense_xla_fwd_flops_per_token": None if dn["xla_fwd_flops"] is None else dn["xla_fwd_flops"] / n,
        "matmul_flops_per_s": flops, "copy_bytes_per_s": gbps,
        "moe_fwd_flops_fraction": fraction(moe_active + router, m)["fwd"],
        "moe_train_flops_fraction": fraction(moe_active + router, m)["train"],
        "dense_fwd_flops_fraction": fraction(dense_active, dn)["fwd"],
        "dense_train_flops_fraction": fraction(dense_active, dn)["train"],
        "moe_fwd_peak_bytes": m["fwd_peak_bytes"], "moe_train_peak_bytes": m["train_peak_bytes"],
        "dense_fwd_peak_bytes": dn["fwd_peak_bytes"], "dense_train_peak_bytes": dn["train_peak_bytes"],
        "moe_peak_bytes": max(m["fwd_peak_bytes"], m["train_peak_bytes"]),
        "dense_peak_bytes": max(dn["fwd_peak_bytes"], dn["train_peak_bytes"]),
        "moe_fwd_seconds": m["fwd_seconds"], "moe_train_seconds": m["train_seconds"],
        "dense_fwd_seconds": dn["fwd_seconds"], "dense_train_seconds": dn["train_seconds"],
        "routing_max_over_mean": float(counts.max() / counts.mean()), "routing_min_over_mean":
            float(counts.min() / counts.mean()), "tokens_per_expert_mean": float(counts.mean()),
        "max_abs_diff_vs_masked_dense": diffs["moe"][0], "max_abs_grad_diff_vs_masked_dense": diffs["moe"][1],
        "ragged_dot_lowering": "native" if native else "dense_fallback", "moe_impl": impl,
        "block_rows": block_rows if impl == "blocks" else None,
        "moe_weight_bytes": sum(int(w.size) * 4 for w in mw), "dense_weight_bytes": sum(int(w.size) * 4 for w in dw),
        "moe_weight_read_seconds_floor": sum(int(w.size) * 4 for w in mw) / gbps,
        "max_abs_diff_ragged_vs_masked_dense": diffs["ragged"][0],
        "max_abs_grad_diff_ragged_vs_masked_dense": diffs["ragged"][1],
    }
    for name, r in alt.items():
        result.update({f"{name}_fwd_tokens_per_s": tps[name][0], f"{name}_train_tokens_per_s": tps[name][1],
                       f"{name}_fwd_ratio": tps[name][0] / tps["dense"][0],
                       f"{name}_train_ratio": tps[name][1] / tps["dense"][1],
                       f"{name}_peak_bytes": max(r["fwd_peak_bytes"], r["train_peak_bytes"]),
                       f"{name}_xla_fwd_flops_per_token": None if r["xla_fwd_flops"] is None
                       else r["xla_fwd_flops"] / n})
    if args.alternatives:
        result.update({"blocked_block": args.block, "max_abs_diff_blocked_vs_masked_dense": diffs["blocked"][0],
                       "max_abs_grad_diff_blocked_vs_masked_dense": diffs["blocked"][1]})
    result["notes"] = [
        ("ep_mape_by_stage / ep_mape: the cost model's MAPE on held-out expert-parallel layouts (Layout.ep > 1), "
         "measured by tools/bench_cost_model.py --moe on 8 virtual CPU devices (ep_calibration: its JSON)"
         if args.ep_mape else
         "not measured in this run: the cost model's MAPE on held-out expert-parallel layouts (Layout.ep > 1); "
         "pass --ep-mape (it runs tools/bench_cost_model.py --moe)"),
        "goal: train_ratio = moe_train_tokens_per_s / dense_train_tokens_per_s >= goal_ratio_min; the dense "
        "layer has width top_k * moe_width, the same active matmul FLOPs per token (the router's are extra)",
        f"moe_impl {impl}: the grouped matmul nereus_jax runs on this backend (layers.grouped_impl)",
        ("ragged_dot_lowering native: XLA's ragged-dot instruction" if native else
         "ragged_dot_lowering dense_fallback: on this backend lax.ragged_dot is JAX's dense fallback (every group "
         "masked into an [experts, rows, ...] operand and contracted over all experts), executing experts x the "
         "active FLOPs (ragged_xla_fwd_flops_per_token), which is why nereus_jax runs 'blocks' here"),
        "alternatives: ragged = impl ragged_dot on this backend; onehot = the masked-dense reference (experts / "
        "top_k x the active FLOPs); blocked (not in nereus_jax) = sort, pad each expert's group to blocked_block "
        "rows, one batched matmul over blocks with gathered expert weights",
        "moe_weight_read_seconds_floor: every expert's weights over copy_bytes_per_s, a floor on one forward",
        "routing: a random router (normal x init_scale) on standard-normal inputs; routing_max_over_mean is the "
        "busiest expert's token-expert pairs over the mean",
    ]
    result.update({"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
                   "jax": jax.__version__})
    return result


def ep_calibration(layouts: str | None = None) -> dict:
    """``tools/bench_cost_model.py --moe`` (with ``--layouts layouts``) in a subprocess: its JSON."""
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_cost_model.py"), "--moe"]
    cmd += ["--layouts", layouts] if layouts else []
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    args = _parse()
    if not 0 < args.top_k <= args.experts:
        raise SystemExit(f"--top-k must be in 1..--experts ({args.experts}), got {args.top_k}")
    if args.ep_layouts and not args.ep_mape:
        raise SystemExit("--ep-layouts needs --ep-mape")
    result = run(args)
    if args.ep_mape:
        cal = ep_calibration(args.ep_layouts)
        result.update({"ep_mape_by_stage": cal["ep_mape_by_stage"], "ep_mape": cal["ep_mape"],
                       "ep_mape_goal": EP_MAPE_GOAL,
                       "ep_mape_goal_met": cal["ep_mape"] is not None and cal["ep_mape"] <= EP_MAPE_GOAL,
                       "ep_calibration": cal})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
