"""A small drift trace that plans fast: Qwen2.5-1.5B PPO on 4-16 simulated A100s, 10 steps."""

import pytest

from nereus_jax.sim import build_trace

SMALL = {
    "name": "small",
    "description": "test trace",
    "hardware": "a100",
    "models": "qwen2.5-1.5b",
    "algorithm": "ppo",
    "steps": 10,
    "seed": 0,
    "workload": {"prompts_per_step": 512, "samples_per_prompt": 1, "packed": True,
                 "prompt_length": {"mean": 128, "p95": 256, "max": 512}},
    "response_length": {"max_over_p95": 1.15, "jitter": 0.03,
                        "keyframes": [{"step": 0, "mean": 500, "p95": 600}, {"step": 9, "mean": 2500, "p95": 3000}]},
    "pool": [{"step": 0, "devices": 4}, {"step": 3, "devices": 16}, {"step": 7, "devices": 8}],
    "controller": {"gamma": 0.5},
}


@pytest.fixture(scope="module")
def small_module_data():
    import copy

    return copy.deepcopy(SMALL)


@pytest.fixture
def small_data():
    import copy

    return copy.deepcopy(SMALL)


@pytest.fixture
def small_trace(small_data):
    return build_trace(small_data)
