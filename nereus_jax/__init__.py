"""nereus_jax: RL post-training for decoder LLMs in JAX whose parallel layout adapts while the job runs.

What users call, importable from here; each name is loaded from its module on first use (every module of
the package runs this file first, so it imports nothing itself, and planning or simulating never loads JAX):

    from nereus_jax import load_config, run_job
    summary = run_job(load_config("grpo_tiny", ["trainer.steps=10"]), "runs/demo")

    from nereus_jax import Planner, CostModel, Workload, get_hardware, Simulation, load_trace

Everything else stays importable from its module (``nereus_jax.models``, ``nereus_jax.sharding``,
``nereus_jax.elastic.*``, ``nereus_jax.runtime.*``). The command lines: ``python -m nereus_jax.train``,
``python -m nereus_jax.plan``, ``python -m nereus_jax.simulate``, ``python -m nereus_jax.export``.
"""

import importlib

__version__ = "0.1.0"

_HOME = {
    "Config": "nereus_jax.config", "ConfigError": "nereus_jax.config", "load_config": "nereus_jax.config",
    "run_job": "nereus_jax.runtime.run",
    "CostModel": "nereus_jax.elastic.costs", "get_hardware": "nereus_jax.elastic.hardware",
    "Workload": "nereus_jax.elastic.workload",
    "Planner": "nereus_jax.elastic.planner", "InfeasiblePlanError": "nereus_jax.elastic.planner",
    "ExecutionPlan": "nereus_jax.elastic.plan", "StagePlan": "nereus_jax.elastic.plan",
    "ModelStage": "nereus_jax.model_stage", "Layout": "nereus_jax.layout",
    "Simulation": "nereus_jax.sim.simulation", "load_trace": "nereus_jax.sim.trace",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'nereus_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
