"""Shared by the runtime tests that move jobs: random plans a job can run, and a job's state as host copies
(compared bit for bit by ``assert_same_state``)."""

import random

import numpy as np

from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.model_stage import ACTOR_GEN
from nereus_jax.sharding import Layout

LAYOUTS = [Layout(1), Layout(2), Layout(4), Layout(1, 2), Layout(2, 2)]


def random_plan(rng: random.Random, job, layouts=tuple(LAYOUTS)) -> ExecutionPlan:
    """A plan the job can run: any of ``layouts`` (pp = 1 for actor-gen), dp dividing the rows, devices shuffled."""
    stages = {}
    choices = layouts
    for ms in job.plan:
        layouts = [lt for lt in choices if ms != ACTOR_GEN or lt.pp == 1]
        layout = rng.choice(layouts)
        dp = rng.choice([d for d in (1, 2, 4, 8) if d * layout.size <= 8 and job.mini_rows % d == 0])
        order = rng.sample(range(8), 8)
        stages[ms] = StagePlan(layout, tuple(tuple(order[i * layout.size:(i + 1) * layout.size]) for i in range(dp)))
    return ExecutionPlan(stages)


def host_state(job) -> dict:
    """Each model-stage's canonical state (an optimizer split over replicas: gathered), copied into memory of
    its own (no view keeps a buffer alive)."""
    return {ms: [np.array(x, copy=True) for x in job.specs[ms].flatten(job.stage_host_state(ms))]
            for ms in job.units}


def assert_same_state(got: dict, want: dict) -> None:
    """Each model-stage's ``host_state`` in ``got`` equals ``want``'s, bit for bit, leaf by leaf."""
    for ms, leaves in got.items():
        for x, y in zip(leaves, want[ms], strict=True):
            np.testing.assert_array_equal(x, y, err_msg=str(ms))


def move_randomly(job, rng: random.Random, moves: int, tries: int = 30, layouts=tuple(LAYOUTS)) -> None:
    """``moves`` moves of ``job`` to random plans a schedule exists for, each keeping every model-stage's state
    bit for bit (reference: the state before the move)."""
    from nereus_jax.elastic.graph import TransitionGraph
    from nereus_jax.elastic.recipe import align_ranks
    from nereus_jax.elastic.schedule import Infeasible
    from nereus_jax.runtime.step.move import move

    moved = 0
    for _ in range(tries):
        if moved == moves:
            return
        target = align_ranks(job.plan, random_plan(rng, job, layouts))
        try:
            graph = TransitionGraph.build(job.plan, target, job.specs)
        except Infeasible:
            continue
        want = host_state(job)
        move(job, graph)
        assert_same_state(host_state(job), want)
        moved += 1
    assert moved == moves, f"{moved} of {moves} random plans had a schedule in {tries} tries"


def units_from_host(job, ms, host: dict) -> list:
    """``ms``'s units in ``job.plan`` holding the canonical state ``host`` ({"params", "opt"}), in the form the
    plan keeps it (an optimizer split over the replicas: each its block)."""
    from nereus_jax.elastic.emu import EMU, regroup_optimizer

    sp = job.plan[ms]
    units = [EMU.create(ms, job.specs[ms], sp.layout, [job.devices[i] for i in r], host) for r in sp.replicas]
    spec = job.unit_spec(ms)
    return units if spec is job.specs[ms] else regroup_optimizer(units, spec)
