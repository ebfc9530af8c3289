"""The simulator offers the controller the job's candidates: one policy (``elastic.adapter.ControllerAdapter``)
serves the running job (``JobPricer``) and the simulator (``PlanningModel``), so a simulated figure tests the
policy the job runs.

The state: the tiny job calibrated on four steps, and a simulator's planning model given that state (models,
algorithm, hardware, topology, the job's pricing with its calibration, workload, usable bytes, the plans it
ran, the pool, the plan it started on as its home). The simulator plans on a snapshot of its cost model rounded
to a 2% grid; the job's efficiencies are put on that grid first (restored through ``load_state_dict``, as a
checkpoint would), so both planners see the same numbers. The pool is the one the job started on: off it the
home plans differ by design (the job maps its configured layouts onto the pool, the simulator re-plans its first
plan's layouts)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # the tiny job (tests/runtime/jobs.py)
from jobs import tiny_job  # noqa: E402

from nereus_jax.elastic.adapter import partial_moves  # noqa: E402
from nereus_jax.elastic.controller import Observation  # noqa: E402
from nereus_jax.runtime.control.job_pricer import JobPricer  # noqa: E402
from nereus_jax.runtime.step.initial_plan import plan_from_config  # noqa: E402
from nereus_jax.sim.model import PlanningModel, SharedCaches  # noqa: E402
from nereus_jax.sim.plan_cost import SimPlan, state_specs  # noqa: E402


@pytest.fixture(scope="module")
def calibrated():
    """The tiny job after four steps (one compiling, three calibrating), its pricer on the 2% grid."""
    job = tiny_job()
    pricer = JobPricer(job, log=lambda _: None)
    for step in range(4):
        pricer.learn(job.step(step).metrics)
    assert pricer.pricing.measured_layouts and pricer.workload is not None
    grid = _sim(pricer).snapshot()
    pricer.load_state_dict({**pricer.state_dict(), "efficiency": grid.efficiency, "half_sizes": grid.half_sizes})
    assert _sim(pricer).snapshot().efficiency == pricer.cost.efficiency  # grid-exact: the snapshot changes nothing
    return job, pricer


def _sim(pricer: JobPricer) -> PlanningModel:
    """A simulator's planning model on the job's state."""
    job, pricing = pricer.job, pricer.pricing
    cfg, topo, wl = job.cfg, pricing.topology, pricer.workload
    sim_plan = lambda plan: SimPlan.build(pricing.choices(plan, wl), plan, topo)  # noqa: E731
    home = (sim_plan(plan_from_config(cfg)), tuple(range(cfg.cluster.num_devices)))
    sim = PlanningModel(pricing.models, cfg.algorithm.name, pricing.hardware, topo,
                        state_specs(pricing.models, topo.units), SharedCaches(),
                        planner={"headroom": cfg.controller.memory_headroom}, home=home)
    sim.pricing = pricing  # the calibration: efficiencies, covariance, window, measured layouts (read only)
    sim.observed = wl
    sim.ran = {sim_plan(p): None for p in pricer.ran_plans()}
    assert sim.usable_bytes() == pricer.memory_cap_bytes == sim.pricing.usable_bytes
    return sim


def _both(job, pricer, sim):
    devices = tuple(range(job.cfg.cluster.num_devices))
    obs = Observation(step=4, plan=job.plan, devices=devices, response_length=pricer.response_length)
    current = SimPlan.build(pricer.pricing.choices(job.plan, pricer.workload), job.plan, pricer.pricing.topology)
    return pricer.candidates(obs), sim.candidates(Observation(step=4, plan=current, devices=devices,
                                                              response_length=pricer.response_length))


def _assert_same(job_candidates, sim_candidates):
    assert [c.plan for c in job_candidates] == [c.plan.plan for c in sim_candidates]  # the same plans, in order
    assert [c.step_latency_s for c in sim_candidates] == pytest.approx([c.step_latency_s for c in job_candidates],
                                                                       rel=1e-12)
    assert [c.uncertainty_s for c in sim_candidates] == pytest.approx([c.uncertainty_s for c in job_candidates],
                                                                      rel=1e-9, abs=1e-15)


def test_the_simulators_candidates_are_the_jobs_on_the_same_state(calibrated):
    job, pricer = calibrated
    sim = _sim(pricer)
    job_candidates, sim_candidates = _both(job, pricer, sim)
    _assert_same(job_candidates, sim_candidates)
    # not vacuous: the planner's plans, partial moves toward its best that it does not name, the plan the job runs
    planned = pricer.planned(Observation(step=4, plan=job.plan, devices=tuple(range(8)), response_length=4.0),
                             pricer.workload)
    plans = {c.plan for c in job_candidates}
    assert set(planned) <= plans and job.plan in plans
    assert set(partial_moves(job.plan, planned[0])) & plans - set(planned)


def test_both_offer_the_risk_adjusted_plan_alike(calibrated, monkeypatch):
    """The third step of the policy: when the planner's best extrapolates (here: as if it did), the best plan
    under risk-ranked options. The ranking is reversed (test_adapt's device), so that plan is one
    the plain planner never offers."""
    job, pricer = calibrated
    sim = _sim(pricer)
    assert sim.pricing is pricer.pricing
    monkeypatch.setattr(pricer.pricing, "all_measured", lambda choices: False)
    monkeypatch.setattr(pricer.pricing, "risk_adjusted",
                        lambda options, z: {s: o.ranked_by(-o.latency) for s, o in options.items()})
    job_candidates, sim_candidates = _both(job, pricer, sim)
    _assert_same(job_candidates, sim_candidates)
    obs = Observation(step=4, plan=job.plan, devices=tuple(range(8)), response_length=4.0)
    (slow,) = pricer.risk_planned(obs, pricer.workload)
    assert slow in {c.plan for c in job_candidates} - set(pricer.planned(obs, pricer.workload))
