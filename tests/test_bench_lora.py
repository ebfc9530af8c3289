"""tools/bench_lora.py runs (--quick) and reports what it promises: its JSON keys, and LoRA's actor-train state
(StateSpec), training-step peak (XLA's buffer assignment) and weight-sync bytes (the sync graph's) below full
fine-tuning's, and the frozen base held once by colocated stages that hold it alike. Properties of the programs
and specs, not timings."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KEYS = ("peak_bytes_full", "peak_bytes_lora", "peak_ratio", "state_bytes_full", "state_bytes_lora",
        "transition_bytes_ratio", "sync_bytes_full", "sync_bytes_lora", "sync_bytes_ratio", "sync_seconds_full",
        "sync_seconds_lora", "engine_adopt_seconds_full", "engine_adopt_seconds_lora",
        "train_seconds_full", "train_seconds_lora", "train_speed_ratio", "adapter_params",
        "total_params", "rank", "matmul_flops_per_s", "copy_bytes_per_s", "train_flops_fraction_full",
        "train_flops_fraction_lora", "goal_peak_ratio_max", "goal_sync_ratio_max", "goal_peak_met", "goal_sync_met",
        "colocated_bytes_full", "colocated_bytes_lora_unshared", "colocated_bytes_lora", "job_peak_bytes_full",
        "job_peak_bytes_lora", "job_peak_ratio", "notes")


def test_bench_lora_quick():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_lora.py"), "--quick"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    missing = [k for k in KEYS if k not in result]
    assert not missing, missing
    assert result["rank"] == 16 and 0 < result["adapter_params"] < result["total_params"]
    assert result["state_bytes_lora"] < result["state_bytes_full"]
    assert result["peak_bytes_lora"] < result["peak_bytes_full"]
    assert result["peak_ratio"] == result["peak_bytes_lora"] / result["peak_bytes_full"]
    # with LoRA the sync re-derives the adapters alone: their bytes in the generation dtype
    assert 0 < result["sync_bytes_lora"] < 0.2 * result["sync_bytes_full"]
    assert result["sync_bytes_ratio"] == result["sync_bytes_lora"] / result["sync_bytes_full"]
    assert result["goal_peak_ratio_max"] == 0.5 and result["goal_sync_ratio_max"] == 0.05
    # colocated: actor-gen and ref-infer hold the frozen base alike (bfloat16), so one copy of it goes: the whole
    # reference unit, base parameters x 2 bytes (the float32 training stage keeps its own)
    assert result["colocated_bytes_lora_unshared"] - result["colocated_bytes_lora"] == 2 * result["base_params"]
    assert result["colocated_bytes_full"] > result["colocated_bytes_lora_unshared"]
    assert result["job_peak_ratio"] == result["job_peak_bytes_lora"] / result["job_peak_bytes_full"] < 1
