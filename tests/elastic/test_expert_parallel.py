"""Expert parallelism in the cost model, priced as ``sharding.experts`` runs it: the layout rules (against the
runtime's own check), the state ep splits (against the model's own parameter tree), the dense work done whole
on every device and the experts' split (against FLOPs read from the parameter tree), the busiest device under
skew (against an explicit assignment of experts to devices), the combine all-reduces (against the collectives
XLA compiles for the expert-parallel layer) and their links, dense models untouched, and a fit of ep layouts'
measured seconds that predicts held-out ep layouts."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.config import ModelConfig, resolve_model
from nereus_jax.elastic.costs import CostModel, Measurement, StageChoice, counts, layout_problem, params_per_device
from nereus_jax.elastic.costs.latency import allreduce_seconds, call_latency, efficiency_vector
from nereus_jax.elastic.hardware import get_hardware
from nereus_jax.elastic.planner import Planner
from nereus_jax.elastic.topology import Topology
from nereus_jax.elastic.workload import Workload
from nereus_jax.models.decoder import abstract_params
from nereus_jax.sharding import Layout, LayoutError, check_layout, make_mesh, pipeline_forward_fn, shard_params

MOE = ModelConfig(name="moe", family="qwen3_moe", vocab_size=384, hidden_size=96, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate_size=288, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=64, qk_norm=True, param_dtype="float32", compute_dtype="bfloat16")
H100 = get_hardware("h100")
ONES = tuple(1.0 for _ in efficiency_vector(H100))


def test_ep_must_divide_the_experts_of_a_mixture():
    assert layout_problem(MOE, 1, 1, 4) is None and layout_problem(MOE, 2, 1, 8) is None
    assert "does not divide model.num_experts=8" in layout_problem(MOE, 1, 1, 3)
    dense = resolve_model("qwen3-0.6b")
    assert "needs a mixture-of-experts model" in layout_problem(dense, 1, 1, 2)
    assert layout_problem(dense, 1, 1, 1) is None


def _runs(cfg, tp, pp, ep) -> bool:
    try:
        check_layout(cfg, Layout(tp, pp, ep))
    except LayoutError:
        return False
    return True


def test_the_planners_layouts_are_the_ones_the_runtime_accepts():
    """Reference: ``sharding.layout.check_layout`` (what the job refuses to build), ep x pp included."""
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            for ep in (1, 2, 3, 4, 8):
                assert (layout_problem(MOE, tp, pp, ep) is None) == _runs(MOE, tp, pp, ep), (tp, pp, ep)
    assert "pp=1 or ep=1" in layout_problem(MOE, 1, 2, 2)


@pytest.mark.parametrize("tp", [1, 2])
def test_ep_splits_the_expert_weights_and_nothing_else(tp):
    """Reference: the expert leaves of the model's own parameter tree (w_gate, w_up, w_down of every layer)."""
    tree = abstract_params(MOE)
    experts = sum(int(np.prod(v.shape)) for k, v in tree["layers"]["moe"].items() if k.startswith("w_"))
    whole = params_per_device(MOE, tp, 1)
    for ep in (2, 4, 8):
        want = whole - experts / tp + experts / (tp * ep)
        assert params_per_device(MOE, tp, 1, ep=ep) == pytest.approx(want, rel=1e-12)
        assert counts.expert_params_per_device(MOE, tp, 1, ep) * tp * ep == experts


def _expert_flops_per_token() -> float:
    """Forward FLOPs of one layer's routed experts per token, from the parameter tree: top-k experts' weights."""
    moe = abstract_params(MOE)["layers"]["moe"]
    per_expert = sum(int(np.prod(v.shape[2:])) for k, v in moe.items() if k.startswith("w_"))  # [layers, E, ...]
    return 2.0 * MOE.num_experts_per_tok * per_expert


@pytest.mark.parametrize("stage,passes", [("actor-infer", 1), ("actor-train", 3)])
def test_ep_runs_the_dense_work_whole_and_splits_the_experts(stage, passes):
    """Balanced routing: a device of an ep group does ep=1's attention (all of the call's rows) and ep=1's matmuls
    less the (1 - 1/ep) of the experts' FLOPs it no longer runs."""
    wl = Workload.fixed(8, 2048, 2048)  # long rows: every pass compute-bound, the roofline on the same side
    one = call_latency(MOE, stage, 1, 1, 8, False, wl, H100, ONES, 1)
    tokens = 8 * wl.max_tokens
    for ep in (2, 4, 8):
        split = call_latency(MOE, stage, 1, 1, 8, False, wl, H100, ONES, ep, ep=ep)
        assert split.attention == pytest.approx(one.attention, rel=1e-12)
        saved = passes * tokens * MOE.num_layers * (1 - 1 / ep) * _expert_flops_per_token() / H100.peak_flops
        assert one.gemm - split.gemm == pytest.approx(saved, rel=1e-9)


