"""tools/bench_moe.py runs (--quick) and reports what it promises: its JSON keys, a dense layer of the same
active FLOPs (width top_k x moe_width), positive throughputs, the grouped matmul nereus_jax runs on this backend,
and it (and the ragged_dot and blocked alternatives) equal to the masked-dense reference (every expert on every
token, weighted by the scattered top-k routing weights) within float noise, forward and gradients. No timing
assertions: the ratios are figures, not pass/fail on a shared CPU."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_moe_quick():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_moe.py"), "--quick"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("tokens", "hidden", "experts", "top_k", "moe_width", "dense_width", "moe_fwd_tokens_per_s",
                "dense_fwd_tokens_per_s", "fwd_ratio", "moe_train_tokens_per_s", "dense_train_tokens_per_s",
                "train_ratio", "active_flops_per_token", "matmul_flops_per_s", "copy_bytes_per_s",
                "moe_fwd_flops_fraction", "moe_train_flops_fraction", "dense_fwd_flops_fraction",
                "dense_train_flops_fraction", "moe_peak_bytes", "dense_peak_bytes", "moe_fwd_peak_bytes",
                "moe_train_peak_bytes", "dense_fwd_peak_bytes", "dense_train_peak_bytes", "routing_max_over_mean",
                "onehot_train_tokens_per_s", "blocked_train_tokens_per_s"):
        assert result[key] > 0, key
    assert (result["tokens"], result["hidden"], result["experts"], result["top_k"], result["moe_width"]) == (
        256, 128, 8, 2, 64)
    assert result["dense_width"] == result["top_k"] * result["moe_width"]
    assert result["moe_active_flops_per_token"] == result["dense_active_flops_per_token"] == \
        result["active_flops_per_token"] == 2 * 3 * result["hidden"] * result["dense_width"]
    assert result["fwd_ratio"] == result["moe_fwd_tokens_per_s"] / result["dense_fwd_tokens_per_s"]
    assert result["train_ratio"] == result["moe_train_tokens_per_s"] / result["dense_train_tokens_per_s"]
    assert result["goal_ratio_min"] == 0.7 and result["goal_met"] == (result["train_ratio"] >= 0.7)
    assert result["routing_max_over_mean"] >= 1.0
    assert result["max_abs_diff_vs_masked_dense"] <= 1e-5
    assert result["max_abs_grad_diff_vs_masked_dense"] <= 1e-5
    assert result["max_abs_diff_blocked_vs_masked_dense"] <= 1e-5
    assert result["ragged_dot_lowering"] in ("native", "dense_fallback")
    # nereus_jax's grouped matmul on this backend: XLA:CPU's ragged_dot is a dense fallback, so blocks
    assert result["moe_impl"] == ("blocks" if result["backend"] == "cpu" else "ragged_dot")
    assert result["ragged_train_tokens_per_s"] > 0 and result["max_abs_grad_diff_ragged_vs_masked_dense"] <= 1e-5
    assert result["moe_weight_bytes"] == result["experts"] // result["top_k"] * result["dense_weight_bytes"] + 4 * \
        result["hidden"] * result["experts"]  # every expert's weights plus the router's
    assert any("Layout.ep" in note and "MAPE" in note for note in result["notes"])
