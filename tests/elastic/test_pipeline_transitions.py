"""PP in transitions: a training stage moves between (tp2, pp2) and (tp1, pp4) layouts bit for bit, and
the moved state runs the pipelined forward exactly like the pp=1 model."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from elastic_helpers import ACTOR_TRAIN, assert_plan_units

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.executor import TransitionExecutor
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.models import forward, init_params
from nereus_jax.sharding import Layout, pipeline_forward

CFG = dataclasses.replace(ModelConfig(), num_layers=4)  # pp=4 needs 4 layers


@pytest.fixture(scope="module")
def setup(devices):
    tx = optax.adam(1e-3)
    params = init_params(CFG, seed=5)
    opt = jax.tree.map(lambda x: x + 3 if x.ndim == 0 else x + 0.25, tx.init(params))
    state = jax.tree.map(np.asarray, {"params": params, "opt": opt})
    spec = StateSpec(CFG, "train", optimizer=tx)
    return spec, state


@pytest.mark.parametrize("old,new", [
    (StagePlan.contiguous(Layout(2, 2), 2), StagePlan.contiguous(Layout(1, 4), 2)),
    (StagePlan.contiguous(Layout(1, 4), 2), StagePlan.contiguous(Layout(2, 2), 2)),
    (StagePlan.contiguous(Layout(2, 2), 1), StagePlan.contiguous(Layout(1, 4), 1, first=4)),
])
def test_pipeline_layout_transition_of_a_training_stage_is_bit_exact(devices, setup, old, new):
    spec, state = setup
    specs, states = {ACTOR_TRAIN: spec}, {ACTOR_TRAIN: state}
    old_plan, new_plan = ExecutionPlan({ACTOR_TRAIN: old}), ExecutionPlan({ACTOR_TRAIN: new})
    units = {ACTOR_TRAIN: [EMU.create(ACTOR_TRAIN, spec, old.layout, [devices[i] for i in r], state)
                           for r in old.replicas]}
    graph = TransitionGraph.build(old_plan, new_plan, specs)
    assert graph.is_acyclic()
    out = TransitionExecutor(checksums=True, verify_ledger=True).run(graph, units)
    assert_plan_units(out, new_plan, specs, states)
    # The moved state is a working pipeline: its forward equals the pp=1 model's.
    unit = out[ACTOR_TRAIN][0]
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(4, 9))
    got = pipeline_forward(unit.params, CFG, tokens, mesh=unit.mesh, microbatches=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(forward(state["params"], CFG, tokens)), atol=1e-5)
