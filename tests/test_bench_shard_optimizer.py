"""tools/bench_shard_optimizer.py runs (--quick) and reports what it promises: its JSON keys, a training replica's
state with the optimizer split over dp 8 below 1/2 of the whole state's (the parameters stay whole, Adam's moments
shrink 8-fold), a lower step peak, and the same trained state bit for bit. Properties, not timings."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("state_bytes_whole", "state_bytes_split", "peak_bytes_whole", "peak_bytes_split", "train_seconds_whole",
        "train_seconds_split", "state_ratio", "peak_ratio", "speed_ratio", "same_result",
        "machine_matmul_flops_per_s", "machine_copy_bytes_per_s", "matmul_fraction_whole", "matmul_fraction_split")


def test_bench_shard_optimizer_quick():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_shard_optimizer.py"), "--quick"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    missing = [k for k in KEYS if k not in result]
    assert not missing, missing
    assert result["dp"] == 8 and result["same_result"] is True
    # params P, Adam 2P: whole 3P per device, split P + 2P/8 = 1.25P (a scalar step count aside)
    assert abs(result["state_ratio"] - 1.25 / 3) < 1e-3
    assert result["peak_bytes_split"] < result["peak_bytes_whole"]
