"""The controller against synthetic metric streams: triggers, Eq. 2 admission, H, runners-up, urgency."""

import dataclasses
import json

import pytest

from nereus_jax.elastic.controller import Candidate, Controller, Observation


@dataclasses.dataclass(frozen=True)
class P:
    name: str
    devices: tuple[int, ...] = (0, 1, 2, 3)


A, B, C = P("A"), P("B"), P("C")


def _controller(latency, candidates, costs, uncertainty=None, **kw):
    return Controller(lambda obs: [Candidate(p, latency[p], (uncertainty or {}).get(p, 0.0)) for p in candidates],
                      lambda plan, obs: latency.get(plan), lambda old, new: costs.get(new), **kw)


def _obs(step, length, plan=A, devices=(0, 1, 2, 3), seconds=None):
    return Observation(step=step, plan=plan, devices=devices, response_length=length, step_seconds=seconds)


def test_no_trigger_without_drift():
    c = _controller({A: 10.0, B: 1.0}, [B], {B: 0.0})
    assert all(c.observe(_obs(s, 100 + (5 if s % 2 else -5))) is None for s in range(50))


def test_soft_trigger_fires_past_30_percent_length_drift_only():
    c = _controller({A: 10.0, B: 9.0}, [B], {B: 100.0})
    c.observe(_obs(0, 100))
    assert c.observe(_obs(1, 129)) is None
    d = c.observe(_obs(2, 131))
    assert d is not None and d.trigger == "length" and not d.urgent


def test_reference_resets_after_every_replan_even_a_rejected_one():
    c = _controller({A: 10.0, B: 9.0}, [B], {B: 100.0})
    c.observe(_obs(0, 100))
    assert not c.observe(_obs(1, 140)).admitted
    assert c.observe(_obs(2, 150)) is None  # 150 is within 30% of the new reference 140


def test_rejects_a_target_that_cannot_pay_back_within_gamma_h():
    c = _controller({A: 10.0, B: 9.0}, [B], {B: 5.0}, gamma=0.5)
    c.observe(_obs(0, 100))
    d = c.observe(_obs(1, 200))
    assert not d.admitted and d.target is None and "gamma*H=0.50" in d.rejected[0][1]


def test_admits_a_target_that_pays_back_within_gamma_h():
    c = _controller({A: 10.0, B: 9.0}, [B], {B: 0.4}, gamma=0.5)
    c.observe(_obs(0, 100))
    d = c.observe(_obs(1, 200))
    assert d.admitted and d.target == B and d.gain_s == 1.0 and d.transition_s == 0.4


def test_falls_back_to_a_runner_up_with_a_cheaper_transition():
    c = _controller({A: 10.0, B: 8.0, C: 9.0}, [B, C], {B: 10.0, C: 0.2}, gamma=0.5)
    c.observe(_obs(0, 100))
    d = c.observe(_obs(1, 200))
    assert d.admitted and d.target == C and d.rejected[0][0] == B


def test_horizon_is_an_ema_of_steps_between_crossings_and_lets_slower_paybacks_in():
    c = _controller({A: 10.0, B: 9.0}, [B], {B: 4.0}, gamma=0.5)
    c.observe(_obs(0, 100))
    assert not c.observe(_obs(2, 200)).admitted            # first crossing: H = 1, payback 4 > 0.5
    d = c.observe(_obs(12, 400))                           # second crossing 10 steps later: H = 10
    assert d.horizon == 10.0 and d.admitted                # payback 4 <= gamma * H = 5
    c.observe(_obs(14, 800))                               # a gap of 2: H = 0.5 * 2 + 0.5 * 10
    assert c.horizon["length"] == 6.0


def test_horizon_is_capped_by_the_steps_the_run_has_left():
    """H = 10 lets a payback of 4 steps in; with 6 steps left gamma * H is 3 and the same move is rejected."""
    def decide(steps_left):
        c = _controller({A: 10.0, B: 9.0}, [B], {B: 4.0}, gamma=0.5)
        for step, length in ((0, 100), (2, 200), (12, 400)):
            d = c.observe(dataclasses.replace(_obs(step, length), steps_left=steps_left))
        return d

    assert decide(None).admitted and decide(100).admitted
    late = decide(6)
    assert not late.admitted and late.horizon == 6.0 and "gamma*H=3.00" in late.rejected[0][1]


