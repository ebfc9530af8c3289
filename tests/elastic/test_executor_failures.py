"""Whatever fails inside TransitionExecutor.run comes back as TransitionFailed carrying a complete, checked
copy of every model-stage: a failure before the first step (the reference checksums of a parked unit), a
primitive that fails at dispatch or while it completes, a unit whose checksum does not match, the final
verification. The units left behind hold the old state bit for bit and the move can be finished from them."""

import pytest
from elastic_helpers import ACTOR_TRAIN, REF, assert_plan_units, assert_state, flip_bit

from nereus_jax.elastic import executor as executor_module
from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.executor import ChecksumMismatch, InjectedFailure, TransitionExecutor, TransitionFailed
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import HOST, ExecutionPlan, StagePlan
from nereus_jax.sharding import Layout

C = StagePlan.contiguous
OLD = ExecutionPlan({ACTOR_TRAIN: C(Layout(2, 2), 2), REF: C(Layout(1), 2, first=4, memory=HOST)})
NEW = ExecutionPlan({ACTOR_TRAIN: C(Layout(4), 1, first=4), REF: C(Layout(2), 2)})


@pytest.fixture(scope="module")
def graph(specs):
    return TransitionGraph.build(OLD, NEW, specs)


def _assert_left_intact(failed: TransitionFailed, specs, states):
    assert set(failed.units) == set(OLD)
    for ms, units in failed.units.items():
        assert [u.device_ids for u in units] == list(failed.plan[ms].replicas)
        assert all(u.layout == failed.plan[ms].layout and u.memory == failed.plan[ms].memory for u in units)
        assert_state(units, specs[ms], states[ms])


def test_a_failure_taking_reference_checksums_of_a_parked_unit_is_a_transition_failure(
        make_units, specs, states, graph, monkeypatch):
    real = EMU.checksum

    def checksum(self):
        if self.memory == HOST:
            raise RuntimeError("no device memory to read the parked unit")
        return real(self)

    monkeypatch.setattr(EMU, "checksum", checksum)
    units = make_units(OLD)
    with pytest.raises(TransitionFailed, match="before its first step: RuntimeError: no device memory") as info:
        TransitionExecutor(checksums=True).run(graph, units)
    assert info.value.step is None and info.value.plan == OLD
    assert all(a is b for ms in OLD for a, b in zip(info.value.units[ms], units[ms], strict=True))
    _assert_left_intact(info.value, specs, states)


def _fail_in_completion(sid):
    def tamper(step, outputs):
        if step.sid == sid:
            raise RuntimeError(f"lost a device while s{sid} ran")
    return {"tamper": tamper}


def _corrupt(sid):
    def tamper(step, outputs):
        if step.sid == sid:
            uid = max(outputs)
            outputs[uid] = flip_bit(outputs[uid], leaf=-1, shard=-1, element=7, bit=3)
    return {"tamper": tamper}


PHASES = {  # how to fail at step sid -> (executor options, the error behind TransitionFailed)
    "dispatch": (lambda sid: {"fail_at": sid}, InjectedFailure),
    "completion": (_fail_in_completion, RuntimeError),
    "checksum": (_corrupt, ChecksumMismatch),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_failure_in_any_phase_of_any_step_leaves_a_complete_checked_state(make_units, specs, states, graph,
                                                                            phase):
    options, cause = PHASES[phase]
    for step in graph.steps:
        if phase != "dispatch" and not step.outputs:
            continue  # a Destroy makes nothing to corrupt or to wait for
        with pytest.raises(TransitionFailed) as info:
            TransitionExecutor(checksums=True, verify_ledger=True, **options(step.sid)).run(graph, make_units(OLD))
        assert type(info.value.__cause__) is cause and info.value.step.sid == step.sid
        _assert_left_intact(info.value, specs, states)
    resume = TransitionGraph.build(info.value.plan, NEW, specs)
    assert_plan_units(TransitionExecutor(checksums=True).run(resume, info.value.units), NEW, specs, states)


def test_a_failure_in_the_final_verification_is_a_transition_failure(make_units, specs, states, graph,
                                                                     monkeypatch):
    def verify(self):
        raise ChecksumMismatch("a kept unit does not match")

    monkeypatch.setattr(executor_module._Run, "_verify_checksums", verify)
    with pytest.raises(TransitionFailed, match="ChecksumMismatch: a kept unit does not match") as info:
        TransitionExecutor(checksums=True).run(graph, make_units(OLD))
    assert info.value.plan == NEW  # every new unit was checked as it was made
    assert_plan_units(info.value.units, NEW, specs, states)


def test_units_that_do_not_match_the_graph_raise_value_error_before_anything(make_units, specs, states, graph):
    units = make_units(OLD)
    with pytest.raises(ValueError, match="the graph starts from 2 replicas, got 1 EMUs"):
        TransitionExecutor(checksums=True).run(graph, {ACTOR_TRAIN: units[ACTOR_TRAIN][:1], REF: units[REF]})
    for ms in OLD:
        assert_state(units[ms], specs[ms], states[ms])
