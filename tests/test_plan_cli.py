"""`python -m nereus_jax.plan`: the table, the one-object JSON others rely on, and its errors."""

import json
import subprocess
import sys

import pytest

from nereus_jax.config import resolve_model
from nereus_jax.elastic.costs.calibration_file import save_calibration
from nereus_jax.elastic.costs.model import CostModel
from nereus_jax.elastic.planner import Planner
from nereus_jax.elastic.workload import Workload
from nereus_jax.plan import main
from nereus_jax.sharding import Layout, check_layout

FLAGSHIP = ["--model", "llama3.1-8b", "--algorithm", "ppo", "--gpus", "64", "--hardware", "h200",
            "--response-length", "4096"]
STAGES = {"actor-gen", "actor-infer", "ref-infer", "reward-infer", "critic-infer", "actor-train", "critic-train"}


def test_json_is_one_object_with_the_names_others_rely_on(capsys):
    assert main([*FLAGSHIP, "--json"]) == 0
    out = capsys.readouterr().out.strip()
    assert "\n" not in out
    data = json.loads(out)
    assert set(data) >= {"plan", "step_latency_s", "stage_latency_s", "memory_per_device_bytes", "decision_ms"}
    assert set(data["plan"]) == STAGES == set(data["stage_latency_s"])
    assert len(data["memory_per_device_bytes"]) == 64
    assert max(data["memory_per_device_bytes"].values()) <= 0.9 * 141e9
    for stage in data["plan"].values():
        assert len(stage["replicas"]) == stage["dp"] and all(len(r) == stage["tp"] * stage["pp"]
                                                             for r in stage["replicas"])
    assert data["step_latency_s"] >= max(data["stage_latency_s"].values()) and data["decision_ms"] > 0


