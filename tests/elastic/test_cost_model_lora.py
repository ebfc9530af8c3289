"""The cost model's training FLOPs with LoRA against hand counts: the frozen base (layers and lm head) makes
one forward-sized pass less (no weight gradient), the adapters' GEMMs run on every pass, a value head still
trains. (XLA drops the frozen weights' gradients from the compiled train step, pp 1, 1F1B and GPipe alike:
``runtime.step.losses.make_train_step`` never accumulates them.)"""

import dataclasses

import pytest

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs.latency import call_latency
from nereus_jax.elastic.hardware import EFFICIENCY_CLASSES, HARDWARE
from nereus_jax.elastic.workload import Workload

# d=64, 4 heads of 16, 2 kv heads, mlp 256, 2 layers, vocab 128 (tests/elastic/test_cost_model.py's SMALL)
DENSE = ModelConfig(name="small", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=256, param_dtype="float32", compute_dtype="bfloat16")
LORA = dataclasses.replace(DENSE, lora_rank=4)
# compute-bound, free communication and overheads: GEMM seconds x peak = GEMM FLOPs exactly
HW = dataclasses.replace(HARDWARE["h100"], memory_bandwidth=1e30, intra_node_bandwidth=1e30,
                         inter_node_bandwidth=1e30, intra_node_latency_s=0.0, inter_node_latency_s=0.0,
                         launch_overhead_s=0.0, layer_overhead_s=0.0)
ONES = (1.0,) * len(EFFICIENCY_CLASSES)
WL = Workload.fixed(4, 24, 40)  # rows padded to 64 tokens, the head on the 40 response positions
ROWS, TOKENS, HEAD_TOKENS, LAYERS = 4, 64, 40, 2

# by hand, per token, one forward: q 64x64, k and v 64x32, o 64x64, gate/up/down 64x256, 2 FLOPs per weight
BASE_LAYER = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 256)  # 122,880
# rank 4 on every projection, r * (in + out): q 4*(64+64), k and v 4*(64+32), o 4*(64+64), gate/up/down 4*(64+256)
ADAPTER_LAYER = 2 * (512 + 384 + 384 + 512 + 3 * 1280)  # 11,264
LM_HEAD, VALUE_HEAD = 2 * 64 * 128, 2 * 64 * 1


def _gemm_flops(cfg, stage, remat=False):
    return call_latency(cfg, stage, 1, 1, ROWS, remat, WL, HW, ONES, 1).gemm * HW.peak_flops


def _flops(base_passes, adapter_passes, head_passes, head=LM_HEAD):
    layers = ROWS * TOKENS * LAYERS * (base_passes * BASE_LAYER + adapter_passes * ADAPTER_LAYER)
    return layers + ROWS * HEAD_TOKENS * head_passes * head


def test_a_lora_training_call_skips_the_frozen_weights_gradient_and_adds_the_adapters():
    assert _gemm_flops(DENSE, "actor-train") == pytest.approx(_flops(3, 0, 3))
    assert _gemm_flops(LORA, "actor-train") == pytest.approx(_flops(2, 3, 2))
    assert _gemm_flops(LORA, "actor-train", remat=True) == pytest.approx(_flops(3, 4, 2))  # remat: layers only
    # the saving is a third of the base's training GEMMs, less what the adapters add
    saved = _gemm_flops(DENSE, "actor-train") - _gemm_flops(LORA, "actor-train")
    assert saved == pytest.approx(_flops(1, -3, 1))


def test_scoring_runs_the_adapters_once_and_a_value_head_still_trains():
    assert _gemm_flops(LORA, "actor-infer") == pytest.approx(_flops(1, 1, 1))
    assert _gemm_flops(LORA, "critic-train") == pytest.approx(_flops(2, 3, 3, VALUE_HEAD))
