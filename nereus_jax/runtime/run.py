"""A whole run: check the inputs, warm-start the actor (cached), run the RL steps, evaluate, report.

    summary = run_job(load_config("ppo_tiny"), run_dir="runs/demo")

Everything a user can get wrong (config, prompt file, tokenizer, checkpoint path, plan devices) is
checked before any compute, with an error naming the input and the fix.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import jax
import numpy as np

from nereus_jax.config import Config, ConfigError
from nereus_jax.engine import Generator, SamplingParams
from nereus_jax.models import init_params
from nereus_jax.rl.tasks import PromptDataError, make_task
from nereus_jax.rl.tokenizer import CharTokenizer, HFTokenizer
from nereus_jax.runtime.adapt import Adapter
from nereus_jax.runtime.async_rl import AsyncRunner
from nereus_jax.runtime.checkpoint import (
    Checkpointer,
    GracefulStop,
    checkpoint_dir,
    load_controller,
    recover_from_device_loss,
    restore_job,
    stop_agreed,
    training_snapshot,
)
from nereus_jax.runtime.distributed import is_primary
from nereus_jax.runtime.job import DeviceLost, Job, JobError, StepResult
from nereus_jax.runtime.report import RunReport
from nereus_jax.runtime.warmstart import SFT_INDEX_OFFSET, cached_warm_start, run_sft
from nereus_jax.sharding import Layout, make_mesh, shard_params


# jax 0.10.2 on CPU: a fresh 8-device SPMD program with all-reduces started after the RL steps never
# completes (two device threads never join the rendezvous; XLA aborts the process after 40 s). Seen only
# with the SFT control's program; not root-caused. jax 0.11+ is unaffected.
def _jax_cpu_collectives_hang() -> bool:
    return tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11) and jax.default_backend() == "cpu"


def check_inputs(cfg: Config):
    """(task, tokenizer), or a JobError / PromptDataError / ConfigError before anything is compiled."""
    if cfg.checkpoint.resume_from and not os.path.exists(cfg.checkpoint.resume_from):
        raise JobError(f"checkpoint.resume_from={cfg.checkpoint.resume_from!r} does not exist: give the path of "
                       "a checkpoint folder, or drop the key to start fresh")
    rm = cfg.task.reward_model_path
    if rm and not os.path.isdir(rm):
        raise JobError(f"task.reward_model_path={rm!r} is not a folder: give a local Hugging Face "
                       "*ForSequenceClassification checkpoint (config.json + safetensors)")
    n = len(jax.devices())
    if cfg.cluster.num_devices > n:
        raise JobError(f"cluster.num_devices={cfg.cluster.num_devices} but only {n} devices exist; lower it (on "
                       "CPU, XLA_FLAGS=--xla_force_host_platform_device_count must be set before JAX starts)")
    if cfg.trainer.mode == "async" and jax.process_count() > 1:
        raise JobError(f"trainer.mode=async runs in one process (its generator thread drives local engines); "
                       f"this launch has {jax.process_count()} processes: use trainer.mode=sync, or one process")
    tok = HFTokenizer(cfg.task.tokenizer_path) if cfg.task.tokenizer_path else CharTokenizer()
    if tok.vocab_size > cfg.model.vocab_size:
        raise JobError(f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}")
    task = make_task(cfg.task, seed=cfg.trainer.seed)
    limit = cfg.rollout.max_prompt_length
    for p in task.eval_problems() + [task.problem(i) for i in range(cfg.trainer.prompts_per_step)]:
        if len(tok.encode(p.prompt)) + 1 > limit:
            raise PromptDataError(f"prompt {p.prompt[:40]!r} has {len(tok.encode(p.prompt)) + 1} tokens (with bos), "
                                  f"more than rollout.max_prompt_length={limit}: raise it or shorten the prompts")
    return task, tok


def run_job(cfg: Config, run_dir: str, *, started: float | None = None) -> dict:
    started = time.perf_counter() if started is None else started
    task, tok = check_inputs(cfg)
    report = RunReport(run_dir, cfg.trainer.steps, progress=cfg.logging.progress,
                       tensorboard=cfg.logging.tensorboard, primary=is_primary())
    cache_dir = cfg.logging.cache_dir or os.path.join(os.path.dirname(os.path.abspath(run_dir)), "cache")
    resume = cfg.checkpoint.resume_from
    warm, hit, sft_s = (None, False, 0.0) if resume else _warm_start(cfg, task, tok, cache_dir, report)
    job, first, meta = _start_job(cfg, task, tok, warm, report)
    report.log(f"plan:\n{job.plan}")
    held_out = task.eval_problems()
    acc_before = job.evaluate(held_out)
    report.log(f"held-out accuracy after the warm start: {acc_before:.3f}")
    adapter = Adapter(job, log=report.log)
    job.adapter = adapter
    if meta is not None and not load_controller(job, meta):
        report.log("the controller starts afresh (the checkpoint was written on another device count)")
    ckpt = Checkpointer(checkpoint_dir(cfg, run_dir), every_steps=cfg.checkpoint.every_steps,
                        keep=cfg.checkpoint.keep)
    rl_start, tokens, step_s, stopped = time.perf_counter(), 0, 0.0, None
    with GracefulStop() as stop:
        try:
            for result in rl_steps(job, adapter, cfg.trainer.steps, first=first, checkpointer=ckpt):
                job = adapter.job  # a device loss restored from a checkpoint replaces the job
                metrics = result.metrics
                tokens, step_s = tokens + metrics["response_tokens"], step_s + metrics["step_seconds"]
                report.step(metrics)
                stopped = _after_step(cfg, job, ckpt, stop, metrics["step"] + 1)
                if stopped is not None:
                    break
        finally:
            adapter.close()
            ckpt.close()
    job = adapter.job
    rl_s = time.perf_counter() - rl_start
    if stopped is not None:
        return _stopped(cfg, job, report, ckpt.directory, stopped, started)
    acc_after = job.evaluate(held_out)
    report.log(f"held-out accuracy after {cfg.trainer.steps} RL steps: {acc_after:.3f}")
    control = None
    if cfg.trainer.warmup_sft_steps and cfg.trainer.sft_control and warm is not None:  # not on a resume
        if _jax_cpu_collectives_hang():
            report.log("SFT control skipped: on jax < 0.11 (CPU) its 8-device all-reduce deadlocks after the RL "
                        "steps (XLA rendezvous timeout); accuracy_sft_control is null")
        else:
            control = _sft_control(cfg, task, tok, job, warm, rl_s, held_out)
    summary = {"algorithm": cfg.algorithm.name, "model": cfg.model.name, "task": cfg.task.name,
               "accuracy_before": acc_before, "accuracy_after": acc_after, "accuracy_sft_control": control,
               "steps": cfg.trainer.steps, "transitions": adapter.transitions,
               "controller_events": adapter.events, "tokens_per_s": tokens / max(step_s, 1e-9),
               "rl_seconds": rl_s, "warm_start_seconds": sft_s, "warm_start_cache_hit": hit,
               "plan": repr(job.plan), "wall_s": time.perf_counter() - started}
    report.finish(summary)
    return summary


def _start_job(cfg: Config, task, tok, warm: dict | None, report: RunReport) -> tuple[Job, int, dict | None]:
    """(job, first step, checkpoint metadata): from checkpoint.resume_from, laid out in the plan for the
    devices present now, else a fresh job from the warm-started actor."""
    if not cfg.checkpoint.resume_from:
        return Job(cfg, task, tok, actor_params=warm), 0, None
    job, meta = restore_job(cfg, task, tok, cfg.checkpoint.resume_from)
    report.log(f"resumed from {meta['_step_dir']} at step {meta['step']} (written on {meta['num_devices']} "
               f"devices, now {len(job.devices)})")
    return job, meta["step"], meta


def _after_step(cfg: Config, job: Job, ckpt: Checkpointer, stop: GracefulStop, done: int):
    """Periodic and end-of-run checkpoints; after SIGTERM / SIGINT (on any process) a save, and
    (signal name, step to resume at) to stop the loop."""
    ckpt.maybe_save(job, done)
    if done == cfg.trainer.steps and cfg.checkpoint.every_steps:
        ckpt.save(job, done)
    if done < cfg.trainer.steps and stop_agreed(stop):
        ckpt.save(job, done)
        return stop.signal or "a signal to another process", done
    return None


def _stopped(cfg: Config, job: Job, report: RunReport, directory: str, stopped, started: float) -> dict:
    """The summary of a run that a signal stopped after saving (no final evaluation)."""
    name, step = stopped
    report.log(f"stopped by {name} after step {step - 1}; saved {directory}/{step}. Resume: the same command "
               f"with checkpoint.resume_from={directory}")
    summary = {"algorithm": cfg.algorithm.name, "model": cfg.model.name, "task": cfg.task.name,
               "steps": cfg.trainer.steps, "stopped_by": name, "resume_step": step, "resume_from": directory,
               "plan": repr(job.plan), "wall_s": time.perf_counter() - started}
    report.finish(summary)
    return summary


def rl_steps(job: Job, adapter: Adapter, steps: int, first: int = 0,
             checkpointer: Checkpointer | None = None) -> Iterator[StepResult]:
    """The learner's updates in order: sync steps with the controller asked at every boundary, or (
    ``trainer.mode=async``) the asynchronous runner, which asks it at weight syncs.

    Sync mode survives devices lost during a step (:class:`DeviceLost`; ``cluster.schedule`` ``fail``
    injects one): the job moves onto the surviving units when every model-stage kept a complete copy of
    its state as of the step's start, otherwise it is restored from ``checkpointer``'s last checkpoint
    (a save still being written is waited for: it holds the state as of this step's start); the step (or
    the steps since the checkpoint) is redone. ``adapter.job`` is the job
    that runs from then on."""
    if job.cfg.trainer.mode == "async":
        yield from AsyncRunner(job, adapter, log=adapter.log).run(steps, first=first)
        return
    faults = {c.step: c.fail for c in job.cfg.cluster.schedule if c.fail}
    metrics, step = None, first
    while step < steps:
        t = time.perf_counter()
        adapter.boundary(step, metrics)
        boundary_s = time.perf_counter() - t
        before = training_snapshot(job)
        if step in faults:
            job.inject_device_loss(faults.pop(step))  # once: the redone step does not fail again
        try:
            result = job.step(step)
        except DeviceLost as lost:
            adapter.log(f"step {step}: {lost}")
            if checkpointer is not None:
                checkpointer.wait()
            rec = recover_from_device_loss(job, lost.device_ids, step, before,
                                           checkpointer.directory if checkpointer is not None else None)
            adapter.log(f"step {step}: {rec.describe()}")
            adapter.lose(lost.device_ids, rec.job)
            job, metrics, step = rec.job, None, rec.next_step
            continue
        result.metrics["boundary_seconds"] = boundary_s
        metrics = result.metrics
        yield result
        step += 1


def _warm_start(cfg: Config, task, tok, cache_dir: str, report: RunReport):
    params = init_params(cfg.model, seed=cfg.trainer.seed)
    if not cfg.trainer.warmup_sft_steps:
        return params, False, 0.0
    t = time.perf_counter()
    mesh, sharded = _sft_mesh(cfg, params)
    target = cfg.trainer.warmup_target_accuracy
    until = f", stopping at validation accuracy {target}" if target else ""
    report.log(f"warm start: up to {cfg.trainer.warmup_sft_steps} supervised steps{until} (cache: {cache_dir})")
    trained, hit = cached_warm_start(sharded, cfg, task, tok, mesh, cache_dir)
    from nereus_jax.sharding import gather_params

    host = gather_params(trained, cfg.model)
    seconds = time.perf_counter() - t
    report.log(f"warm start {'loaded from cache' if hit else 'trained'} in {seconds:.1f} s")
    return host, hit, seconds


def _sft_mesh(cfg: Config, params: dict):
    """Supervised steps data-parallel over the devices that divide the SFT batch."""
    n = cfg.cluster.num_devices
    dp = max(d for d in range(1, n + 1) if n % d == 0 and cfg.trainer.sft_batch % d == 0)
    mesh = make_mesh(jax.devices()[:dp], Layout(), dp=dp)
    return mesh, shard_params(params, cfg.model, Layout(), mesh)


def _sft_control(cfg: Config, task, tok, job: Job, warm: dict, seconds: float, held_out) -> float:
    """What continuing the supervised phase for the RL phase's wall time reaches (information only)."""
    mesh, sharded = _sft_mesh(cfg, warm)
    params = run_sft(sharded, cfg, task, tok, mesh, max_seconds=seconds,
                     first_index=SFT_INDEX_OFFSET + cfg.trainer.warmup_sft_steps * cfg.trainer.sft_batch)
    from nereus_jax.sharding import gather_params

    return evaluate_params(job, gather_params(params, cfg.model), held_out)


def evaluate_params(job: Job, params: dict, problems) -> float:
    """Greedy held-out accuracy of arbitrary (canonical) parameters on the first actor-gen engine."""
    prompts = [[job.tok.bos_id] + job.tok.encode(p.prompt) for p in problems]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=job.R, stop_tokens=(job.tok.eos_id,))

    def run(actor_gen: Generator):
        gen = Generator(actor_gen.engine, actor_gen.engine.load_params(params), pad_id=job.tok.pad_id)
        return gen.generate(prompts, sampling)

    out = job._on_engines([(0, run)])[0]  # with several processes: on its owner, shared with every process
    texts = [job.tok.decode(out.tokens[i, : out.lengths[i]]) for i in range(len(problems))]
    return float(np.mean([job.task.reward(p, t) >= 1.0 for p, t in zip(problems, texts, strict=True)]))


__all__ = ["ConfigError", "check_inputs", "evaluate_params", "run_job"]
