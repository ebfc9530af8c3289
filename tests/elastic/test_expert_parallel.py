"""Expert parallelism in the cost model: the layout rules, the state ep splits (against the model's own parameter
tree), balanced ep computing like data parallelism over the call's rows, the busiest device under skew (against
an explicit assignment of experts to devices), the all-to-all count and links, dense models untouched, and a fit
of ep layouts' measured seconds that predicts held-out ep layouts."""

import dataclasses

import numpy as np
import pytest

from nereus_jax.config import ModelConfig, resolve_model
from nereus_jax.elastic.costs import CostModel, Measurement, StageChoice, counts, layout_problem, params_per_device
from nereus_jax.elastic.costs.latency import call_latency, efficiency_vector
from nereus_jax.elastic.hardware import get_hardware
from nereus_jax.elastic.planner import Planner
from nereus_jax.elastic.workload import Workload
from nereus_jax.models.decoder import abstract_params

MOE = ModelConfig(name="moe", family="qwen3_moe", vocab_size=384, hidden_size=96, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate_size=288, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=64, qk_norm=True, param_dtype="float32", compute_dtype="bfloat16")
H100 = get_hardware("h100")
ONES = tuple(1.0 for _ in efficiency_vector(H100))


def test_ep_must_divide_the_experts_of_a_mixture():
    assert layout_problem(MOE, 1, 1, 4) is None and layout_problem(MOE, 2, 2, 8) is None
    assert "does not divide model.num_experts=8" in layout_problem(MOE, 1, 1, 3)
    dense = resolve_model("qwen3-0.6b")
    assert "needs a mixture-of-experts model" in layout_problem(dense, 1, 1, 2)
    assert layout_problem(dense, 1, 1, 1) is None


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


@pytest.mark.parametrize("stage", ["actor-infer", "actor-train"])
def test_balanced_ep_computes_like_data_parallelism_over_the_calls_rows(stage):
    """With routing balanced, a device of an ep=4 group does the matmul and attention work of an ep=1 replica
    given a quarter of the rows (the rows split outside the experts, the routed pairs split evenly inside)."""
    wl = Workload.fixed(8, 2048, 2048)  # long rows: every pass compute-bound, the roofline on the same side
    ep4 = call_latency(MOE, stage, 1, 1, 8, False, wl, H100, ONES, 4, ep=4)
    quarter = call_latency(MOE, stage, 1, 1, 2, False, wl, H100, ONES, 1)
    assert ep4.gemm > 0 and ep4.gemm == pytest.approx(quarter.gemm, rel=1e-12)
    assert ep4.attention == pytest.approx(quarter.attention, rel=1e-12)


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


def _all_to_all(stage, remat=False, ep=4, hw=H100):
    b = call_latency(MOE, stage, 1, 1, 8, remat, Workload.fixed(8, 256, 256), hw, ONES, ep, ep=ep)
    return b.collective_intra, b.collective_inter


def test_two_all_to_alls_a_forward_two_a_backward_on_the_groups_links():
    """tp = pp = 1: a call's only collectives are its all-to-alls (dispatch + combine per forward, their
    transposes per backward, a recomputed forward's again)."""
    infer, train, remat = _all_to_all("actor-infer")[0], _all_to_all("actor-train")[0], \
        _all_to_all("actor-train", remat=True)[0]
    assert infer > 0 and train == pytest.approx(2 * infer) and remat == pytest.approx(3 * infer)
    assert _all_to_all("actor-infer", ep=1) == (0.0, 0.0)
    small_nodes = dataclasses.replace(H100, devices_per_node=2)  # an ep=4 group spans two nodes
    intra, inter = _all_to_all("actor-infer", hw=small_nodes)
    assert intra == 0.0 and inter > infer  # at its share of the node's NICs, slower than NVLink


def test_dense_models_and_generation_keep_ep_1():
    dense = dataclasses.replace(MOE, name="dense", family="qwen3", num_experts=0, moe_intermediate_size=None)
    planner = Planner("h100")
    wl = Workload.fixed(8, 64, 64, samples_per_prompt=2)
    for cfg in (dense, MOE):
        opts = planner.problem(cfg, "grpo", wl, 16).options()
        eps = {s: set(o.table[:, 5].tolist()) for s, o in opts.items()}
        assert eps["actor-gen"] == {1}
        assert eps["actor-train"] == ({1} if cfg is dense else {1, 2, 4, 8})
        for o in opts.values():  # micro-batches split over the ep group
            assert all(row[3] % row[5] == 0 for row in o.table)


def test_a_fit_on_some_ep_layouts_predicts_the_others():
    """Measured seconds from a model with other efficiencies (the all-to-alls in the collective classes, the
    expert matmuls in gemm) at a few ep layouts and skews; after observe() the held-out ep layouts are predicted
    as that model prices them."""
    truth = CostModel("h100", {"gemm": 0.55, "attention": 0.45, "memory": 0.8, "collective_intra": 0.6,
                               "collective_inter": 0.7, "overhead": 1.0})
    hw = dataclasses.replace(H100, devices_per_node=4)  # ep 8 crosses nodes: both collective classes measured

    def wl(load):
        return Workload.fixed(16, 256, 512, expert_load=load)

    seen = [(StageChoice(1, 1, 2, 8, ep=4), 0.0), (StageChoice(2, 1, 1, 16, ep=2), 0.2),
            (StageChoice(1, 2, 1, 16, ep=8), 0.1), (StageChoice(1, 1, 4, 4, ep=1), 0.0),
            (StageChoice(1, 1, 1, 16, ep=8), 0.4), (StageChoice(4, 1, 1, 16, ep=1), 0.3)]
    truth = CostModel(hw, truth.efficiency)
    fitted = CostModel(hw)
    ms = [Measurement(MOE, s, c, wl(load), truth.stage_latency(MOE, s, c, wl(load)).total)
          for c, load in seen for s in ("actor-train", "ref-infer")]
    fitted.observe(ms)
    for c, load in [(StageChoice(1, 1, 1, 16, ep=4), 0.3), (StageChoice(2, 2, 1, 8, ep=2), 0.0),
                    (StageChoice(1, 1, 2, 8, ep=8), 0.5)]:
        for s in ("actor-train", "ref-infer"):
            want = truth.stage_latency(MOE, s, c, wl(load)).total
            assert fitted.stage_latency(MOE, s, c, wl(load)).total == pytest.approx(want, rel=0.02), (s, c)