@pytest.mark.parametrize("experts,top_k", [(8, 2), (128, 8)])
def test_busiest_shard_matches_an_explicit_assignment_of_experts_to_devices(experts, top_k):
    cfg = dataclasses.replace(MOE, num_experts=experts, num_experts_per_tok=top_k)
    for hot in (1.0 / experts, (1.0 / experts + 1.0 / top_k) / 2, 1.0 / top_k):  # balanced .. every token
        loads = np.array([hot] + [(1 - hot) / (experts - 1)] * (experts - 1))
        shares = []
        for ep in (d for d in range(1, experts + 1) if experts % d == 0):
            busiest = loads.reshape(ep, experts // ep).sum(axis=1).max()  # ep devices, consecutive experts each
            assert counts.busiest_shard_share(cfg, ep, hot) == pytest.approx(busiest, rel=1e-12)
            shares.append(busiest)
        assert shares == sorted(shares, reverse=True)  # more devices never make the busiest one busier
    assert counts.busiest_shard_share(cfg, 4, 0.0) == pytest.approx(0.25)  # 0: balanced


def test_skew_slows_only_expert_parallel_calls():
    skewed, balanced = Workload.fixed(8, 256, 256, expert_load=0.25), Workload.fixed(8, 256, 256)
    for ep in (1, 2, 4):
        a = call_latency(MOE, "actor-train", 1, 1, 8, False, skewed, H100, ONES, ep, ep=ep)
        b = call_latency(MOE, "actor-train", 1, 1, 8, False, balanced, H100, ONES, ep, ep=ep)
        assert (a.gemm > b.gemm) == (ep > 1) and a.attention == b.attention


_TINY = dataclasses.replace(MOE, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                            vocab_size=96, moe_intermediate_size=16)


def _compiled_all_reduces(program, params) -> int:
    """All-reduce instructions in a compiled program (a layer scan's body counts once: per layer)."""
    return len(re.findall(r" all-reduce(?:-start)?\(", jax.jit(program).lower(params).compile().as_text()))


@pytest.fixture(scope="module")
def tiny_ep2(devices):
    """The tiny MoE sharded at ep 2, its expert-parallel forward and a batch (what tools/ep_collectives.py runs)."""
    mesh = make_mesh(devices[:2], Layout(ep=2))
    rng = np.random.default_rng(0)  # the collectives do not depend on the values (init_params takes ~14 s here)
    tree = jax.tree.map(lambda a: (0.02 * rng.standard_normal(a.shape)).astype(a.dtype), abstract_params(_TINY))
    params = shard_params(tree, _TINY, Layout(ep=2), mesh)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, _TINY.vocab_size, (2, 9)), jnp.int32)
    return params, pipeline_forward_fn(mesh, 1), tokens


def _charged_combines(stage: str) -> float:
    """The cost model's ep-group all-reduces per layer of one call at ep 2, tp = pp = 1 (no other collective),
    in units of one all-reduce of the layer's whole [rows, hidden] output."""
    wl = Workload.fixed(8, 256, 256)
    one = allreduce_seconds(8 * wl.max_tokens * _TINY.hidden_size * 2, 2, "intra", H100)  # bfloat16 [rows, d]
    b = call_latency(_TINY, stage, 1, 1, 8, False, wl, H100, ONES, 2, ep=2)
    assert b.collective_inter == 0.0
    return b.collective_intra / (_TINY.num_layers * one)


def test_the_forwards_combine_is_the_one_all_reduce_xla_compiles(tiny_ep2):
    """Reference: the compiled expert-parallel layer's forward (tools/ep_collectives.py's count)."""
    params, fn, tokens = tiny_ep2
    assert _charged_combines("actor-infer") == pytest.approx(_compiled_all_reduces(lambda p: fn(p, _TINY, tokens),
                                                                                   params), rel=1e-12)


@pytest.mark.long  # ~15 s to compile on 2 loaded cores; CI: the forward's count above and the 2 x forward charge below
def test_the_gradients_combines_are_the_all_reduces_xla_compiles(tiny_ep2):
    """Reference: the compiled gradient program (the forward's all-reduce and the backward's, of the input's and
    routing weights' cotangents combined into one)."""
    params, fn, tokens = tiny_ep2
    compiled = _compiled_all_reduces(jax.grad(lambda p: jnp.mean(fn(p, _TINY, tokens) ** 2)), params)
    assert _charged_combines("actor-train") == pytest.approx(compiled, rel=1e-12)