def test_gamma_zero_adapts_only_on_urgent_triggers():
    c = _controller({A: 10.0, B: 1.0}, [B], {B: 0.01}, gamma=0.0)
    c.observe(_obs(0, 100))
    assert not c.observe(_obs(1, 300)).admitted
    d = c.observe(_obs(2, 300, devices=(0, 1, 2)))         # device 3, used by plan A, left
    assert d.urgent and d.admitted and d.target == B


def test_urgent_path_waives_profitability_on_device_loss():
    c = _controller({A: 1.0, B: 50.0}, [B], {B: 1000.0})
    c.observe(_obs(0, 100))
    d = c.observe(_obs(1, 100, devices=(0, 1, 2)))
    assert d.trigger == "pool" and d.urgent and d.admitted and d.target == B


def test_urgent_path_says_when_no_live_transition_exists():
    c = _controller({A: 1.0, B: 50.0}, [B], {})
    c.observe(_obs(0, 100))
    d = c.observe(_obs(1, 100, devices=(0, 1)))
    assert d.urgent and not d.admitted and "checkpoint/restart" in d.reason


def test_pool_growth_is_a_non_urgent_trigger_judged_by_eq2():
    c = _controller({A: 10.0, B: 5.0}, [B], {B: 1.0})
    c.observe(_obs(0, 100))
    d = c.observe(_obs(1, 100, devices=tuple(range(8))))
    assert d.trigger == "pool" and not d.urgent and d.admitted


def test_memory_violation_is_urgent():
    c = _controller({A: 1.0, B: 2.0}, [B], {B: 3.0})
    c.observe(_obs(0, 100))
    obs = dataclasses.replace(_obs(1, 100), peak_memory_bytes=2e9, memory_cap_bytes=1e9)
    d = c.observe(obs)
    assert d.trigger == "memory" and d.urgent and d.admitted


def test_efficiency_drift_triggers_on_a_sustained_change_of_measured_step_time():
    c = _controller({A: 10.0, B: 9.0}, [B], {B: 100.0})
    assert all(c.observe(_obs(s, 100, seconds=10.0)) is None for s in range(3))  # reference: ratio 1.0
    assert c.observe(_obs(3, 100, seconds=14.0)) is None   # one slow step: the median of 3 is still 1.0
    d = c.observe(_obs(4, 100, seconds=14.0))               # two of the last three: the median is 1.4
    assert d is not None and d.trigger == "efficiency" and not d.urgent


def test_efficiency_drift_is_relative_to_the_achieved_efficiency_at_the_last_reset():
    """A cost model that is steadily 2x optimistic does not trigger every step; a drift from there does."""
    c = _controller({A: 10.0, B: 9.0}, [B], {B: 100.0})
    assert all(c.observe(_obs(s, 100, seconds=20.0 + (s % 3))) is None for s in range(20))
    assert c.observe(_obs(20, 100, seconds=28.0)) is None
    assert c.observe(_obs(21, 100, seconds=28.0)).trigger == "efficiency"


def test_a_straggler_step_every_few_steps_is_not_an_efficiency_drift():
    """At 1,024 GPUs a 1.3-2x straggler hits some stage every few dozen steps: single slow steps (and the
    normal step after one) must not re-plan, as they did when the signal was one step's ratio."""
    c = _controller({A: 10.0, B: 9.0}, [B], {B: 0.1})
    seconds = [10.0, 10.0, 10.0, 19.0, 10.0, 10.0, 10.0, 10.0, 16.0, 10.0, 10.0, 20.0, 10.0]
    assert all(c.observe(_obs(s, 100, seconds=t)) is None for s, t in enumerate(seconds))


