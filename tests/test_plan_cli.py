"""`python -m nereus_jax.plan`: the table, the one-object JSON others rely on, and its errors."""

import json
import subprocess
import sys

from nereus_jax.plan import main

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