def test_table_shows_plan_memory_latency_and_decision_time(capsys):
    assert main(["--model", "llama3.2-1b", "--algorithm", "grpo", "--gpus", "16", "--hardware", "a100",
                 "--response-length", "1024", "--batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "64 prompts x 8 samples" in out  # grpo defaults to 8 samples per prompt, as in the paper
    for name in ("actor-gen", "ref-infer", "reward-infer", "actor-train"):
        assert name in out
    assert "critic-" not in out
    assert "step latency" in out and "memory per GPU" in out and "GiB" in out and "decision:" in out


def test_errors_name_what_to_change(capsys):
    assert main([*FLAGSHIP[:-4], "--hardware", "h300", "--response-length", "64"]) == 2
    assert "valid: h100, h200, a100, mi250x, cpu" in capsys.readouterr().err
    assert main(["--model", "llama9"]) == 2
    assert "unknown model preset 'llama9'" in capsys.readouterr().err
    assert main(["--algorithm", "grpo", "--samples-per-prompt", "1"]) == 2
    assert "samples-per-prompt >= 2" in capsys.readouterr().err
    assert main(["--gpus", "1", "--hardware", "a100", "--response-length", "1024"]) == 1
    err = capsys.readouterr().err
    assert "model-stage actor-train" in err and "bytes) short" in err


def test_help_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "nereus_jax.plan", "--help"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and "--response-length" in done.stdout and "--json" in done.stdout


SMALL = ["--model", "llama3.2-1b", "--algorithm", "grpo", "--gpus", "16", "--response-length", "1024",
         "--batch", "64"]


def _slow_gemm_calibration(run_dir):
    """A100's priors with GEMMs at a tenth of their efficiency and a GEMM size term, as a run would save them."""
    prior = CostModel("a100")
    eff = {**prior.efficiency, "gemm": prior.efficiency["gemm"] / 10}
    half = {**prior.half_sizes, "gemm_rows": 48.0}
    run_dir.mkdir()
    save_calibration(run_dir, CostModel("a100", eff, half), steps=20, model="tiny")
    return eff, half


def test_calibration_from_a_run_replaces_the_priors(tmp_path, capsys):
    eff, half = _slow_gemm_calibration(tmp_path / "run")
    assert main([*SMALL, "--hardware", "a100", "--json"]) == 0
    prior = json.loads(capsys.readouterr().out)
    assert prior["calibration"] is None
    assert main([*SMALL, "--calibration", str(tmp_path / "run"), "--json"]) == 0  # the run's hardware: a100
    calibrated = json.loads(capsys.readouterr().out)
    assert calibrated["calibration"] == str(tmp_path / "run" / "calibration.json")
    assert calibrated["hardware"] == "a100"
    assert calibrated["step_latency_s"] > 1.5 * prior["step_latency_s"]
    reference = Planner(CostModel("a100", eff, half)).plan(resolve_model("llama3.2-1b"), "grpo",
                                                           Workload.fixed(64, 512, 1024, 8, shard_optimizer=True), 16)
    assert calibrated["step_latency_s"] == reference.step_latency_s
    assert calibrated["plan"] == reference.to_json()["plan"]
    # the file itself, with the same --hardware: the same plan; the table names the calibration
    assert main([*SMALL, "--hardware", "a100", "--calibration", str(tmp_path / "run" / "calibration.json")]) == 0
    out = capsys.readouterr().out
    assert f"cost model: calibration {tmp_path / 'run' / 'calibration.json'} (model tiny, steps 20)" in out
    assert f"{reference.step_latency_s:.3f}" in out


@pytest.mark.parametrize("case, needle", [
    ("no-dir", "no such file or directory"),
    ("empty-run-dir", "no calibration.json in this directory"),
    ("not-json", "not valid JSON"),
    ("format-2", "calibration format 2 is not supported"),
    ("unknown-class", "unknown efficiency class ['tensor_cores']"),
    ("other-hardware", "--hardware h100 differs from the hardware of --calibration"),
])
def test_bad_calibration_exits_2_with_one_line_naming_the_path(tmp_path, capsys, case, needle):
    run = tmp_path / "run"
    _slow_gemm_calibration(run)
    file = run / "calibration.json"
    data = json.loads(file.read_text())
    where, extra = str(file), []
    if case == "no-dir":
        where = str(tmp_path / "nope")
    elif case == "empty-run-dir":
        (tmp_path / "empty").mkdir()
        where = str(tmp_path / "empty")
    elif case == "not-json":
        file.write_text('{"format": 1, "hardware": ')
    elif case == "format-2":
        file.write_text(json.dumps({**data, "format": 2}))
    elif case == "unknown-class":
        file.write_text(json.dumps({**data, "efficiency": {**data["efficiency"], "tensor_cores": 0.5}}))
    else:
        extra = ["--hardware", "h100"]
    assert main([*SMALL, *extra, "--calibration", where, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("error: --") and where in err and needle in err
    if case == "other-hardware":
        assert "a100" in err and "drop --hardware" in err


def test_lora_rank_plans_with_the_adapters_memory(capsys):
    """--lora-rank: the planner prices LoRA's state (a frozen base, Adam state for the adapters alone), so a
    pool that cannot hold full fine-tuning's actor-train holds LoRA's; reference: the same call without it."""
    small = ["--model", "qwen3-8b", "--algorithm", "grpo", "--gpus", "2", "--hardware", "h100", "--response-length",
             "512", "--batch", "16", "--json"]
    assert main(small) == 1  # full fine-tuning: 8B x 16 bytes does not fit 2 GPUs
    assert "model-stage actor-train" in capsys.readouterr().err
    assert main([*small, "--lora-rank", "16"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert max(data["memory_per_device_bytes"].values()) <= 0.9 * 80e9
    assert main([*small, "--lora-rank", "-1"]) == 2
    assert "--lora-rank must be >= 0" in capsys.readouterr().err


def test_mixture_of_experts_plan_is_runnable_and_searches_ep(capsys):
    """qwen3-30b-a3b on 64 h200: every model-stage's layout is one the runtime builds (``check_layout``: no ep
    with pp > 1), each replica is tp x pp x ep devices, and the search with ep finds a step no slower than the
    same search restricted to ep = 1 (the reference). Whether ep > 1 wins here is the cost model's call, not
    asserted: with activations whole on every expert rank it does not (docs/results.md)."""
    args = ["--model", "qwen3-30b-a3b", "--gpus", "64", "--hardware", "h200"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    cfg = resolve_model("qwen3-30b-a3b")
    for stage in data["plan"].values():
        assert all(len(r) == stage["tp"] * stage["pp"] * stage["ep"] for r in stage["replicas"])
        check_layout(cfg, Layout(stage["tp"], stage["pp"], stage["ep"]))
    assert data["plan"]["actor-gen"]["ep"] == 1
    workload = Workload.fixed(512, 512, 4096, shard_optimizer=True)
    without = Planner("h200").plan(cfg, "ppo", workload, 64,
                                   options=lambda p: {s: o.masked(o.table[:, 5] == 1) for s, o in p.options().items()})
    assert data["step_latency_s"] <= without.step_latency_s * (1 + 1e-9)
    assert without.table().splitlines()[0].split()[:5] == ["model-stage", "tp", "pp", "ep", "dp"]
