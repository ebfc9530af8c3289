"""An optimizer state split over a training stage's replicas (plan.shard_optimizer, ZeRO-1): each of dp replicas
holds the whole parameters and one block of every optimizer leaf. References: the canonical host state the
units were made from, bit for bit (special values included), and the byte counts of the whole state."""

import numpy as np
import pytest
from elastic_helpers import ACTOR_GEN, ACTOR_TRAIN, TINY, plan_pairs, raw, with_special_values
from hypothesis import HealthCheck, given, settings

from nereus_jax.elastic.costs.memory import state_bytes
from nereus_jax.elastic.emu import EMU, assemble_replicas, regroup_optimizer, stage_checksum, stage_to_host
from nereus_jax.elastic.executor import TransitionExecutor, TransitionFailed
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import DEVICE, ExecutionPlan, StagePlan
from nereus_jax.elastic.primitives import GATHER, SCATTER
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.sharding import Layout


@pytest.fixture(scope="module")
def split(tx):
    """actor-train's spec with the optimizer split over its replicas, and the whole-state specs of the rest."""
    return StateSpec(TINY, "train", optimizer=tx, shard_optimizer=True)


def _blocks(devices, spec, sp: StagePlan, state) -> list[EMU]:
    """``state`` laid out as ``sp``'s replicas, each holding its block of the optimizer (parked where ``sp``
    parks: a block moves to host memory as it is)."""
    units = [EMU.create(ACTOR_TRAIN, spec, sp.layout, [devices[i] for i in r], state) for r in sp.replicas]
    units = regroup_optimizer(units, spec.for_dp(sp.dp)) if sp.dp > 1 else units
    if sp.memory == DEVICE:
        return units
    return [EMU(u.stage, u.layout, u.devices, list(_to(u, sp.memory)), u.spec, sp.memory, u.shard) for u in units]


def _to(unit: EMU, memory: str):
    import jax

    return jax.device_put(unit.leaves, unit.spec.shardings(unit.mesh, memory))


