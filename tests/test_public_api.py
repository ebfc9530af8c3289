"""The top-level package is a small public face: the names users call, each the object of its home module,
and planning or simulating through it does not load JAX."""

import subprocess
import sys

import nereus_jax


def test_the_public_names_are_their_modules_objects_and_need_no_jax():
    from nereus_jax.config import load_config
    from nereus_jax.elastic.planner import Planner
    from nereus_jax.sim.simulation import Simulation

    assert nereus_jax.load_config is load_config and nereus_jax.Planner is Planner
    assert nereus_jax.Simulation is Simulation
    assert all(hasattr(nereus_jax, name) for name in nereus_jax.__all__)
    assert len(nereus_jax.__all__) <= 20  # a face, not the package's contents
    code = ("import sys, nereus_jax; nereus_jax.Planner; nereus_jax.load_trace('paper_drift'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax', 'orbax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_run_job_is_the_runtimes():
    from nereus_jax.runtime.run import run_job

    assert nereus_jax.run_job is run_job
