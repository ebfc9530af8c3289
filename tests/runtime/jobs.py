"""The tiny job most runtime tests run (one copy): 1-digit addition, 16 prompts x 2 samples a step, short
sequences, actor-gen on 2 replicas. conftest's ``warm`` actor is warm-started on this shape; a test that adds
overrides after it wins (the last value of a key is the one loaded).

And the one way the tests build a job of a config: on the config's built-in task, with the character tokenizer
(``job_for``, ``tiny_job``, ``restore_for``, ``warm_actor``). conftest imports this module: the jax-heavy modules
are imported inside the functions."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nereus_jax.config import Config
    from nereus_jax.runtime.step.job import Job

TINY_JOB = ["rollout.max_prompt_length=12", "rollout.max_response_length=8", "trainer.prompts_per_step=16",
            "rollout.samples_per_prompt=2", "trainer.actor_lr=1e-3", "trainer.critic_lr=1e-3",
            "logging.progress=false", "task.num_digits=1", "task.eval_size=16", "plan.stages.actor-gen.dp=2"]


def tiny_config(overrides=()) -> Config:
    """The tiny job's config with ``overrides`` after ``TINY_JOB`` (they win)."""
    from nereus_jax.config import load_config

    return load_config(None, [*TINY_JOB, *overrides])


def job_for(cfg: Config, **kwargs) -> Job:
    """A Job of ``cfg`` on its task (``make_task(cfg.task)``) with the character tokenizer; ``kwargs`` go to
    ``Job`` (actor=, plan=, devices=, rewarder=)."""
    from nereus_jax.rl.tasks import make_task
    from nereus_jax.rl.tokenizer import CharTokenizer
    from nereus_jax.runtime.step.job import Job

    return Job(cfg, make_task(cfg.task), CharTokenizer(), **kwargs)


def tiny_job(overrides=(), **kwargs) -> Job:
    """The tiny job with ``overrides`` (``tiny_config``), built by ``job_for`` (``kwargs``: actor=, plan=, ...)."""
    return job_for(tiny_config(overrides), **kwargs)


def restore_for(cfg: Config, path: str, **kwargs) -> tuple[Job, dict]:
    """``restore_job`` of the checkpoint at ``path`` into a job of ``cfg`` built as ``job_for`` builds one;
    returns (job, metadata). ``kwargs`` go to ``restore_job`` (plan=, devices=, ...)."""
    from nereus_jax.rl.tasks import make_task
    from nereus_jax.rl.tokenizer import CharTokenizer
    from nereus_jax.runtime.durability.checkpoint import restore_job

    return restore_job(cfg, make_task(cfg.task), CharTokenizer(), path, **kwargs)


def warm_actor(cfg: Config, cache_dir: str):
    """The actor ``warm_start`` gives ``cfg`` (its trainer.warmup_sft_steps; cached in ``cache_dir``), quietly."""
    from nereus_jax.rl.tasks import make_task
    from nereus_jax.rl.tokenizer import CharTokenizer
    from nereus_jax.runtime.run import warm_start

    class _Quiet:
        def log(self, _):
            pass

    return warm_start(cfg, make_task(cfg.task), CharTokenizer(), cache_dir, _Quiet())[0]
