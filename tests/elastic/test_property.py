"""Property: for random plan pairs on 8 CPU devices and random tight caps, every graph is acyclic, the
ledger never passes a cap while it runs (and matches the live arrays whenever nothing is in flight), and
the final state is the target layout bit for bit; or the pair is reported infeasible before anything moves."""

from elastic_helpers import ACTOR_GEN, ACTOR_TRAIN, REF, assert_plan_units, assert_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus_jax.elastic import (
    DEVICE,
    HOST,
    ExecutionPlan,
    Infeasible,
    StagePlan,
    TransitionExecutor,
    TransitionGraph,
    plan_usage,
)
from nereus_jax.sharding import Layout

LAYOUTS = [Layout(1, 1), Layout(2, 1), Layout(4, 1), Layout(1, 2), Layout(2, 2), Layout(4, 2)]
STAGES = [ACTOR_TRAIN, REF, ACTOR_GEN]


@st.composite
def stage_plans(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    dp = draw(st.integers(1, 8 // layout.size))
    order = draw(st.permutations(range(8)))
    replicas = tuple(tuple(order[i * layout.size:(i + 1) * layout.size]) for i in range(dp))
    memory = draw(st.sampled_from([DEVICE, DEVICE, DEVICE, HOST]))
    return StagePlan(layout, replicas, memory)


@st.composite
def plan_pairs(draw):
    stages = draw(st.lists(st.sampled_from(STAGES), min_size=1, max_size=3, unique=True))
    old = ExecutionPlan({ms: draw(stage_plans()) for ms in stages})
    new = ExecutionPlan({ms: draw(stage_plans()) for ms in stages})
    slack = draw(st.sampled_from([None, 1.0, 1.1, 1.25, 1.5, 2.0]))
    return old, new, slack


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan_pairs())
def test_random_plan_pairs_under_random_tight_caps(make_units, specs, states, pair):
    old, new, slack = pair
    budget = {ms: specs[ms] for ms in old}
    floor = max([n for k, n in (plan_usage(old, budget) | {}).items() if k >= 0]
                + [n for k, n in plan_usage(new, budget).items() if k >= 0] + [1])
    cap = None if slack is None else int(floor * slack)
    units = make_units(old)
    try:
        graph = TransitionGraph.build(old, new, budget, caps=cap)
    except Infeasible as error:
        assert error.short_bytes > 0 and f"device {error.device}" in str(error)
        for ms, us in units.items():  # nothing moved
            assert_state(us, specs[ms], states[ms])
        return
    assert graph.is_acyclic()
    executor = TransitionExecutor(verify_ledger=True)
    out = executor.run(graph, units)
    if cap is not None:
        assert executor.ledger.max_peak() <= cap
    assert_plan_units(out, new, specs, states)
