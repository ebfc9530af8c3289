"""The cost model against references: the parameter tree and the sharding rules, hand-counted FLOPs and
bytes for a small config, the memory of a known model, and calibration that recovers known efficiencies."""

import dataclasses
import math

import numpy as np
import pytest

from nereus_jax.config import ModelConfig, resolve_model
from nereus_jax.elastic.costs import (
    CostModel,
    Measurement,
    StageChoice,
    allreduce_seconds,
    attention_flops,
    kv_bytes_per_token,
    layer_flops_per_token,
    layout_problem,
    param_count,
    params_per_device,
    resident_bytes,
    stage_latency,
    stage_memory,
    state_bytes,
    transfer_seconds,
    transition_seconds,
    working_bytes,
)
from nereus_jax.elastic.costs.candidates import Pricer
from nereus_jax.elastic.costs.counts import layer_activation_bytes_per_token
from nereus_jax.elastic.costs.latency import call_latency, step_terms_latency
from nereus_jax.elastic.hardware import (
    CONSERVATIVE_EFFICIENCY,
    EFFICIENCY_CLASSES,
    HARDWARE,
    HardwareError,
    get_hardware,
)
from nereus_jax.elastic.workload import LengthStats, Workload, WorkloadError
from nereus_jax.model_stage import StageError
from nereus_jax.models import abstract_params, count_params, param_axes
from nereus_jax.sharding import Layout, LayoutError, check_layout, logical_to_spec, stored_shapes
from nereus_jax.vocab_chunks import chunk_width

# A small config whose counts are easy by hand: d=64, 4 heads of 16, 2 kv heads, mlp 256, 2 layers, vocab 128.
SMALL = ModelConfig(name="small", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=256, param_dtype="float32", compute_dtype="bfloat16")
LLAMA8B = resolve_model("llama3.1-8b")
# Compute-bound, free communication and overheads: seconds x peak = FLOPs exactly.
COMPUTE_ONLY = dataclasses.replace(HARDWARE["h100"], memory_bandwidth=1e30, intra_node_bandwidth=1e30,
                                   inter_node_bandwidth=1e30, intra_node_latency_s=0.0, inter_node_latency_s=0.0,
                                   launch_overhead_s=0.0, layer_overhead_s=0.0)
ONES = (1.0,) * len(EFFICIENCY_CLASSES)


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _sharded_count(cfg, tp, pp, head):
    """Scalars per device, from the sharding module's stored shapes and rules (the reference)."""
    shapes, axes = stored_shapes(cfg, Layout(tp, pp), head=head), param_axes(cfg, head=head)
    axes_by_path = dict(_flat(axes))
    total = 0
    for path, shape in _flat(shapes):
        spec = logical_to_spec(axes_by_path[path], "train", ("pp", "tp"))
        total += math.prod(n // {"tp": tp, "pp": pp}[a] if a else n for n, a in zip(shape, spec, strict=True))
    return total


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-0.5b", "llama3.1-8b"])
@pytest.mark.parametrize("head", ["lm", "value"])
def test_param_count_matches_the_parameter_tree(name, head):
    cfg = resolve_model(name)
    assert param_count(cfg, head) == count_params(abstract_params(cfg, head=head))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (4, 2), (2, 4)])
@pytest.mark.parametrize("head", ["lm", "value"])
def test_params_per_device_match_stored_shards(tp, pp, head):
    cfg = dataclasses.replace(SMALL, num_layers=4, num_kv_heads=2, qkv_bias=True)
    assert params_per_device(cfg, tp, pp, head) == _sharded_count(cfg, tp, pp, head)


