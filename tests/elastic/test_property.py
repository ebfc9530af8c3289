"""Property: for random plan pairs on 8 CPU devices and random tight caps, every graph is acyclic, the
ledger never passes a cap while it runs (and matches the live arrays whenever nothing is in flight), and
the final state is the target layout bit for bit; or the pair is reported infeasible before anything moves."""

from elastic_helpers import assert_plan_units, assert_state, plan_pairs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus_jax.elastic.executor import TransitionExecutor
from nereus_jax.elastic.graph import TransitionGraph, plan_usage
from nereus_jax.elastic.schedule import Infeasible


@st.composite
def plan_pairs_and_slack(draw):
    old, new = draw(plan_pairs())
    slack = draw(st.sampled_from([None, 1.0, 1.1, 1.25, 1.5, 2.0]))
    return old, new, slack


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan_pairs_and_slack())
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
