"""The paper's kinds of change, scaled down to 8 CPU devices, on real arrays: every result is bit-exact
against the source state (params and optimizer state), the ledger matches the live arrays and stays
under the caps, and a failure at any step leaves a complete copy of every model-stage."""

import pytest
from elastic_helpers import ACTOR_GEN, ACTOR_TRAIN, CRITIC, REF, assert_plan_units, assert_state

from nereus_jax.elastic.executor import TransitionExecutor, TransitionFailed
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import HOST, ExecutionPlan, StagePlan
from nereus_jax.elastic.primitives import MERGE, OFFLOAD, ONLOAD, SPLIT
from nereus_jax.elastic.recipe import align_ranks
from nereus_jax.elastic.schedule import Infeasible
from nereus_jax.sharding import Layout

C = StagePlan.contiguous


def _run(make_units, specs, old, new, **build):
    graph = TransitionGraph.build(old, new, {ms: specs[ms] for ms in old}, **build)
    assert graph.is_acyclic()
    executor = TransitionExecutor(checksums=True, verify_ledger=True)
    out = executor.run(graph, make_units(old))
    return graph, executor, out


CHANGES = {
    "extend 2->4 replicas": (C(Layout(2), 2), C(Layout(2), 4)),
    "destroy 4->2 replicas": (C(Layout(2), 4), C(Layout(2), 2)),
    "split tp4 -> 2 x tp2": (C(Layout(4), 1), C(Layout(2), 2)),
    "merge 2 x tp2 -> tp4": (C(Layout(2), 2), C(Layout(4), 1)),
    "tp/pp change of 2 replicas": (C(Layout(2, 2), 2), C(Layout(4, 1), 2)),
    "pp2 -> tp2 on other devices": (C(Layout(1, 2), 2), C(Layout(2, 1), 2, first=4)),
    "tp4 x2 -> tp1 x4 shifted (kv copies dropped)": (C(Layout(4), 2), C(Layout(1), 4, first=2)),
    "tp1 x2 -> tp4 on new devices (kv copies made)": (C(Layout(1), 2), C(Layout(4), 1, first=4)),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_paper_change_is_bit_exact(make_units, specs, states, name):
    old_sp, new_sp = CHANGES[name]
    old, new = ExecutionPlan({ACTOR_TRAIN: old_sp}), ExecutionPlan({ACTOR_TRAIN: new_sp})
    graph, executor, out = _run(make_units, specs, old, new)
    assert_plan_units(out, new, specs, states)
    assert executor.ledger.used == {k: n for k, n in graph.final_usage().items()} | {
        k: 0 for k in executor.ledger.used if k not in graph.final_usage()}


def test_split_and_merge_are_single_in_place_relayouts(specs):
    split = TransitionGraph.build(ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1)}),
                                  ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 2)}), specs)
    merge = TransitionGraph.build(ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 2)}),
                                  ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1)}), specs)
    assert [s.op for s in split.steps] == [SPLIT]
    assert [s.op for s in merge.steps] == [MERGE]


def test_two_model_stages_trade_overlapping_devices(make_units, specs, states):
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 2), REF: C(Layout(1), 4, first=2)})  # overlap on 2, 3
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1, first=2), REF: C(Layout(2), 2)})
    _, executor, out = _run(make_units, specs, old, new)
    assert_plan_units(out, new, specs, states)


def test_transition_that_must_offload_to_fit(make_units, specs, states):
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1), CRITIC: C(Layout(4), 1, first=4)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1, first=4), CRITIC: C(Layout(4), 1)})
    cap = specs[ACTOR_TRAIN].bytes_per_device(Layout(4)) + 1024  # one training replica per device
    with pytest.raises(Infeasible, match="device [0-7] is short .*offloading to host memory was not allowed"):
        TransitionGraph.build(old, new, specs, caps=cap, allow_offload=False)
    graph, executor, out = _run(make_units, specs, old, new, caps=cap)
    ops = [s.op for s in graph.steps]
    assert OFFLOAD in ops and ONLOAD in ops
    assert executor.ledger.max_peak() <= cap
    assert_plan_units(out, new, specs, states)