def test_layout_rules_agree_with_check_layout():
    cfgs = [SMALL, resolve_model("qwen2.5-0.5b"), dataclasses.replace(SMALL, num_heads=6, num_kv_heads=3,
                                                                       hidden_size=96, num_layers=3)]
    for cfg in cfgs:
        for tp in (1, 2, 3, 4, 6, 8):
            for pp in (1, 2, 3, 4):
                try:
                    check_layout(cfg, Layout(tp, pp))
                    expected = None
                except LayoutError:
                    expected = "error"
                got = layout_problem(cfg, tp, pp)
                assert (got is None) == (expected is None), (cfg.name, tp, pp, got)


def test_layer_flops_by_hand():
    # per token: 2 x (q + o: 2*d*h*e, k + v: 2*d*k*e, mlp: 3*d*f) = 2 x (8192 + 4096 + 49152)
    assert layer_flops_per_token(SMALL, 1) == 2 * 61440
    assert layer_flops_per_token(SMALL, 2) == 61440
    # tp=4 > 2 kv heads: each kv head stored twice, so k/v work doubles: (8192 + 8192 + 49152) * 2 / 4
    assert layer_flops_per_token(SMALL, 4) == 32768
    # causal attention over s positions: dense computes the square, fused the triangle
    assert attention_flops(SMALL, 1, 10, 10, fused=False) == 4 * 4 * 16 * 100
    assert attention_flops(SMALL, 1, 10, 10, fused=True) == 4 * 4 * 16 * 55


def test_train_step_is_three_forwards_and_remat_four():
    wl = Workload.fixed(4, 24, 40)
    s = wl.max_tokens
    per_token = SMALL.num_layers * layer_flops_per_token(SMALL, 1) + 2 * SMALL.hidden_size * SMALL.vocab_size
    attn = SMALL.num_layers * attention_flops(SMALL, 1, s, s, fused=True)
    for remat, passes in ((False, 3), (True, 4)):
        b = stage_latency(SMALL, "actor-train", StageChoice(1, 1, 1, 4, remat), wl, COMPUTE_ONLY, ONES)
        # the head runs on the 40 response positions and is not recomputed (128 ids fit one vocabulary chunk)
        head = 3 * 4 * 40 * 2 * SMALL.hidden_size * SMALL.vocab_size
        assert b.gemm * COMPUTE_ONLY.peak_flops == pytest.approx(passes * 4 * s * (per_token - 2 * 64 * 128) + head)
        assert b.attention * COMPUTE_ONLY.peak_flops == pytest.approx(passes * 4 * attn)


