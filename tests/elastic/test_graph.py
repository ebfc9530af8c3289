"""The transition graph as metadata: ordering rules, resource edges, infeasibility, printing, scale.
No arrays here (ByteSpec states), except where StateSpec gives real model sizes."""

import pytest
from elastic_helpers import ACTOR_GEN, ACTOR_TRAIN, REF, TINY

from nereus_jax.elastic.graph import TransitionError, TransitionGraph, plan_usage
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.elastic.primitives import DESTROY, EXTEND, MERGE, RELAYOUT, SPLIT
from nereus_jax.elastic.schedule import Infeasible
from nereus_jax.elastic.spec import transition_bytes
from nereus_jax.elastic.state_bytes import ByteSpec
from nereus_jax.model_stage import ModelStage
from nereus_jax.sharding import Layout

MiB = 2**20
C = StagePlan.contiguous
BYTES = {ACTOR_TRAIN: ByteSpec(64 * MiB), ACTOR_GEN: ByteSpec(16 * MiB), REF: ByteSpec(32 * MiB)}


def _ops(graph):
    return [(s.op, s.stage) for s in graph.steps]


def test_release_before_acquire_with_a_resource_edge_to_the_destroy():
    old = ExecutionPlan({REF: C(Layout(2), 2), ACTOR_GEN: C(Layout(2), 1, first=4)})
    new = ExecutionPlan({REF: C(Layout(2), 1), ACTOR_GEN: StagePlan(Layout(2), ((4, 5), (2, 3)))})
    cap = 16 * MiB  # device 2 holds ref's 16 MiB shard or gen's 8 MiB shard, not both
    graph = TransitionGraph.build(old, new, BYTES, caps=cap)
    destroy = next(s for s in graph.steps if s.op == DESTROY)
    extend = next(s for s in graph.steps if s.op == EXTEND)
    assert graph.steps.index(destroy) < graph.steps.index(extend)
    assert destroy.sid in extend.rdeps and destroy.sid not in extend.deps
    assert graph.is_acyclic()


def test_ties_go_generation_then_inference_then_training():
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 1), REF: C(Layout(2), 1), ACTOR_GEN: C(Layout(2), 1)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 2), REF: C(Layout(2), 2), ACTOR_GEN: C(Layout(2), 2)})
    graph = TransitionGraph.build(old, new, BYTES)
    assert [s.stage.kind for s in graph.steps] == ["gen", "infer", "train"]


def test_the_paper_example_splits_destroys_and_merges():
    # (TP4, PP8) -> (TP8, PP2) through (TP4, PP2): split into four, destroy two, merge two. 32 -> 16 devices.
    # Old pieces (pp ranks 2a, 2a+1) are devices 8a..8a+7; the new replica lists them tensor-rank major.
    ms = ModelStage("actor", "train")
    old = ExecutionPlan({ms: StagePlan(Layout(4, 8), (tuple(range(32)),))})
    order = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
    new = ExecutionPlan({ms: StagePlan(Layout(8, 2), (order,))})
    graph = TransitionGraph.build(old, new, {ms: ByteSpec(32 * 8 * MiB)})
    ops = sorted(s.op for s in graph.steps)
    assert ops == [DESTROY, DESTROY, MERGE, SPLIT]
    split = next(s for s in graph.steps if s.op == SPLIT)
    assert {graph.units[u].layout for u in split.outputs} == {Layout(4, 2)} and len(split.outputs) == 4


def test_same_device_list_layout_change_is_one_fused_relayout():
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(2, 2), 2)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(4, 1), 2)})
    assert _ops(TransitionGraph.build(old, new, BYTES)) == [(RELAYOUT, ACTOR_TRAIN)] * 2


def test_a_step_that_cannot_fit_by_itself_is_infeasible_naming_device_and_bytes():
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 2)})  # split: 16 MiB shard + 32 MiB pieces per device
    with pytest.raises(Infeasible, match=r"device 0 is short 8.00 MiB .* alone needs 48.00 MiB") as info:
        TransitionGraph.build(old, new, BYTES, caps=40 * MiB)
    assert (info.value.device, info.value.short_bytes) == (0, 8 * MiB)


