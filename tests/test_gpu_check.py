"""tools/gpu_check.sh --smoke end to end (one subprocess, tiny shapes on CPU, ~30 s): it runs from the repo root
with $OUT set, writes one JSON file there and prints the same object as its last line, with every figure the
issue asks for a positive finite number, or null with a reason where this machine lacks the feature (pinned_host
memory). No assertions on the figures' sizes: tiny shapes on a shared CPU measure nothing."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("prefill_tokens_per_s", "train_mfu", "matmul_tflops", "copy_bandwidth_gb_s")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    res = subprocess.run(["bash", "tools/gpu_check.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), out


def test_one_json_file_in_out_is_the_printed_last_line(run):
    printed, out = run
    assert sorted(p.name for p in out.glob("*.json")) == ["gpu_check.json"]
    assert json.loads((out / "gpu_check.json").read_text()) == printed
    assert printed["complete"] is True and printed["smoke"] is True


def test_every_figure_is_positive_and_finite_or_null_with_a_reason(run):
    d, _ = run
    for key in ("device", "jax_version", "decode", *FIGURES, "host_bandwidth", "smoke", "reasons"):
        assert key in d, key
    assert isinstance(d["device"], str) and d["device"] and d["jax_version"]
    reasons = d["reasons"]
    for key in FIGURES:
        assert positive(d[key]), (key, d[key], reasons)
    assert [e["batch"] for e in d["decode"]] == [4, 8]
    for entry in d["decode"]:
        for key in ("tokens_per_s", "roofline_tokens_per_s", "fraction_of_roofline"):
            assert positive(entry[key]), (entry, reasons)
        assert entry["fraction_of_roofline"] == pytest.approx(entry["tokens_per_s"] / entry["roofline_tokens_per_s"])
        assert entry["recompiled_in_timed_window"] is False
    host = d["host_bandwidth"]
    if host is None:
        assert isinstance(reasons.get("host_bandwidth"), str) and reasons["host_bandwidth"]
    else:
        for key in ("executor_gb_s", "device_put_gb_s", "ratio"):
            assert positive(host[key]), (key, host)
        assert host["ratio"] == pytest.approx(host["executor_gb_s"] / host["device_put_gb_s"])
        assert host["round_trips_exact"] is True
    assert set(reasons) <= {"host_bandwidth"}, reasons  # nothing else failed or was skipped


def test_the_train_step_compiles_once(run):
    d, _ = run
    assert d["train"]["compiled_programs"] in (1, None)  # None: this jax has no jit cache size to read
    assert d["train"]["nonfinite"] == 0.0 and d["train"]["micro_batch_tokens"] * d["train"]["accumulation_steps"] \
        == d["train"]["tokens_per_step"]
