"""tools/bench_load.py --smoke end to end (a tiny checkpoint, three subprocesses): the JSON on its last line
has every figure, and the derived ones follow from the measured ones. No timing or memory-goal assertions:
the tiny shapes are dwarfed by allocator noise, and the machine is shared."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_load.py"
STAGES = ("actor-train", "actor-gen", "ref-infer")


@pytest.fixture(scope="module")
def out():
    res = subprocess.run([sys.executable, str(TOOL), "--smoke"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_json_has_the_headline_figures_and_says_what_the_goal_applies_to(out):
    for key in ("seconds", "bytes_read", "ckpt_bytes", "peak_rss_over_ckpt", "transient_over_ckpt",
                "transient_max_upper_over_ckpt", "read_max_extra_over_ckpt", "goal_met", "streaming", "naive",
                "streaming_over_naive", "machine", "throughput", "num_layers", "stages"):
        assert key in out, key
    assert "transient_over_ckpt" in out["rss_note"] and "1.5" in out["rss_note"]
    assert out["goal_met"] == (out["transient_over_ckpt"] <= out["goal_transient_over_ckpt"] == 1.5)
    assert out["optimizer"] is False and "params only" in out["optimizer_note"]
    assert out["checkpoint"]["files"] > 1 and out["checkpoint"]["dtype"] == "bfloat16"  # save_hf, sharded


def test_transient_is_peak_minus_before_minus_live_over_the_checkpoint(out):
    ckpt = out["ckpt_bytes"]
    for run in (out["streaming"], out["naive"]):
        assert run["transient_bytes"] == run["peak_rss"] - run["rss_before"] - run["live_bytes"]
        assert run["transient_over_ckpt"] == pytest.approx(run["transient_bytes"] / ckpt)
        assert run["peak_over_ckpt"] == pytest.approx(run["peak_rss"] / ckpt)
        assert run["cpu_s"] == pytest.approx(run["cpu_user_s"] + run["cpu_sys_s"])
        assert run["peak_rss"] >= run["rss_after"] and run["hwm_reset"]
        assert run["live_bytes"] == sum(run["per_stage"][s]["live_bytes"] for s in STAGES)
    assert out["transient_over_ckpt"] == out["streaming"]["transient_over_ckpt"]


def test_both_paths_lay_out_the_same_bytes_the_specs_predict(out):
    assert out["streaming"]["live_bytes"] == out["naive"]["live_bytes"] == out["estimate"]["live_bytes"]


def test_the_ratios_are_streaming_over_naive(out):
    s, n, r = out["streaming"], out["naive"], out["streaming_over_naive"]
    assert r["seconds"] == pytest.approx(s["seconds"] / n["seconds"])
    assert r["peak_rss"] == pytest.approx(s["peak_rss"] / n["peak_rss"])
    if n["transient_bytes"] > 0:
        assert r["transient"] == pytest.approx(s["transient_bytes"] / n["transient_bytes"])


def test_each_stage_reads_the_checkpoint_and_throughput_is_bytes_over_seconds(out):
    tensor_bytes = out["estimate"]["ckpt_bytes"]  # every parameter once in bf16 (headers excluded)
    assert out["bytes_read"] >= len(STAGES) * tensor_bytes
    assert out["naive"]["rchar"] >= tensor_bytes  # load_hf reads the whole checkpoint once
    t, m = out["throughput"], out["machine"]
    assert t["read_GBps"] == pytest.approx(out["bytes_read"] / out["seconds"] / 1e9)
    assert t["read_over_file_read"] == pytest.approx(t["read_GBps"] / m["file_read"]["GBps"])
    assert t["laid_out_over_memcpy"] == pytest.approx(t["laid_out_GBps"] / m["host"]["memcpy_GBps"])
    assert m["file_read"]["bytes"] == out["ckpt_bytes"]


def test_stages_state_the_layouts_shapes_and_dtypes_actually_loaded(out):
    st = out["stages"]
    assert [(st[s]["layout"], st[s]["dp"]) for s in STAGES] == [("tp2", 4), ("tp2", 4), ("tp4", 2)]
    assert {dtype for _, dtype in st["actor-train"]["params"].values()} == {"float32"}  # bf16 -> master weights
    assert {dtype for _, dtype in st["actor-gen"]["params"].values()} == {"bfloat16"}  # the compute dtype
    wk_train, _ = st["actor-train"]["params"]["layers/attn/wk"]
    wk_ref, _ = st["ref-infer"]["params"]["layers/attn/wk"]
    assert wk_train[0] == out["num_layers"] and wk_ref[2] == 2 * wk_train[2]  # tp4 stores each of 2 kv heads twice
