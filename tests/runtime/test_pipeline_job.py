"""pp > 1 in the job runs the pipeline the cost model prices (issue 19): the scoring programs of a stage whose
layout has pp = 2 trace the GPipe schedule and its training programs the 1F1B one (trainer.pipeline_schedule's
default), and they compute what the pp = 1 job computes (padded and packed)."""

import numpy as np
import pytest
from jobs import tiny_job

import nereus_jax.sharding.pipeline as pipeline

_GPIPE, _1F1B = pipeline._gpipe, pipeline._run_1f1b
PP2 = ["plan.stages.actor-train.pp=2", "plan.stages.actor-train.dp=4", "plan.stages.ref-infer.pp=2",
       "plan.stages.ref-infer.dp=4", "plan.stages.critic-train.pp=2", "plan.stages.critic-train.dp=4"]


def _two_steps(overrides, warm, monkeypatch):
    traced = []  # (schedule, pp) of every pipeline schedule traced
    monkeypatch.setattr(pipeline, "_gpipe", lambda *a, **k: traced.append(("gpipe", a[-1])) or _GPIPE(*a, **k))
    monkeypatch.setattr(pipeline, "_run_1f1b", lambda *a, **k: traced.append(("1f1b", k["mesh"].shape[k["axis"]]))
                        or _1F1B(*a, **k))
    job = tiny_job(overrides, actor=warm)
    try:
        return [job.step(s) for s in range(2)], traced, job.plan
    finally:
        job.close()


@pytest.mark.parametrize("packing", [False, True])
def test_pp2_stages_run_the_pipeline_and_compute_what_pp1_computes(warm, monkeypatch, packing):
    """PPO (actor, critic, ref; actor-infer and critic-infer on the training units) with pp = 2 for every
    stage but generation: the pipeline is traced with pp = 2, and rollouts and metrics equal the pp = 1 job's
    (float reduction order aside)."""
    extra = [f"trainer.packing={packing}"]
    flat, traced_flat, _ = _two_steps(extra, warm, monkeypatch)
    piped, traced_piped, plan = _two_steps(extra + PP2, warm, monkeypatch)
    assert not traced_flat and set(traced_piped) == {("gpipe", 2), ("1f1b", 2)}  # only the pp = 2 job pipelines
    assert {str(ms): sp.layout.pp for ms, sp in plan.items()} == {"actor-gen": 1, "ref-infer": 2,
                                                                 "actor-train": 2, "critic-train": 2}
    for a, b in zip(flat, piped, strict=True):
        np.testing.assert_array_equal(a.batch.response_br, b.batch.response_br)
        for key in ("reward_mean", "kl", "loss", "policy_loss", "value_loss", "grad_norm"):
            np.testing.assert_allclose(b.metrics[key], a.metrics[key], rtol=1e-4, atol=1e-6, err_msg=key)
