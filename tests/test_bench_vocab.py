"""tools/bench_vocab.py runs (--quick) and reports what it promises: its JSON keys, a chunked peak below the
whole-logits peak in both programs (XLA's buffer assignment), and the same log-probs within float noise,
before and after one update."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_vocab_quick():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_vocab.py"), "--quick"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("chunked_peak_bytes", "unchunked_peak_bytes", "chunked_tokens_per_s", "unchunked_tokens_per_s",
                "matmul_flops_per_s", "copy_bytes_per_s"):
        assert result[key] > 0, key
    assert result["chunks"] == 8 and result["chunk_width"] == 1024
    assert result["peak_ratio"] == result["chunked_peak_bytes"] / result["unchunked_peak_bytes"] < 1
    assert result["score_peak_ratio"] < 1 and result["train_peak_ratio"] < 1
    assert result["max_abs_diff"] <= 1e-5 and result["max_abs_diff_after_update"] <= 1e-5
