"""Growing lengths as users stage them: rollout.length_schedule cuts responses at each stage's budget,
task.schedule draws each stage's problems at its difficulty, a resume must continue both, and every step
reports the device memory it held (summary.json counts the steps over the cap)."""

import gc

import pytest
from jobs import job_for, restore_for

from nereus_jax.config import ConfigError, load_config
from nereus_jax.runtime.step.job import device_bytes_in_use

TINY = ["rollout.max_prompt_length=12", "rollout.max_response_length=8", "trainer.prompts_per_step=8",
        "rollout.samples_per_prompt=2", "logging.progress=false", "task.num_digits=1", "task.eval_size=16",
        "plan.stages.actor-gen.dp=2", "rollout.temperature=1.0"]
STAGED = ["rollout.length_schedule=[{step: 0, max_response_length: 2}, {step: 2, max_response_length: 8}]",
          "task.schedule=[{step: 0, num_digits: 1}, {step: 1, num_digits: 3}]"]


def test_each_stage_cuts_responses_at_its_budget_and_draws_its_difficulty():
    """A random model rarely stops: responses run to the budget, 2 tokens for steps 0-1 and 8 from step 2;
    step 0's problems add 1-digit numbers, step 1's 3-digit ones."""
    job = job_for(load_config(None, TINY + STAGED + ["trainer.packing=true"]))
    try:
        lengths = [job.step(s).batch.response_mask_br.sum(1) for s in range(3)]
        operands = [max(len(x) for x in p.prompt.rstrip("=").split("+")) for p in job.problems(0)[0]]
        assert max(operands) == 1
        assert {max(len(x) for x in p.prompt.rstrip("=").split("+")) for p in job.problems(1)[0]} == {3}
        assert job.problems(5)[0] == job.problems(5)[0]  # a function of the step
    finally:
        job.close()
    assert lengths[0].max() <= 2 and lengths[1].max() <= 2 and lengths[2].max() > 2
    assert lengths[2].max() <= 8


def test_schedules_that_do_not_fit_the_programs_are_refused():
    with pytest.raises(ConfigError, match="raise rollout.max_response_length"):
        load_config(None, TINY + ["rollout.length_schedule=[{step: 0, max_response_length: 16}]"])
    with pytest.raises(ConfigError, match="step order"):
        load_config(None, TINY + ["task.schedule=[{step: 3, num_digits: 1}, {step: 1, num_digits: 2}]"])


def test_a_resume_continues_the_saved_schedules(tmp_path):
    from nereus_jax.runtime.durability.checkpoint import Checkpointer, CheckpointError

    cfg = load_config(None, TINY + STAGED)
    job = job_for(cfg)
    ckpt = Checkpointer(str(tmp_path / "ck"), every_steps=1, keep=1)
    job.step(0)
    ckpt.save(job, 1, wait=True)
    ckpt.close()
    job.close()
    other = load_config(None, TINY + STAGED[:1] + ["task.schedule=[{step: 0, num_digits: 2}]"])
    with pytest.raises(CheckpointError, match="task.schedule"):
        restore_for(other, str(tmp_path / "ck" / "1"))
    resumed, meta = restore_for(cfg, str(tmp_path / "ck" / "1"))
    try:
        assert meta["schedules"]["task.schedule"] == [{"step": 0, "num_digits": 1}, {"step": 1, "num_digits": 3}]
        assert resumed.response_budget(meta["step"]) == 2 and resumed.task_at(meta["step"]).num_digits == 3
    finally:
        resumed.close()


def test_steps_report_the_device_memory_they_held():
    """device_bytes_max counts what a device holds (the engines' paged KV pools too), and over_memory_cap says
    whether that passed cluster.device_memory_bytes."""
    # live_arrays() counts every array in the process: garbage that earlier tests left in reference cycles would be
    # counted by the step and gone (collected) by the second reading
    gc.collect()
    cap = 2 * 2**20
    job = job_for(load_config(None, TINY + ["rollout.page_size=4", f"cluster.device_memory_bytes={cap}"]))
    try:
        m = job.step(0).metrics
        held = device_bytes_in_use(job.devices)
        pool = job.rollout.engines[0].engine.kv_cache_bytes
    finally:
        job.close()
    # the same count read again after the step (temporaries of the step's end may differ by a few KiB)
    assert m["device_bytes_max"] == pytest.approx(max(held.values()), rel=0.01) and m["device_bytes_max"] > pool > 0
    assert m["over_memory_cap"] is True and m["device_bytes_max"] > cap  # 2 MiB: the tiny job holds more
