"""Simulated clusters and drift traces: the SAME controller, planner, cost model and transition graph as
the real job, run against a simulated cluster's ground truth (``sim.truth``), never against arrays.

    from nereus_jax.sim import Simulation, load_trace
    runs = Simulation(load_trace("paper_drift")).run(["fixed", "nereus", "oracle"])

Command line: ``python -m nereus_jax.simulate configs/sim/paper_drift.yaml [--json]``; async (one-step-off)
policies: ``--policies async_fixed,async_nereus`` (``sim.asynchronous``).
"""

from nereus_jax.sim.plan_cost import SimPlan
from nereus_jax.sim.records import ASYNC_POLICIES, PolicyRun, StepRecord
from nereus_jax.sim.simulation import POLICIES, PolicyError, Simulation, check_policy
from nereus_jax.sim.trace import Trace, TraceError, build_trace, load_trace, resolve_trace_path
from nereus_jax.sim.truth import GroundTruth, TruthSettings

__all__ = ["ASYNC_POLICIES", "POLICIES", "GroundTruth", "PolicyError", "PolicyRun", "SimPlan", "Simulation",
           "StepRecord", "Trace", "TraceError", "TruthSettings", "build_trace", "check_policy", "load_trace",
           "resolve_trace_path"]