def test_a_new_plan_is_judged_on_its_own_steps_not_the_old_plans():
    """After a move the cost model may be off for the new plan: its first steps set a new reference instead
    of comparing with the old plan's efficiency (which re-planned again a step or two after every move)."""
    c = _controller({A: 10.0, B: 9.0, C: 5.0}, [C], {C: 0.1})
    assert all(c.observe(_obs(s, 100, seconds=10.0)) is None for s in range(3))
    d = c.observe(_obs(3, 200, seconds=10.0))
    assert d.admitted and d.target == C
    # C runs 2x slower than predicted, steadily: a new reference after its first 3 steps, no trigger
    assert all(c.observe(_obs(s, 200, plan=C, seconds=10.0)) is None for s in range(4, 12))
    assert c.reference_ratio == 2.0
    assert c.observe(_obs(12, 200, plan=C, seconds=14.0)) is None
    assert c.observe(_obs(13, 200, plan=C, seconds=14.0)).trigger == "efficiency"  # 1.4 / 2.0: a real drift


def test_period_replans_every_k_steps_and_on_hard_triggers_only():
    c = _controller({A: 10.0, B: 9.0}, [B], {B: 100.0}, period=3, gamma=float("inf"))
    fired = {s: c.observe(_obs(s, 100 * 2**s, seconds=10.0 * s + 10)) for s in range(7)}
    assert [s for s, d in fired.items() if d is not None] == [3, 6]  # no length / efficiency trigger
    assert {d.trigger for d in fired.values() if d is not None} == {"schedule"}
    assert c.observe(_obs(7, 100, devices=(0, 1, 2))).trigger == "pool"
    assert c.horizon["schedule"] == 3.0


def test_state_dict_round_trip_makes_a_restarted_controller_decide_the_same():
    def run(controller, steps):
        return [(d.trigger, d.admitted, d.horizon) if (d := controller.observe(o)) else None for o in steps]

    first = [_obs(0, 100, seconds=10.0), _obs(1, 100, seconds=10.0), _obs(3, 140, seconds=10.0),
             _obs(4, 140, seconds=10.0), _obs(9, 200, seconds=14.0)]
    then = [_obs(10, 200, seconds=14.0), _obs(11, 300, seconds=14.0), _obs(12, 300, devices=(0, 1, 2, 3, 4))]
    make = lambda: _controller({A: 10.0, B: 9.0}, [B], {B: 5.0}, gamma=0.5)  # noqa: E731
    whole = make()
    expected = run(whole, first + then)
    assert any(expected[len(first):])
    saved = make()
    run(saved, first)
    state = json.loads(json.dumps(saved.state_dict()))  # what a checkpoint stores
    restarted = make()
    restarted.load_state_dict(state)
    assert run(restarted, then) == expected[len(first):]
    assert restarted.state_dict() == whole.state_dict()


def test_a_pool_change_before_the_first_observation_triggers_when_the_starting_pool_is_given():
    """The runtime knows the pool it started on: a leave announced before the controller's first
    observation is still a (urgent) pool trigger; without ``devices`` the first observation only sets
    the references."""
    c = _controller({A: 1.0, B: 50.0}, [B], {B: 1000.0}, devices=(0, 1, 2, 3))
    d = c.observe(_obs(0, 100, devices=(0, 1, 2)))
    assert d is not None and d.trigger == "pool" and d.urgent and d.admitted and d.target == B
    assert _controller({A: 1.0, B: 50.0}, [B], {B: 1000.0}).observe(_obs(0, 100, devices=(0, 1, 2))) is None
    assert _controller({A: 1.0}, [B], {B: 1.0}, devices=(0, 1, 2, 3)).observe(_obs(0, 100)) is None


def _moved_then_missed(**kw):
    """A move to B predicted at 8 s whose first measured step takes 10 s (a 25% error), then a length drift
    whose only candidate, C, is predicted to gain 1 s/step (12.5%) for a 0.4 s transition, with an
    uncertainty of 1.5 s/step about that gain (C runs calls the model has not measured)."""
    c = _controller({A: 10.0, B: 8.0, C: 7.0}, [B, C], {B: 0.4, C: 0.4}, {C: 1.5}, gamma=0.5, **kw)
    c.observe(_obs(0, 100))
    moved = c.observe(_obs(1, 200))
    assert moved.admitted and moved.target == B
    assert c.observe(_obs(2, 200, plan=B, seconds=10.0)) is None
    return c, c.observe(_obs(3, 300, plan=B))