def _assert_host(got: dict, spec: StateSpec, want: dict) -> None:
    for a, b in zip(spec.flatten(got), spec.flatten(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(raw(a), raw(b))


def test_each_replica_holds_one_block_of_the_optimizer_and_the_whole_parameters(devices, split, states):
    state = with_special_values(states[ACTOR_TRAIN], seed=3)
    sp = StagePlan(Layout(2), ((0, 1), (2, 3), (4, 5), (6, 7)))
    units = _blocks(devices, split, sp, state)
    spec = split.for_dp(4)
    assert [u.shard for u in units] == [0, 1, 2, 3] and units[0].spec is spec
    whole, n = split.bytes_per_device(sp.layout), split.n_params
    params = split.param_bytes_per_device(sp.layout)
    assert units[0].bytes_per_device() == {0: spec.bytes_per_device(sp.layout), 1: spec.bytes_per_device(sp.layout)}
    # every optimizer leaf but Adam's step count (a scalar) splits: the blocks sum to the whole
    unsplit = sum(leaf.dtype.itemsize for leaf in split.leaves[n:] if leaf.shape == ())
    assert 4 * (spec.bytes_per_device(sp.layout) - params - unsplit) == whole - params - unsplit
    _assert_host(stage_to_host(units), split, state)
    for u in units:  # the parameters are whole on every replica
        got = split.flatten({"params": u.to_host()["params"], "opt": state["opt"]})[:n]
        for a, b in zip(got, split.flatten(state)[:n], strict=True):
            np.testing.assert_array_equal(raw(a), raw(b))


def test_gathering_and_splitting_again_keeps_every_bit(devices, split, states):
    state = with_special_values(states[ACTOR_TRAIN], seed=4)
    sp = StagePlan(Layout(4), ((3, 1, 0, 2), (7, 5, 6, 4)))  # tp 4: each kv head stored twice
    units = _blocks(devices, split, sp, state)
    reference = stage_checksum(units)
    whole = regroup_optimizer(units, split)
    assert all(u.spec is split for u in whole)
    for u in whole:
        _assert_host(u.to_host(), split, state)
        assert np.array_equal(u.checksum(), reference)  # a whole replica hashes as the blocks together
    again = regroup_optimizer(whole, split.for_dp(2))
    _assert_host(stage_to_host(again), split, state)
    # the parameters were never copied: every unit reads the same buffers
    ptr = lambda u: [s.data.unsafe_buffer_pointer() for x in u.leaves[:split.n_params] for s in x.addressable_shards]  # noqa: E731
    assert ptr(units[0]) == ptr(whole[0]) == ptr(again[0])


def test_blocks_assemble_only_all_together_in_order(devices, split, states):
    units = _blocks(devices, split, StagePlan(Layout(1), ((0,), (1,), (2,), (3,))), states[ACTOR_TRAIN])
    with pytest.raises(ValueError, match="block order"):
        assemble_replicas(units[::-1])
    with pytest.raises(ValueError, match="needs all of them"):
        assemble_replicas(units[:2])


@pytest.mark.long  # ~30 s; tests/runtime/test_shard_optimizer.py moves a split optimizer between random plans in CI
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(pair=plan_pairs(stages=[ACTOR_TRAIN, ACTOR_GEN], max_stages=2))
def test_random_plan_pairs_move_a_split_optimizer_bit_for_bit(devices, split, specs, states, pair):
    """Any plan pair: the graph gathers blocks before a change of replicas or layout and splits them after; every
    unit is checked against the old state's checksum as it is made, the ledger equals the live arrays throughout,
    and the new replicas hold exactly the old state."""
    old, new = pair
    all_specs = {**specs, ACTOR_TRAIN: split}
    state = with_special_values(states[ACTOR_TRAIN], seed=5)
    units = {ms: ([u for u in _blocks(devices, split, sp, state)] if ms == ACTOR_TRAIN else
                  [EMU.create(ms, specs[ms], sp.layout, [devices[i] for i in r], states[ms], sp.memory)
                   for r in sp.replicas]) for ms, sp in old.items()}
    graph = TransitionGraph.build(old, new, all_specs)
    out = TransitionExecutor(checksums=True, verify_ledger=True).run(graph, units)
    for ms, sp in new.items():
        got = out[ms]
        assert [u.device_ids for u in got] == list(sp.replicas) and all(u.memory == sp.memory for u in got)
        if ms == ACTOR_TRAIN:
            assert all(u.spec is split.for_dp(sp.dp) for u in got) and [u.shard for u in got] == list(range(
                sp.dp)) if sp.dp > 1 else True
            _assert_host(stage_to_host(got), split, state)
        else:
            for u in got:
                _assert_host(u.to_host(), specs[ms], states[ms])
    if ACTOR_TRAIN in old and old[ACTOR_TRAIN] != new[ACTOR_TRAIN]:
        ops = [s.op for s in graph.steps if s.stage == ACTOR_TRAIN]
        same = old[ACTOR_TRAIN].layout == new[ACTOR_TRAIN].layout and \
            old[ACTOR_TRAIN].replicas == new[ACTOR_TRAIN].replicas  # only parked or onloaded: blocks move as they are
        assert (GATHER in ops) == (old[ACTOR_TRAIN].dp > 1 and not same)
        assert (SCATTER in ops) == (new[ACTOR_TRAIN].dp > 1 and not same)


def test_a_failure_at_any_step_of_a_dp_change_leaves_a_complete_state(devices, split, states):
    """dp 4 -> dp 2 on other devices: a failure before, inside or after the gather and the scatter leaves the
    state whole somewhere (every block, or a whole replica), in the form its plan keeps it."""
    state = with_special_values(states[ACTOR_TRAIN], seed=6)
    old = ExecutionPlan({ACTOR_TRAIN: StagePlan(Layout(1), ((0,), (1,), (2,), (3,)))})
    new = ExecutionPlan({ACTOR_TRAIN: StagePlan(Layout(2), ((4, 5), (6, 7)))})
    graph = TransitionGraph.build(old, new, {ACTOR_TRAIN: split})
    assert {GATHER, SCATTER} <= {s.op for s in graph.steps}
    for step in graph.steps:
        units = {ACTOR_TRAIN: _blocks(devices, split, old[ACTOR_TRAIN], state)}
        with pytest.raises(TransitionFailed) as failed:
            TransitionExecutor(checksums=True, fail_at=step.sid).run(graph, units)
        left, plan = failed.value.units[ACTOR_TRAIN], failed.value.plan[ACTOR_TRAIN]
        assert [u.device_ids for u in left] == list(plan.replicas)
        assert all(u.spec is split.for_dp(plan.dp) for u in left), (step.op, left)
        _assert_host(stage_to_host(left), split, state)


@pytest.mark.parametrize("layout,dp", [(Layout(1), 2), (Layout(2), 4), (Layout(1, 2), 4), (Layout(4), 2)])
def test_the_memory_model_counts_a_split_optimizer_as_the_spec_does(split, layout, dp):
    """The cost model's bytes per device of a training replica (Adam's moments over dp) equal the StateSpec's,
    but for the leaves no axis of which dp divides (Adam's step count: a few bytes)."""
    got = state_bytes(TINY, "actor-train", layout.tp, layout.pp, dp)
    want = split.for_dp(dp).bytes_per_device(layout)
    assert abs(got - want) <= 16, (got, want)
    assert abs(state_bytes(TINY, "actor-train", layout.tp, layout.pp) - split.bytes_per_device(layout)) <= 16