def test_infeasible_pair_names_device_and_bytes_before_anything_moves(make_units, specs, states):
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 2)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(1), 2)})
    units = make_units(old)
    need = specs[ACTOR_TRAIN].bytes_per_device(Layout(1))
    with pytest.raises(Infeasible, match=r"new plan needs .* on device 0, .* more than its cap") as info:
        TransitionGraph.build(old, new, specs, caps=need - 100)
    assert info.value.device == 0 and info.value.short_bytes == 100
    assert_state(units[ACTOR_TRAIN], specs[ACTOR_TRAIN], states[ACTOR_TRAIN])


def test_park_in_host_memory_and_come_back_in_another_layout(make_units, specs, states):
    on = ExecutionPlan({REF: C(Layout(2), 2)})
    parked = ExecutionPlan({REF: C(Layout(2), 1, memory=HOST)})
    back = ExecutionPlan({REF: C(Layout(4), 1, first=4)})
    graph = TransitionGraph.build(on, parked, specs)
    assert {s.op for s in graph.steps} == {OFFLOAD, "destroy"}
    mid = TransitionExecutor(checksums=True, verify_ledger=True).run(graph, make_units(on))
    assert_plan_units(mid, parked, specs, states)
    assert all(k < 0 for k, n in graph.final_usage().items() if n)  # nothing left in device memory
    out = TransitionExecutor(checksums=True, verify_ledger=True).run(TransitionGraph.build(parked, back, specs), mid)
    assert_plan_units(out, back, specs, states)


def test_many_stages_at_once_under_caps(make_units, specs, states):
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(2, 2), 2), ACTOR_GEN: C(Layout(1), 8), REF: C(Layout(4), 2)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 2), ACTOR_GEN: C(Layout(2), 2, first=4), REF: C(Layout(2), 1)})
    budget = {ms: specs[ms] for ms in old}
    peak = max(max(TransitionGraph.build(old, old, budget).final_usage().values()),
               max(TransitionGraph.build(new, new, budget).final_usage().values()))
    graph, executor, out = _run(make_units, specs, old, new, caps=int(peak * 1.3))
    assert executor.ledger.max_peak() <= int(peak * 1.3)
    assert_plan_units(out, new, specs, states)


@pytest.fixture(scope="module")
def failing_case(specs):
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(2, 2), 2), REF: C(Layout(1), 2, first=4)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1, first=4), REF: C(Layout(2), 2)})
    return old, new, TransitionGraph.build(old, new, specs)


def test_a_failure_at_any_step_leaves_a_complete_usable_state(make_units, specs, states, failing_case):
    old, new, graph = failing_case
    for step in graph.steps:
        with pytest.raises(TransitionFailed) as info:
            TransitionExecutor(fail_at=step.sid, verify_ledger=True).run(graph, make_units(old))
        left = info.value
        assert set(left.units) == set(old)
        for ms, units in left.units.items():
            assert [u.device_ids for u in units] == list(left.plan[ms].replicas)
            assert_state(units, specs[ms], states[ms])
        # What is left is a plan like any other: the transition can be finished from it.
        resume = TransitionGraph.build(left.plan, new, specs)
        assert_plan_units(TransitionExecutor().run(resume, left.units), new, specs, states)


def test_independent_primitives_are_in_flight_together(make_units, specs):
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 2), REF: C(Layout(2), 2)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 4), REF: C(Layout(2), 4)})
    graph = TransitionGraph.build(old, new, specs)
    executor = TransitionExecutor(extra_budget=None)
    executor.run(graph, make_units(old))
    dispatched = sorted(t[2] for t in executor.trace)
    finished = sorted(t[3] for t in executor.trace)
    assert dispatched[-1] < finished[0], "all four extends should be dispatched before the first finishes"


def test_align_ranks_keeps_device_sets_and_makes_merges_local(make_units, specs, states):
    old = ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 4), REF: C(Layout(2), 2)})
    new = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 2), REF: C(Layout(2), 4)})
    aligned = align_ranks(old, new)
    assert aligned[ACTOR_TRAIN].replicas == ((0, 2, 1, 3), (4, 6, 5, 7)) and aligned[REF] == new[REF]
    graph, _, out = _run(make_units, specs, old, aligned)
    merges = [s for s in graph.steps if s.op == MERGE]
    assert len(merges) == 2 and all(s.modes == ("strided", "strided") for s in merges)
    assert_plan_units(out, aligned, specs, states)