def test_a_gain_within_the_cost_models_uncertainty_is_not_admitted():
    c, d = _moved_then_missed()
    assert not d.admitted and "within the cost model's uncertainty" in d.rejected[0][1]
    assert c.transfer_error == 0.25  # |10 / 8 - 1|, measured on the first step the move reached (reported)
    assert c.move_checks == [{"step": 2, "predicted_s": 8.0, "measured_s": 10.0, "uncertainty_s": 0.0,
                              "within": False, "outside_by_s": 2.0}]  # the runtime logs it
    restarted = _controller({A: 10.0}, [], {})
    restarted.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert restarted.transfer_error == 0.25  # a checkpoint keeps it
    # the same gain with a small uncertainty (calls of measured sizes) is admitted, with its margin
    sure = _controller({A: 10.0, C: 7.0}, [C], {C: 0.4}, {C: 0.2}, gamma=0.5)
    sure.observe(_obs(0, 100))
    d = sure.observe(_obs(1, 200))
    assert d.admitted and d.target == C and d.margin_s == pytest.approx(0.2)


def test_without_the_error_margin_eq2_admits_the_same_gain_as_the_paper_does():
    c, d = _moved_then_missed(error_margin=False)
    assert d.admitted and d.target == C and d.gain_s == 1.0 and d.margin_s == 0.0


def test_a_dropped_move_does_not_count_as_the_models_error():
    c = _controller({A: 10.0, B: 8.0, C: 7.0}, [B, C], {B: 0.4, C: 0.4}, gamma=0.5)
    c.observe(_obs(0, 100))
    assert c.observe(_obs(1, 200)).target == B
    c.forget_move()  # the runtime replaced it (a requested plan C, measured at 10 s)
    assert c.observe(_obs(2, 200, plan=C, seconds=10.0)) is None
    assert c.transfer_error == 0.0


def test_an_urgent_move_prefers_the_plan_the_model_is_sure_of():
    """No gain to check when devices leave: the reachable candidate with the least predicted latency plus its
    uncertainty wins (B is predicted 1 s faster than C but is a 3 s guess)."""
    latency, uncertainty = {A: 10.0, B: 5.0, C: 6.0}, {B: 3.0, C: 0.5}
    d = _controller(latency, [B, C], {B: 1.0, C: 1.0}, uncertainty, devices=(0, 1, 2, 3)).observe(
        _obs(0, 100, devices=(0, 1, 2)))
    assert d.urgent and d.admitted and d.target == C
    d = _controller(latency, [B, C], {B: 1.0, C: 1.0}, uncertainty, devices=(0, 1, 2, 3), error_margin=False).observe(
        _obs(0, 100, devices=(0, 1, 2)))
    assert d.target == B  # Eq. 2 as the paper has it: the fastest prediction


def _moe(step, load, plan=A, length=100):
    return dataclasses.replace(_obs(step, length, plan), expert_load=load)


def test_expert_load_skew_is_a_soft_trigger_priced_by_the_same_eq2():
    """A 30% drift of the busiest expert's share triggers a re-plan; the move is admitted exactly when Eq. 2
    admits it (first crossing: H = 1, payback 4 steps rejected; 10 steps later H = 10 lets it in)."""
    c = _controller({A: 10.0, B: 9.0}, [B], {B: 4.0}, gamma=0.5)
    assert c.observe(_moe(0, 0.01)) is None
    assert c.observe(_moe(1, 0.0129)) is None                # within 30% of the reference 0.01
    first = c.observe(_moe(2, 0.0131))
    assert first.trigger == "expert" and not first.urgent and not first.admitted
    assert "gamma*H=0.50" in first.rejected[0][1]
    second = c.observe(_moe(12, 0.02))
    assert second.trigger == "expert" and second.horizon == 10.0 and second.admitted and second.target == B
    assert c.state_dict()["reference_expert_load"] == 0.02


def test_observations_without_expert_load_never_trigger_on_it():
    c = _controller({A: 10.0, B: 1.0}, [B], {B: 0.0})
    c.observe(_moe(0, 0.01))
    assert all(c.observe(_obs(s, 100)) is None for s in range(1, 20))  # dense: expert_load None