def test_train_moves_its_saved_activations_and_infer_does_not():
    # Compute-bound (free weight reads), finite memory bandwidth: a train call's memory time is exactly the
    # saved activations written and read back; an infer call has none. On shared compute it scales with the
    # step's tokens, not with the replicas.
    hw = dataclasses.replace(COMPUTE_ONLY, memory_bandwidth=1e12, peak_flops=1e12)
    wl = Workload.fixed(4, 24, 40)
    s = wl.max_tokens
    layer = s * layer_activation_bytes_per_token(SMALL, 1, SMALL.compute_dtype)
    saved = 4 * (SMALL.num_layers * layer + 40 * SMALL.vocab_size * 4.0)  # + the lm head's float32 logits
    train = call_latency(SMALL, "actor-train", 1, 1, 4, False, wl, hw, ONES, 1)
    assert train.memory * hw.memory_bandwidth == pytest.approx(2 * saved)
    assert call_latency(SMALL, "actor-infer", 1, 1, 4, False, wl, hw, ONES, 1).memory == 0.0
    cpu = dataclasses.replace(hw, shared_compute=True)
    per_step = [stage_latency(SMALL, "critic-train", StageChoice(1, 1, dp, 4 // dp), wl, cpu, ONES).memory
                - step_terms_latency(SMALL, "critic-train", 1, 1, dp, 1, wl, cpu, ONES).memory for dp in (1, 2, 4)]
    assert per_step == pytest.approx([per_step[0]] * 3)


def test_pipeline_bubble_gpipe():
    wl = Workload.fixed(16, 24, 40)
    s = wl.max_tokens
    # pp=2, micro-batch 8 -> 8 GPipe micro-batches of 1 row: 8 + 2 - 1 ticks of one layer each; 1 row does not
    # split over 2 stages, so every stage runs the head on all 8 rows (sharding.pipeline's hand-off)
    call = call_latency(SMALL, "actor-infer", 1, 2, 8, False, wl, COMPUTE_ONLY, ONES, 2)
    tick = s * layer_flops_per_token(SMALL, 1) * 1
    head = 8 * 40 * 2 * SMALL.hidden_size * SMALL.vocab_size  # the head runs on the 40 response positions
    assert call.gemm * COMPUTE_ONLY.peak_flops == pytest.approx(9 * tick + head)
    bubble = (9 - 8) / 9  # (pp - 1) / (m + pp - 1)
    useful = 8 * tick / (9 * tick)
    assert useful == pytest.approx(1 - bubble)
    # micro-batch 16 -> 8 micro-batches of 2 rows: each stage runs the head on 1 row of each, 16 / 2 in all
    call = call_latency(SMALL, "actor-infer", 1, 2, 16, False, wl, COMPUTE_ONLY, ONES, 2)
    assert call.gemm * COMPUTE_ONLY.peak_flops == pytest.approx(9 * 2 * tick + head)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_training_prices_the_schedule_that_runs(schedule):
    """pp = 2, a call of 16 rows -> m = 8 micro-batches of 2 rows, m + pp - 1 ticks either way on dedicated
    devices (bubble (pp - 1) / (m + pp - 1)); 1F1B recomputes each stage's forward in its backward (4 forward
    passes, not 3) and runs the head on the last stage over all 16 rows, GPipe over 16 / pp rows per stage. On
    shared compute 1F1B's skipped idle halves cost nothing: m ticks of work, and its head, which the last stage
    alone runs, has the host to itself (GPipe's head, split over the stages, shares it with both)."""
    wl = Workload.fixed(16, 24, 40, pipeline_schedule=schedule)
    s = wl.max_tokens
    call = call_latency(SMALL, "actor-train", 1, 2, 16, False, wl, COMPUTE_ONLY, ONES, 2)
    tick = s * layer_flops_per_token(SMALL, 1) * 2  # one layer a stage, two rows
    passes, head_rows = (4, 16) if schedule == "1f1b" else (3, 16 / 2)
    head = 3 * head_rows * 40 * 2 * SMALL.hidden_size * SMALL.vocab_size  # on the 40 response positions
    assert call.gemm * COMPUTE_ONLY.peak_flops == pytest.approx(passes * 9 * tick + head)
    shared = dataclasses.replace(COMPUTE_ONLY, shared_compute=True)
    call = call_latency(SMALL, "actor-train", 1, 2, 16, False, wl, shared, ONES, 2)
    ticks, head_share = (8, 1) if schedule == "1f1b" else (9, 2)
    assert call.gemm * shared.peak_flops == pytest.approx(2 * passes * ticks * tick + head_share * head)


def test_pipeline_training_memory_follows_the_schedule():
    """At m = 8 micro-batches of 2 rows (pp = 2): GPipe keeps all m + pp - 1 ticks' activations and each stage
    makes the logits of 16 / 2 rows; 1F1B keeps min(m, 2 pp - 1) = 3 stage inputs and one micro-batch's
    activations, and the last stage makes the logits of one micro-batch at a time."""
    hw = get_hardware("h100")
    choice = StageChoice(1, 2, 1, 16)
    gpipe, one = (working_bytes(LLAMA8B, "actor-train", choice, Workload.fixed(16, 512, 512, pipeline_schedule=s,
                                                                              vocab_chunk=0), hw)
                  for s in ("gpipe", "1f1b"))
    s, layers, rows = 1024, LLAMA8B.num_layers / 2, 2
    per_row = s * layer_activation_bytes_per_token(LLAMA8B, 1, LLAMA8B.compute_dtype)
    stage_input = s * LLAMA8B.hidden_size * 2  # bfloat16
    # float32 logits, their softmax and gradient, per row, on its 512 response positions (whole vocabulary)
    logits = 3 * 512 * LLAMA8B.vocab_size * 4.0
    gpipe_part = layers * 9 * rows * per_row + logits * 16 / 2
    one_part = 3 * rows * stage_input + layers * rows * per_row + logits * rows
    assert gpipe - one == pytest.approx(gpipe_part - one_part)
    assert one < gpipe
    # pp = 1 has no pipeline: the schedule changes nothing
    flat = [working_bytes(LLAMA8B, "actor-train", StageChoice(1, 1, 1, 8), Workload.fixed(8, 512, 512,
                          pipeline_schedule=s), hw) for s in ("gpipe", "1f1b")]
    assert flat[0] == flat[1]


def test_head_working_set_follows_the_vocabulary_chunk():
    """Over vocabulary chunks the head holds [positions, chunk width / tp] arrays (2 scoring, 3 training: see
    memory._HEAD_ARRAYS), not [positions, vocab]: for Llama 3.1's 128,256 ids at the default 8,192, 8,016-id
    chunks. The difference between chunked and whole-vocabulary working sets is exactly the head's."""
    hw, choice = get_hardware("h100"), StageChoice(2, 1, 1, 8)
    for stage, arrays in (("actor-infer", (1, 2)), ("actor-train", (3, 3))):
        whole, chunked = (working_bytes(LLAMA8B, stage, choice, Workload.fixed(8, 512, 1024, vocab_chunk=c), hw)
                          for c in (0, 8192))
        positions = 8 * 1024  # the response positions of the call's 8 rows
        assert chunk_width(LLAMA8B.vocab_size, 8192) == 8016
        expected = positions * 4.0 / 2 * (arrays[0] * LLAMA8B.vocab_size - arrays[1] * 8016)
        assert whole - chunked == pytest.approx(expected)


def test_workload_takes_the_configured_schedule_and_rejects_others():
    from nereus_jax.config import load_config

    assert Workload.from_config(load_config(None, [])).pipeline_schedule == "1f1b"
    assert Workload.from_config(load_config(None, ["trainer.pipeline_schedule=gpipe"])).pipeline_schedule == "gpipe"
    with pytest.raises(WorkloadError, match="pipeline_schedule='zb'; valid: 1f1b, gpipe"):
        Workload.fixed(8, 24, 40, pipeline_schedule="zb")


def test_decode_is_bandwidth_bound_on_weights_and_kv():
    hw = dataclasses.replace(HARDWARE["cpu"], peak_flops=1e30, launch_overhead_s=0.0, launch_overhead_per_device_s=0.0,
                             layer_overhead_s=0.0, intra_node_bandwidth=1e30, intra_node_latency_s=0.0)
    wl = Workload.fixed(4, 8, 16)
    b = stage_latency(SMALL, "actor-gen", StageChoice(1, 1, 1, 4), wl, hw, ONES)
    weights = param_count(SMALL) * 2  # bfloat16
    kv = 4 * wl.max_tokens * kv_bytes_per_token(SMALL, 1, 1, "bfloat16")  # dense engine: every slot, full cache
    steps = 16
    prefill = 4 * weights  # one prefill call per request reads the weights (memory-bound here too)
    assert b.memory * hw.memory_bandwidth == pytest.approx(steps * (weights + kv) + prefill)


def test_kv_bytes_of_llama_8b():
    # 2 (k, v) x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB per token in bfloat16
    assert kv_bytes_per_token(LLAMA8B, 1, 1, "bfloat16") == 131072
    assert kv_bytes_per_token(LLAMA8B, 8, 2, "bfloat16") == 131072 / 16
    assert kv_bytes_per_token(LLAMA8B, 16 // 2, 1, "bfloat16") == 131072 / 8


def test_memory_of_llama_8b():
    n = 8_030_261_248
    assert param_count(LLAMA8B) == n
    assert resident_bytes(LLAMA8B, "actor-train", 1, 1) == 12 * n  # float32 params + Adam m, v
    assert state_bytes(LLAMA8B, "actor-gen", 1, 1) == 2 * n  # bfloat16 weights
    assert resident_bytes(LLAMA8B, "actor-gen", 1, 1) == 4 * n  # the unit's and the engine's per-layer copy
    bf16 = dataclasses.replace(LLAMA8B, param_dtype="bfloat16")
    assert resident_bytes(bf16, "actor-train", 1, 1) == 14 * n  # bf16 params + m, v + float32 master
    hw = get_hardware("h100")
    wl = Workload.fixed(64, 512, 512)
    accumulating = working_bytes(LLAMA8B, "actor-train", StageChoice(1, 1, 1, 8), wl, hw)
    single = working_bytes(LLAMA8B, "actor-train", StageChoice(1, 1, 1, 64), wl, hw)
    assert accumulating - single < 4 * n * 1.01  # grads once more when accumulating, minus smaller activations
    assert single > 4 * n  # the gradients alone


def test_allreduce_and_transfer_formulas():
    hw = get_hardware("h100")
    nbytes = 1e9
    assert allreduce_seconds(nbytes, 8, "intra", hw) == pytest.approx(2 * 7 / 8 * nbytes / 450e9 + 14 * 5e-6)
    assert allreduce_seconds(nbytes, 1, "intra", hw) == 0.0
    inter = hw.inter_node_bandwidth / hw.devices_per_node
    assert allreduce_seconds(nbytes, 4, "inter", hw) == pytest.approx(2 * 3 / 4 * nbytes / inter + 6 * 10e-6)
    full = {c: 1.0 for c in EFFICIENCY_CLASSES}
    assert transfer_seconds(nbytes, "inter", hw, full) == pytest.approx(nbytes / inter + 10e-6)
    assert transfer_seconds(nbytes, "host", hw, full) == pytest.approx(nbytes / hw.host_bandwidth)
    both = transition_seconds({"intra": nbytes, "inter": nbytes}, hw, full)
    parts = transfer_seconds(nbytes, "intra", hw, full) + transfer_seconds(nbytes, "inter", hw, full)
    assert both == pytest.approx(parts)
    # unseen classes start conservative: 0.3 of peak
    assert transfer_seconds(nbytes, "inter", hw) == pytest.approx((nbytes / inter + 10e-6) / CONSERVATIVE_EFFICIENCY)
    with pytest.raises(ValueError, match="valid: local, intra, inter, host"):
        transfer_seconds(1.0, "pcie", hw)


def test_dp_gradient_sync_goes_hierarchical_across_nodes():
    hw = get_hardware("h100")
    wl = Workload.fixed(64, 64, 64)
    grads = params_per_device(SMALL, 1, 1) * 4
    one_node = step_terms_latency(SMALL, "actor-train", 1, 1, 8, 1, wl, hw, ONES)
    two_nodes = step_terms_latency(SMALL, "actor-train", 1, 1, 16, 1, wl, hw, ONES)
    assert one_node.collective_intra == pytest.approx(allreduce_seconds(grads, 8, "intra", hw))
    assert one_node.collective_inter == 0.0
    assert two_nodes.collective_inter == pytest.approx(allreduce_seconds(grads / 8, 2, "inter", hw))


def test_observe_recovers_efficiencies_and_leaves_unseen_classes():
    hw = get_hardware("h200")
    true = {"gemm": 0.62, "attention": 0.41, "memory": 0.78, "collective_intra": 0.55}
    truth = CostModel(hw, true)
    wl = Workload.fixed(64, 256, 512)
    runs = [("actor-gen", StageChoice(1, 1, 8, 8)), ("actor-gen", StageChoice(4, 1, 2, 32)),
            ("actor-train", StageChoice(8, 1, 1, 4)), ("actor-train", StageChoice(2, 4, 1, 8)),
            ("ref-infer", StageChoice(2, 1, 4, 16)), ("actor-infer", StageChoice(8, 1, 1, 64))]
    measurements = [Measurement(LLAMA8B, stage, choice, wl, truth.stage_latency(LLAMA8B, stage, choice, wl).total)
                    for stage, choice in runs]
    cm = CostModel(hw)
    assert cm.efficiency["gemm"] == CONSERVATIVE_EFFICIENCY
    fitted = cm.observe(measurements)
    for cls in ("gemm", "memory", "collective_intra"):
        assert fitted[cls] == pytest.approx(true[cls], rel=0.02), cls
    assert fitted["collective_inter"] == CONSERVATIVE_EFFICIENCY  # never exercised: unchanged
    assert "collective_inter" not in cm.observed
    for m in measurements:
        assert cm.stage_latency(m.model, m.stage, m.choice, m.workload).total == pytest.approx(m.seconds, rel=0.02)
    with pytest.raises(ValueError, match="must be > 0"):
        cm.observe([dataclasses.replace(measurements[0], seconds=0.0)])
    assert cm.observe([]) == fitted


def test_fast_pricing_equals_the_pure_functions():
    cfg = dataclasses.replace(SMALL, num_layers=4)
    wl = Workload.fixed(6, 20, 30, samples_per_prompt=2)
    sized = {"gemm_rows": 64.0, "gemm_width": 32.0, "attention_keys": 100.0}
    for hw, halves in ((get_hardware("a100"), None), (get_hardware("a100"), sized), (get_hardware("cpu"), None)):
        cm = CostModel(hw, half_sizes=halves)
        pricer = Pricer(cm, wl)
        for stage in ("actor-gen", "ref-infer", "critic-infer", "actor-train", "critic-train"):
            opts = pricer.options(cfg, stage, lambda tp: 8, math.inf)
            assert len(opts) > 10
            for i in range(len(opts)):
                choice = opts.choice(i)
                eff = cm.efficiency_for(cfg, stage, choice, wl)
                assert opts.latency[i] == pytest.approx(stage_latency(cfg, stage, choice, wl, hw, eff).total, rel=1e-9)
                mem = stage_memory(cfg, stage, choice, wl, hw)
                assert (opts.resident[i], opts.working[i]) == pytest.approx((mem.resident, mem.working), rel=1e-12)


def test_cpu_is_shared_compute():
    cpu = get_hardware("cpu")
    wl = Workload.fixed(64, 256, 256)
    one = stage_latency(SMALL, "actor-train", StageChoice(1, 1, 1, 64), wl, cpu)
    eight = stage_latency(SMALL, "actor-train", StageChoice(1, 1, 8, 8), wl, cpu)
    assert eight.gemm == pytest.approx(one.gemm, rel=0.01)  # same FLOPs on the same two cores
    assert eight.overhead > one.overhead  # every device adds launch overhead


def test_hardware_table():
    assert set(HARDWARE) == {"h100", "h200", "a100", "mi250x", "cpu"}
    for hw in HARDWARE.values():
        assert hw.memory_bytes > 0 and hw.peak_flops > 0 and hw.devices_per_node >= 1
    assert get_hardware(" H200 ").memory_bytes == 141 * 10**9
    with pytest.raises(HardwareError, match="valid: h100, h200, a100, mi250x, cpu") as err:
        get_hardware("h300")
    assert "did you mean 'h200'" in str(err.value)


def test_workload_from_a_job_config():
    from nereus_jax.config import load_config

    cfg = load_config(None, ["algorithm.name=remax", "trainer.prompts_per_step=16", "rollout.max_response_length=48"])
    wl = Workload.from_config(cfg)
    assert (wl.prompts_per_step, wl.response_length.max, wl.greedy_baseline) == (16, 48, True)
    assert wl.generated_sequences == 32 and wl.max_tokens == cfg.rollout.max_prompt_length + 48


def test_workload_stats_and_errors():
    wl = Workload.from_lengths([10, 20], [5, 7, 9, 100], samples_per_prompt=2)
    assert wl.sequences == 4 and wl.response_length == LengthStats(30.25, 100.0, 100)
    assert wl.max_tokens == 120
    assert Workload.fixed(4, 8, 8, greedy_baseline=True).generated_sequences == 8
    with pytest.raises(WorkloadError, match="expected 4"):
        Workload.from_lengths([10, 20], [5, 7, 9], samples_per_prompt=2)
    with pytest.raises(WorkloadError):
        LengthStats(10, 5, 20)
    with pytest.raises(StageError, match="valid: actor-gen"):
        stage_latency(SMALL, "actor-eval", StageChoice(1, 1, 1, 1), wl, get_hardware("cpu"))
    assert np.isfinite(stage_latency(SMALL, "critic-train", StageChoice(2, 2, 1, 4), wl, get_hardware("cpu")).total)


@pytest.mark.parametrize("targets", [None, ("q_proj", "v_proj"), ("down_proj", "k_proj")])
def test_lora_state_bytes_equal_the_state_spec_for_every_stage_and_layout(targets):
    """Reference: StateSpec.bytes_per_device, which counts the actual leaves (adapters, Adam state for the
    adapters and the value head alone, the reference without adapters)."""
    from nereus_jax.elastic.spec import StateSpec
    from nereus_jax.models.lora import base_config
    from nereus_jax.runtime.step.losses import make_optimizer

    m = dataclasses.replace(SMALL, lora_rank=4, **({"lora_targets": targets} if targets else {}))
    specs = {"actor-train": StateSpec(m, "train", optimizer=make_optimizer(1e-3)),
             "critic-train": StateSpec(m, "train", head="value", optimizer=make_optimizer(1e-3)),
             "actor-gen": StateSpec(m, "gen", dtype=m.compute_dtype),
             "ref-infer": StateSpec(base_config(m), "infer", dtype=m.compute_dtype)}
    for tp, pp in ((1, 1), (2, 1), (4, 1), (2, 2)):
        for stage, spec in specs.items():
            want = spec.bytes_per_device(Layout(tp, pp))
            got = state_bytes(m, stage, tp, pp)
            # the scalars replicated beside the sharded state (Adam's step counts) are the only difference
            assert 0 <= want - got <= 16, (stage, tp, pp, want, got)
    full = StateSpec(SMALL, "train", optimizer=make_optimizer(1e-3)).bytes_per_device(Layout())
    assert specs["actor-train"].bytes_per_device(Layout()) < 0.5 * full


def test_lora_prices_the_sync_and_the_update_on_the_adapters_alone():
    """With LoRA the weight sync moves the adapters (WeightSync re-derives them alone), and the optimizer update
    and gradient all-reduce cover them alone: the actor's once-per-step terms shrink by the adapters' share."""
    from nereus_jax.elastic.costs.latency import gen_latency

    hw, wl = get_hardware("h100"), Workload.fixed(64, 512, 512)
    big = resolve_model("qwen3-8b")
    lora = dataclasses.replace(big, lora_rank=16)
    full_terms = step_terms_latency(big, "actor-train", 1, 1, 8, 1.0, wl, hw, ONES).total
    assert 0 < step_terms_latency(lora, "actor-train", 1, 1, 8, 1.0, wl, hw, ONES).total < 0.05 * full_terms
    full_gen = gen_latency(big, "actor-gen", 1, 4, 8, wl, hw, ONES)
    lora_gen = gen_latency(lora, "actor-gen", 1, 4, 8, wl, hw, ONES)
    sync = param_count(big) * 2 / hw.intra_node_bandwidth  # 16 GB in bfloat16 over NVLink
    assert full_gen.total - lora_gen.total == pytest.approx(sync, rel=0.05)