def _combine(stage, remat=False, ep=4, hw=H100):
    b = call_latency(MOE, stage, 1, 1, 8, remat, Workload.fixed(8, 256, 256), hw, ONES, ep, ep=ep)
    return b.collective_intra, b.collective_inter


def test_a_recomputed_forward_combines_again_and_a_group_across_nodes_pays_the_nics():
    infer, train, remat = _combine("actor-infer")[0], _combine("actor-train")[0], _combine("actor-train", True)[0]
    assert infer > 0 and train == pytest.approx(2 * infer) and remat == pytest.approx(3 * infer)
    assert _combine("actor-infer", ep=1) == (0.0, 0.0)
    small_nodes = dataclasses.replace(H100, devices_per_node=2)  # an ep=4 group spans two nodes
    intra, inter = _combine("actor-infer", hw=small_nodes)
    assert intra == 0.0 and inter > infer  # at its share of the node's NICs, slower than NVLink


@pytest.mark.parametrize("job", [False, True])
def test_dense_models_and_generation_keep_ep_1(job):
    """The planner's general topology and the job's (``Topology.of_job``, what a job plans with): a mixture's
    scoring and training stages search ep, never beside pp > 1; a dense model and generation keep ep 1."""
    dense = dataclasses.replace(MOE, name="dense", family="qwen3", num_experts=0, moe_intermediate_size=None)
    planner = Planner("h100")
    wl = Workload.fixed(8, 64, 64, samples_per_prompt=2)
    topology = Topology.of_job("grpo") if job else None
    for cfg in (dense, MOE):
        opts = planner.problem(cfg, "grpo", wl, 16, topology=topology).options()
        eps = {s: set(o.table[:, 5].tolist()) for s, o in opts.items()}
        assert eps["actor-gen"] == {1}
        assert eps["actor-train"] == ({1} if cfg is dense else {1, 2, 4, 8})
        for o in opts.values():  # the runtime runs experts split only outside a pipeline
            assert all(row[5] == 1 or row[1] == 1 for row in o.table)


@pytest.mark.xfail(strict=True, reason="with the runtime's mechanism ep no longer changes a call's rows, so at these "
                   "short rows the compute classes scale alike over the seen layouts and the regularised fit "
                   "misattributes them: one held-out train layout is 4.2% off (open: choose measurements that "
                   "separate the classes, not a looser tolerance)")
def test_a_fit_on_some_ep_layouts_predicts_the_others():
    """Measured seconds from a model with other efficiencies (the combine all-reduces in the collective classes, the
    expert matmuls in gemm) at a few ep layouts and skews; after observe() the held-out ep layouts are predicted
    as that model prices them."""
    truth = CostModel("h100", {"gemm": 0.55, "attention": 0.45, "memory": 0.8, "collective_intra": 0.6,
                               "collective_inter": 0.7, "overhead": 1.0})
    hw = dataclasses.replace(H100, devices_per_node=4)  # ep 8 crosses nodes: both collective classes measured

    def wl(load):
        return Workload.fixed(16, 256, 512, expert_load=load)

    seen = [(StageChoice(1, 1, 2, 8, ep=4), 0.0), (StageChoice(2, 1, 1, 16, ep=2), 0.2),
            (StageChoice(1, 1, 2, 8, ep=8), 0.1), (StageChoice(1, 1, 4, 4, ep=1), 0.0),
            (StageChoice(1, 1, 1, 16, ep=8), 0.4), (StageChoice(4, 1, 1, 16, ep=1), 0.3)]
    truth = CostModel(hw, truth.efficiency)
    fitted = CostModel(hw)
    ms = [Measurement(MOE, s, c, wl(load), truth.stage_latency(MOE, s, c, wl(load)).total)
          for c, load in seen for s in ("actor-train", "ref-infer")]
    fitted.observe(ms)
    for c, load in [(StageChoice(1, 1, 1, 16, ep=4), 0.3), (StageChoice(2, 1, 2, 8, ep=2), 0.0),
                    (StageChoice(1, 1, 1, 8, ep=8), 0.5)]:
        for s in ("actor-train", "ref-infer"):
            want = truth.stage_latency(MOE, s, c, wl(load)).total
            assert fitted.stage_latency(MOE, s, c, wl(load)).total == pytest.approx(want, rel=0.02), (s, c)
