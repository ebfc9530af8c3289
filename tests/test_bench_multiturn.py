"""tools/bench_multiturn.py runs (--quick) and reports what it promises: its JSON keys, 4-turn trajectories that
the budget never cuts, tool outputs of 32-128 digits, positive throughputs and their ratios, the kept cache
drawing the trajectories re-prefilling draws with fewer tokens prefilled. Its scripted environment and prefill
count are checked directly too.
Properties of the runs, not timings."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bench_multiturn.py"

KEYS = ("reprefill_tokens_per_s", "latency_tokens_per_s", "latency_throughput_ratio", "kept_cache_tokens_per_s",
        "speedup", "same_tokens", "kept_prefill_tokens_per_model_token", "goal_speedup",
        "goal_latency_throughput_ratio", "turns_mean", "env_tokens_mean",
        "response_tokens_mean", "trajectories_truncated", "prefill_tokens_per_model_token", "model_tokens",
        "prefill_tokens", "rows", "tool_latency_s", "tool_seconds_latency", "machine_matmul_flops_per_s",
        "machine_copy_bytes_per_s", "simulated", "device", "same_tokens_latency", "speedup_bound", "turn_programs",
        "prefill_slots_traces", "warm_turns_seconds", "slots", "kv_cache_bytes")
TEMPLATE = len("[result: ]")  # the plain format around a tool's output


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_multiturn_under_test", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_environment_answers_three_turns_with_32_to_128_digits_then_ends(bench):
    env = bench.FixedToolEnv(None, (), "plain")
    messages = env.reset(SimpleNamespace(prompt="12+34="))
    lengths = []
    for turn in range(1, 4):
        messages = messages + [{"role": "assistant", "content": "x"}]
        step = env.step(messages[:-1], messages[-1])
        (tool,) = step.messages
        assert not step.done and step.tool_calls == 1 and tool["content"].isdigit()
        assert tool["content"] == env.step(messages[:-1], messages[-1]).messages[0]["content"]  # deterministic
        lengths.append(len(tool["content"]))
        assert lengths[-1] == bench.tool_length("12+34=", turn)
        messages = messages + step.messages
    assert all(32 <= k <= 128 for k in lengths)
    assert env.step(messages, {"role": "assistant", "content": "x"}).done


def test_prefill_counts_one_prefill_a_prompt_then_the_trajectory_before_each_later_turn(bench):
    own = np.asarray([[1, 1, 0, 0, 1, 0, 1, 0], [1, 0, 1, 0, 0, 0, 0, 0]], np.int32)
    ctx = np.asarray([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]], np.int32)
    batch = SimpleNamespace(prompt_mask_bp=np.asarray([[0, 1, 1, 1], [0, 1, 1, 1]]), response_mask_br=own,
                            context_mask_br=ctx)
    # turn 1: the prompt once (3, shared by n=2 samples); row 0: turns at 4 and 6; row 1: a turn at 2
    assert bench.prefill_tokens(batch, 2) == 3 + (3 + 4) + (3 + 6) + (3 + 2)


@pytest.mark.long  # ~60 s; its same-tokens checks run at engine level in tests/engine/test_engine_turns.py
def test_bench_multiturn_quick():
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count=8".strip()
    out = subprocess.run([sys.executable, str(TOOL), "--quick"], capture_output=True, text=True, check=True,
                         cwd=ROOT, timeout=600, env={**os.environ, "XLA_FLAGS": flags})
    r = json.loads(out.stdout.strip().splitlines()[-1])
    missing = [k for k in KEYS if k not in r]
    assert not missing, missing
    assert r["reprefill_tokens_per_s"] > 0 and r["latency_tokens_per_s"] > 0 and r["kept_cache_tokens_per_s"] > 0
    assert r["latency_throughput_ratio"] == r["latency_tokens_per_s"] / r["kept_cache_tokens_per_s"]
    assert r["speedup"] == r["kept_cache_tokens_per_s"] / r["reprefill_tokens_per_s"]
    assert r["speedup_bound"] > 0 and r["prefill_slots_traces"] == r["turn_programs"] > 0  # warmed: no new shape
    assert 0 < r["latency_throughput_ratio"] < 1.5
    # FixedToolEnv forces 4 turns, and the budget cuts no trajectory
    assert r["turns_mean"] == 4 and r["trajectories_truncated"] == 0
    assert 3 * (32 + TEMPLATE) <= r["env_tokens_mean"] <= 3 * (128 + TEMPLATE)
    assert r["response_tokens_mean"] >= 4 and r["model_tokens"] == r["response_tokens_mean"] * r["rows"]
    # every later turn re-prefills the prompt and the trajectory before it, tool outputs included
    assert r["prefill_tokens_per_model_token"] > 1
    assert r["tool_seconds_latency"] >= 0.99 * 3 * r["rows"] * r["tool_latency_s"]  # every tool call slept
    assert r["same_tokens"]  # the kept cache and re-prefilling draw the same trajectories
    assert r["same_tokens_latency"]  # and so do turns whose tools take 0.1 s (another schedule of the turns)
    assert r["kept_prefill_tokens_per_model_token"] < r["prefill_tokens_per_model_token"]
    assert r["goal_speedup"] == 2.0 and r["goal_latency_throughput_ratio"] == 0.8
    assert r["machine_matmul_flops_per_s"] > 0 and r["machine_copy_bytes_per_s"] > 0
    assert r["simulated"] is False and r["device"]