def test_host_cap_bounds_offloading():
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1), REF: C(Layout(4), 1, first=4)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1, first=4), REF: C(Layout(4), 1)})
    cap = 17 * MiB  # a training shard is 16 MiB: the two stages can only pass through host memory
    assert TransitionGraph.build(old, new, BYTES, caps=cap).is_acyclic()
    with pytest.raises(Infeasible, match="short"):
        TransitionGraph.build(old, new, BYTES, caps=cap, host_cap=8 * MiB)


def test_plans_must_hold_the_same_model_stages_and_valid_layouts(specs):
    with pytest.raises(TransitionError, match="same model-stages"):
        TransitionGraph.build(ExecutionPlan({REF: C(Layout(1), 1)}), ExecutionPlan({ACTOR_GEN: C(Layout(1), 1)}),
                              BYTES)
    bad = ExecutionPlan({REF: StagePlan(Layout(8), (tuple(range(8)),))})
    with pytest.raises(TransitionError, match="ref-infer.*heads"):
        TransitionGraph.build(ExecutionPlan({REF: C(Layout(1), 1)}), bad, specs)


def test_graph_prints_one_line_per_step_with_bytes():
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 2)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1, first=4)})
    text = str(TransitionGraph.build(old, new, BYTES, caps=96 * MiB))
    lines = text.splitlines()
    assert lines[0].startswith("TransitionGraph: 5 steps") and "cap 96.00 MiB" in lines[0]
    assert len(lines) == 2 + 5
    assert "merge" in text and "tp4xpp1@[4,5,6,7]" in text and "+16.00 MiB x4 dev" in text


def _cluster_plans(n_gpus: int = 1024):
    stages = [ModelStage("actor", "gen"), ModelStage("actor", "train"), ModelStage("critic", "infer"),
              ModelStage("critic", "train"), ModelStage("ref", "infer"), ModelStage("reward", "infer")]
    half = n_gpus // 2
    old = ExecutionPlan({
        stages[0]: C(Layout(8), half // 8), stages[1]: C(Layout(8, 2), half // 16, first=half),
        stages[2]: C(Layout(4), half // 4), stages[3]: C(Layout(8, 2), half // 16, first=half),
        stages[4]: C(Layout(4), half // 4, first=half), stages[5]: C(Layout(4), half // 4, first=half)})
    new = ExecutionPlan({
        stages[0]: C(Layout(4), n_gpus // 4), stages[1]: C(Layout(8, 1), half // 8),
        stages[2]: C(Layout(8), half // 8, first=half), stages[3]: C(Layout(4, 4), half // 16, first=half),
        stages[4]: C(Layout(8), half // 8), stages[5]: C(Layout(2), half // 2, first=half)})
    specs = {ms: ByteSpec((48 if ms.kind == "train" else 16) * 2**30) for ms in stages}
    return old, new, specs


def test_a_simulated_1024_gpu_change_of_six_model_stages_builds_from_metadata():
    old, new, specs = _cluster_plans()
    cap = int(max(max(plan_usage(old, specs).values()), max(plan_usage(new, specs).values())) * 1.5)
    graph = TransitionGraph.build(old, new, specs, caps=cap)
    assert len(graph.units) > 500 and len(graph.steps) > 300
    assert graph.is_acyclic()
    assert max(n for k, n in graph.predicted_peak.items() if k >= 0) <= cap


def test_moved_bytes_come_from_the_shardings(devices, specs):
    unit = specs[REF].bytes_per_device(Layout(2)) * 2
    one = ExecutionPlan({REF: C(Layout(2), 2)})
    assert transition_bytes(one, one, specs, devices) == {"moved_bytes": 0, "cross_device_bytes": 0}
    extend = transition_bytes(one, ExecutionPlan({REF: C(Layout(2), 4)}), specs, devices)
    assert extend == {"moved_bytes": 2 * unit, "cross_device_bytes": 2 * unit}
    merge = transition_bytes(one, ExecutionPlan({REF: C(Layout(4), 1)}), specs, devices)
    new_unit = specs[REF].bytes_per_device(Layout(4)) * 4
    # New shards are new buffers, except where a device already holds the same shard (the replicated
    # norms, and kv heads 0 and 1 on devices 0 and 3); devices 1 and 2 receive their data from elsewhere.
    norms = 4 * (2 * TINY.num_layers + 1) * TINY.hidden_size * 4
    kv = 2 * 2 * TINY.num_layers * TINY.hidden_size * TINY.head_dim * 4
    assert merge["moved_bytes"] == new_unit - norms - kv
    assert 0 < merge["cross_device_bytes"] < merge["moved_bytes"]
