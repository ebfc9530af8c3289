"""The per-step weight sync actor-train -> actor-gen runs on the transition machinery: fresh generation
units hold the training parameters cast to the generation dtype, bit for bit; training state is untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from elastic_helpers import ACTOR_GEN, ACTOR_TRAIN, TINY, assert_plan_units, assert_state

from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.executor import TransitionExecutor
from nereus_jax.elastic.graph import plan_usage
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.elastic.primitives import DERIVE, DESTROY, EXTEND
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.elastic.weight_sync import WeightSync
from nereus_jax.sharding import Layout

C = StagePlan.contiguous
SYNC_PLANS = {
    "colocated, other layout": {ACTOR_TRAIN: C(Layout(2, 2), 2), ACTOR_GEN: C(Layout(4), 2)},
    "colocated, same layout": {ACTOR_TRAIN: C(Layout(2), 4), ACTOR_GEN: C(Layout(2), 4)},
    "separate devices, more replicas": {ACTOR_TRAIN: C(Layout(4), 1), ACTOR_GEN: C(Layout(1), 4, first=4)},
}


@pytest.mark.parametrize("name", list(SYNC_PLANS))
def test_weight_sync_casts_train_params_into_gen_units(make_units, specs, states, name):
    plan = ExecutionPlan(SYNC_PLANS[name])
    units = make_units(plan)
    train = units[ACTOR_TRAIN]
    cap = int(max(plan_usage(plan, specs).values()) * 2)
    sync = WeightSync(plan, specs[ACTOR_TRAIN], specs[ACTOR_GEN], caps=cap,
                      executor=TransitionExecutor(checksums=True, verify_ledger=True))
    assert sync.graph.is_acyclic() and sync.graph.steps[0].op == DESTROY  # stale weights go first
    stale = [u.leaves[0].dtype for u in units[ACTOR_GEN]]
    gen = sync(train, units[ACTOR_GEN])
    assert stale == [jnp.bfloat16] * len(stale)
    assert_plan_units({ACTOR_GEN: gen}, ExecutionPlan({ACTOR_GEN: plan[ACTOR_GEN]}), specs, states)
    assert_state(train, specs[ACTOR_TRAIN], states[ACTOR_TRAIN])
    assert sync.executor.ledger.max_peak() <= cap
    again = sync(train, gen)  # the graph depends on the plan only: built once, reused every step
    assert_state(again, specs[ACTOR_GEN], states[ACTOR_GEN])


def test_same_layout_on_the_same_devices_is_one_derive_per_replica(specs):
    plan = ExecutionPlan(SYNC_PLANS["colocated, same layout"])
    sync = WeightSync(plan, specs[ACTOR_TRAIN], specs[ACTOR_GEN])
    assert sorted(s.op for s in sync.graph.steps) == [DERIVE] * 4 + [DESTROY] * 4
    other = WeightSync(ExecutionPlan(SYNC_PLANS["separate devices, more replicas"]), specs[ACTOR_TRAIN],
                       specs[ACTOR_GEN])
    assert EXTEND in {s.op for s in other.graph.steps}


def test_sync_reflects_an_updated_training_state(devices, specs, states):
    plan = ExecutionPlan(SYNC_PLANS["colocated, other layout"])
    updated = jax.tree.map(lambda x: x + np.asarray(1.0, x.dtype) if x.dtype == np.float32 else x,
                           states[ACTOR_TRAIN])
    train = [EMU.create(ACTOR_TRAIN, specs[ACTOR_TRAIN], plan[ACTOR_TRAIN].layout, [devices[i] for i in r], updated)
             for r in plan[ACTOR_TRAIN].replicas]
    gen = [EMU.create(ACTOR_GEN, specs[ACTOR_GEN], plan[ACTOR_GEN].layout, [devices[i] for i in r],
                      states[ACTOR_GEN]) for r in plan[ACTOR_GEN].replicas]
    out = WeightSync(plan, specs[ACTOR_TRAIN], specs[ACTOR_GEN])(train, gen)
    want = {"params": jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16)), updated["params"])}
    assert_state(out, specs[ACTOR_GEN], want)


def test_weight_sync_rejects_a_target_that_is_not_the_sources_params(specs):
    plan = ExecutionPlan(SYNC_PLANS["colocated, same layout"])
    value_head = StateSpec(TINY, "gen", head="value")
    with pytest.raises(ValueError, match="params-only target with the source's parameter shapes"):
        WeightSync(plan, specs[ACTOR_TRAIN], value_head)
