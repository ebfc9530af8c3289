"""A model-stage declared in one place (``model_stage.JOB_STAGES``) reaches every layer: the step's topology,
the planner, the running job (its units placed, its scores computed, its seconds timed) and the simulator.
The made-up stage, judge-infer, scores the responses with the base model, as ref-infer does."""

import numpy as np
import pytest
from jobs import TINY_JOB

from nereus_jax import model_stage
from nereus_jax.model_stage import ModelStage, StageDecl

JUDGE = StageDecl("judge-infer", 1, state="base", scores=("logprobs", "judge_logp"))


@pytest.fixture
def judge(monkeypatch):
    monkeypatch.setattr(model_stage, "JOB_STAGES", [*model_stage.JOB_STAGES, JUDGE])


def test_without_the_declaration_no_layer_knows_the_stage():
    from nereus_jax.elastic.topology import Topology

    assert "judge-infer" not in Topology.of_job("grpo").stages
    with pytest.raises(model_stage.StageError, match="unknown model-stage 'judge-infer'"):
        model_stage.split_stage("judge-infer")


def test_the_topology_config_and_planner_pick_it_up(judge):
    from nereus_jax.config import load_config
    from nereus_jax.elastic.costs import CostModel
    from nereus_jax.elastic.hardware import get_hardware
    from nereus_jax.elastic.planner import Planner
    from nereus_jax.elastic.topology import Topology
    from nereus_jax.elastic.workload import Workload
    from nereus_jax.runtime.step.initial_plan import job_models

    topo = Topology.of_job("grpo")
    assert topo.phases[1][-1] == "judge-infer" and "judge-infer" in topo.units and topo.host("judge-infer") == \
        "judge-infer"
    cfg = load_config(None, ["algorithm.name=grpo", "rollout.samples_per_prompt=2",
                             "plan.stages.judge-infer.tp=2"])  # a plan key now
    assert cfg.plan.layout_for("judge-infer").tp == 2
    result = Planner(CostModel(get_hardware("cpu"))).plan(job_models(cfg), "grpo", Workload.from_config(cfg), 8,
                                                          topology=topo)
    assert ModelStage("judge", "infer") in result.plan and "judge-infer" in dict(result.choices)


def test_the_job_places_it_scores_with_it_and_times_it(judge):
    from nereus_jax.config import load_config
    from nereus_jax.rl.tasks import make_task
    from nereus_jax.rl.tokenizer import CharTokenizer
    from nereus_jax.runtime.step.job import Job

    cfg = load_config(None, TINY_JOB + ["algorithm.name=grpo", "trainer.prompts_per_step=8"])
    job = Job(cfg, make_task(cfg.task), CharTokenizer())
    try:
        ms = ModelStage("judge", "infer")
        assert ms in job.plan and len(job.units[ms]) == job.plan[ms].dp
        result = job.step(0)
        assert "judge-infer" in result.metrics["stage_seconds"]
        scored = job.learner.score(result.batch, {})
        # the base model's log-probs, through the same program as ref-infer's: equal bit for bit
        np.testing.assert_array_equal(scored["judge_logp"], scored["ref_logp"])
    finally:
        job.close()


def test_the_simulator_plans_and_prices_it(judge):
    from nereus_jax.sim import Simulation, build_trace

    trace = {"name": "judge", "description": "a declared extra stage", "hardware": "a100", "models": "qwen2.5-1.5b",
             "algorithm": "ppo", "steps": 3, "seed": 0,
             "workload": {"prompts_per_step": 256, "samples_per_prompt": 1, "packed": True,
                          "prompt_length": {"mean": 128, "p95": 256, "max": 512}},
             "response_length": {"keyframes": [{"step": 0, "mean": 500, "p95": 600}]},
             "pool": [{"step": 0, "devices": 8}]}
    sim = Simulation(build_trace(trace))
    assert "judge" in sim.models and "judge-infer" in sim.stages
    run = sim.run(["nereus"])["nereus"]
    assert all(ModelStage("judge", "infer") in r.plan.plan for r in run.records)
    assert all("judge-infer" in dict(r.plan.choices) for r in run.records)
