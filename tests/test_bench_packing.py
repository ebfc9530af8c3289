"""tools/bench_packing.py runs (--smoke) and reports what it promises: its JSON keys, a packed layout that
runs fewer token slots than the padded one, and the two layouts' gradients equal within float noise."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_packing_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_packing.py"), "--smoke"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("packed_tokens_per_s", "padded_tokens_per_s", "speedup", "max_abs_grad_diff", "matmul_gflop_per_s"):
        assert result[key] > 0 or key == "max_abs_grad_diff", key
    assert result["max_abs_grad_diff"] <= 1e-5
    assert result["packed"]["token_slots"] < result["padded"]["token_slots"]
    assert result["packed"]["fraction_of_matmul"] > 0 and result["padded"]["fraction_of_matmul"] > 0
