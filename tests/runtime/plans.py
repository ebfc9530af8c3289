"""Shared by the runtime tests that move jobs: random plans a job can run, and a job's state as host copies."""

import random

import numpy as np

from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.model_stage import ACTOR_GEN
from nereus_jax.sharding import Layout

LAYOUTS = [Layout(1), Layout(2), Layout(4), Layout(1, 2), Layout(2, 2)]


def random_plan(rng: random.Random, job) -> ExecutionPlan:
    """A plan the job can run: any tp x pp (pp = 1 for actor-gen), dp dividing the rows, devices shuffled."""
    stages = {}
    for ms in job.plan:
        layouts = [lt for lt in LAYOUTS if ms != ACTOR_GEN or lt.pp == 1]
        layout = rng.choice(layouts)
        dp = rng.choice([d for d in (1, 2, 4, 8) if d * layout.size <= 8 and job.mini_rows % d == 0])
        order = rng.sample(range(8), 8)
        stages[ms] = StagePlan(layout, tuple(tuple(order[i * layout.size:(i + 1) * layout.size]) for i in range(dp)))
    return ExecutionPlan(stages)


def host_state(job) -> dict:
    """Each model-stage's canonical state, copied into memory of its own (no view keeps a buffer alive)."""
    return {ms: [np.array(x, copy=True) for x in job.specs[ms].flatten(units[0].to_host())]
            for ms, units in job.units.items()}
