"""Mixture-of-experts state moves between expert-parallel layouts bit for bit: a Split along the expert axis
(ep 4 -> two ep 2 replicas), a Merge back, ep traded for tp on other devices, and random plan pairs over
layouts with ep in {1, 2, 4} (beside tp and pp), each compared with the host state it was laid out from
(parameters and Adam state; a bfloat16 generation copy)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from elastic_helpers import ACTOR_GEN, ACTOR_TRAIN, REF, assert_plan_units, plan_pairs
from hypothesis import HealthCheck, given, settings

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.executor import TransitionExecutor
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.elastic.primitives import MERGE, SPLIT
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.models import init_params
from nereus_jax.sharding import Layout

MOE = dataclasses.replace(ModelConfig(), family="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32)
LAYOUTS = (Layout(1), Layout(2), Layout(ep=2), Layout(ep=4), Layout(tp=2, ep=2), Layout(tp=2, ep=4), Layout(1, 2))
C = StagePlan.contiguous


@pytest.fixture(scope="module")
def moe_specs():
    tx = optax.adam(1e-3)
    return {ACTOR_TRAIN: StateSpec(MOE, "train", optimizer=tx), ACTOR_GEN: StateSpec(MOE, "gen", dtype="bfloat16"),
            REF: StateSpec(MOE, "infer")}


@pytest.fixture(scope="module")
def moe_states():
    params = init_params(MOE, 0)
    opt = jax.tree.map(lambda x: x + 7 if x.ndim == 0 else x + 0.5, optax.adam(1e-3).init(params))
    return {ACTOR_TRAIN: jax.tree.map(np.asarray, {"params": params, "opt": opt}),
            ACTOR_GEN: {"params": jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16)), params)},
            REF: {"params": jax.tree.map(np.asarray, init_params(MOE, 2))}}


def _run(devices, specs, states, old, new, checksums=True):
    units = {ms: [EMU.create(ms, specs[ms], sp.layout, [devices[i] for i in r], states[ms], sp.memory)
                  for r in sp.replicas] for ms, sp in old.items()}
    graph = TransitionGraph.build(old, new, {ms: specs[ms] for ms in old})
    out = TransitionExecutor(checksums=checksums, verify_ledger=True).run(graph, units)
    assert_plan_units(out, new, specs, states)
    return graph, out


def test_a_layout_with_ep_holds_one_ep_th_of_each_expert(moe_specs):
    spec = moe_specs[ACTOR_TRAIN]
    moe = [i for i, leaf in enumerate(spec.leaves) if leaf.axes and "experts" in leaf.axes]
    assert len(moe) == 9  # w_gate, w_up, w_down and their two Adam moments
    one, four = Layout(), Layout(ep=4)
    expert_bytes = sum(spec.leaves[i].dtype.itemsize * np.prod(spec.leaves[i].shape) for i in moe)
    assert spec.bytes_per_device(one) - spec.bytes_per_device(four) == expert_bytes * 3 // 4


@pytest.mark.parametrize("old,new,op", [
    (C(Layout(ep=4), 1), C(Layout(ep=2), 2), SPLIT),
    (C(Layout(ep=2), 2), C(Layout(ep=4), 1), MERGE),
    (C(Layout(tp=2, ep=2), 2), C(Layout(tp=4), 2), None),
    (C(Layout(ep=2), 2), C(Layout(tp=2), 2, first=4), None),
], ids=["split ep4 -> 2 x ep2", "merge 2 x ep2 -> ep4", "tp2xep2 -> tp4", "ep2 -> tp2 on other devices"])
def test_expert_parallel_change_is_bit_exact(devices, moe_specs, moe_states, old, new, op):
    graph, out = _run(devices, moe_specs, moe_states, ExecutionPlan({ACTOR_TRAIN: old}),
                      ExecutionPlan({ACTOR_TRAIN: new}))
    if op is not None:
        assert [s.op for s in graph.steps] == [op]
    w = out[ACTOR_TRAIN][0].leaves[[leaf.axes for leaf in moe_specs[ACTOR_TRAIN].leaves].index(
        ("layers", "experts", "embed", "mlp"))]
    assert w.sharding.shard_shape(w.shape)[1] == MOE.num_experts // new.layout.ep


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan_pairs(max_stages=2, layouts=LAYOUTS))
def test_random_plan_pairs_over_expert_parallel_layouts_keep_every_bit(devices, moe_specs, moe_states, pair):
    """Few examples, since each compiles its own relayouts; the bits are compared on the host."""
    _run(devices, moe_specs, moe_states, *pair, checksums=False)
