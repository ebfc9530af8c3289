"""A whole run: check the inputs, warm-start the actor (cached), run the RL steps, evaluate, report.

    summary = run_job(load_config("ppo_tiny"), run_dir="runs/demo")

With the summary (summary.json) the run writes the cost model its controller calibrated, calibration.json
(``python -m nereus_jax.plan --calibration runs/demo`` plans with it).

Everything a user can get wrong (config, prompt file, tokenizer, checkpoint path, plan devices) is
checked before any compute, with an error naming the input and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator

import jax

from nereus_jax.config import Config, ConfigError
from nereus_jax.elastic.costs.calibration_file import FILENAME as CALIBRATION_FILE
from nereus_jax.elastic.costs.calibration_file import save_calibration
from nereus_jax.elastic.sources import ParamSource
from nereus_jax.engine import Generator, SamplingParams
from nereus_jax.models import init_params
from nereus_jax.models.lora import base_config
from nereus_jax.rl.tasks import PromptDataError, make_task
from nereus_jax.rl.tokenizer import TokenizerError
from nereus_jax.runtime.async_rl import AsyncRunner
from nereus_jax.runtime.control.adapt import Adapter
from nereus_jax.runtime.control.recovery import training_snapshot
from nereus_jax.runtime.durability.checkpoint import (
    Checkpointer,
    GracefulStop,
    checkpoint_dir,
    complete_steps,
    load_controller,
    restore_job,
    stop_agreed,
)
from nereus_jax.runtime.durability.export import export_actor
from nereus_jax.runtime.durability.warmstart import SFT_INDEX_OFFSET, cached_warm_start, run_sft
from nereus_jax.runtime.platform.device_memory import peak_rss_bytes
from nereus_jax.runtime.platform.distributed import is_primary
from nereus_jax.runtime.report import RunReport
from nereus_jax.runtime.step.initial_plan import AUTO_MICRO_BATCH_TOKENS, predicted_peak, with_micro_batch_tokens
from nereus_jax.runtime.step.job import DeviceLost, Job, JobError, NonFiniteTraining, StepResult, prompt_ids
from nereus_jax.sharding import Layout, make_mesh, shard_params


# jax 0.10.2 on CPU: a fresh 8-device SPMD program with all-reduces started after the RL steps never
# completes (two device threads never join the rendezvous; XLA aborts the process after 40 s). Seen only
# with the SFT control's program; not root-caused. jax 0.11+ is unaffected.
def _jax_cpu_collectives_hang() -> bool:
    return tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11) and jax.default_backend() == "cpu"


@dataclasses.dataclass
class Inputs:
    """Everything a run reads before any compute, checked: the task, the tokenizer, where the actor starts
    (None: random, then the warm start) and the reward."""

    task: object
    tokenizer: object
    actor: ParamSource | None
    rewarder: object
    dropped: int = 0  # prompts longer than rollout.max_prompt_length, dropped (task.overlong=drop)


def check_inputs(cfg: Config, log: Callable[[str], None] = print) -> Inputs:
    """The run's inputs, or a JobError / PromptDataError / ConfigError (one line naming the input and the
    fix) before anything is compiled or any run directory exists."""
    if cfg.checkpoint.resume_from and not os.path.exists(cfg.checkpoint.resume_from):
        raise JobError(f"checkpoint.resume_from={cfg.checkpoint.resume_from!r} does not exist: give the path of "
                       "a checkpoint folder, or drop the key to start fresh")
    n = len(jax.devices())
    if cfg.cluster.num_devices > n:
        raise JobError(f"cluster.num_devices={cfg.cluster.num_devices} but only {n} devices exist; lower it (on "
                       "CPU, XLA_FLAGS=--xla_force_host_platform_device_count must be set before JAX starts)")
    if cfg.trainer.mode == "async" and jax.process_count() > 1:
        raise JobError(f"trainer.mode=async runs in one process (its generator thread drives local engines); "
                       f"this launch has {jax.process_count()} processes: use trainer.mode=sync, or one process")
    from nereus_jax.rl.rewards import make_rewarder
    from nereus_jax.rl.tokenizer import load_tokenizer

    actor = _checkpoint("model.hf_path", cfg.model.hf_path)
    if cfg.model.lora_path:  # read and checked against the model now, not after compiling
        from nereus_jax.models.peft import AdapterError, read_adapter

        try:
            read_adapter(cfg.model.lora_path, cfg.model)
        except (AdapterError, OSError) as e:
            raise JobError(str(e) if isinstance(e, AdapterError) else f"model.lora_path={cfg.model.lora_path!r}: "
                           f"{e}") from None
    tok = load_tokenizer(cfg.task.tokenizer_path, cfg.model.hf_path)
    _check_chat_template(tok)
    _check_vocabularies(cfg, tok)
    _check_layouts(cfg)
    _check_memory(cfg)
    if cfg.task.env is not None:  # the environment builds (its class imports), before anything compiles
        from nereus_jax.rl.env import EnvError
        from nereus_jax.runtime.step.agent import make_agent_env

        try:
            make_agent_env(cfg, tok)
        except EnvError as e:
            raise JobError(str(e)) from None
    task = make_task(cfg.task, seed=cfg.trainer.seed)
    dropped = _check_prompt_lengths(cfg, task, tok, log)
    rewarder = make_rewarder(cfg.task, task, log=log)
    return Inputs(task, tok, actor, rewarder, dropped)


def _checkpoint(key: str, path: str | None):
    """The Hugging Face checkpoint at ``path`` opened (headers read and checked, no tensor data), or None."""
    if path is None:
        return None
    from nereus_jax.models.hf import HFCheckpoint

    try:
        return HFCheckpoint(path)
    except (OSError, ValueError) as e:
        raise JobError(f"{key}={path!r}: {e}") from None


def _check_chat_template(tok) -> None:
    """A chat template that does not compile is the tokenizer's error, not the first prompt's."""
    if getattr(tok, "chat_template", None) is not None:
        from nereus_jax.rl.chat import compile_template

        compile_template(tok.chat_template, tok.template_origin)


def _check_vocabularies(cfg: Config, tok) -> None:
    """Every model reads the tokenizer's ids: each vocabulary must cover them (an id out of range would be
    looked up as NaN and poison every score)."""
    models = [("model.vocab_size", cfg.model.vocab_size)]
    rm = cfg.task.reward_model_path
    if rm:
        if not os.path.isdir(rm):
            raise JobError(f"task.reward_model_path={rm!r} is not a folder: give a local Hugging Face "
                           "*ForSequenceClassification checkpoint (config.json + safetensors)")
        from nereus_jax.hf_config import HFImportError, read_hf_config

        try:
            models.append((f"the reward model's vocab_size (task.reward_model_path={rm!r})",
                           int(read_hf_config(rm).get("vocab_size", 0))))
        except HFImportError as e:
            raise JobError(f"task.reward_model_path={rm!r}: {e}") from None
    for name, size in models:
        if tok.vocab_size > size:
            raise JobError(f"the tokenizer has {tok.vocab_size} tokens but {name} is {size}: every model must "
                           "cover the tokenizer's ids; use the tokenizer the model was trained with")


def _check_memory(cfg: Config) -> None:
    """The starting plan's predicted peak per device (the memory model the planner uses, on the configured
    worst case) fits the usable memory: a plan that does not is refused here, not found out by an
    out-of-memory kill mid-step."""
    cfg = with_micro_batch_tokens(cfg)
    try:
        peak, usable = predicted_peak(cfg)
    except ValueError:  # a dp that cannot split a batch: the job refuses it before any compile, naming the fix
        return
    if peak <= usable:
        return
    gib = 2.0**30
    raise JobError(
        f"the starting plan needs an estimated {peak / gib:.2f} GiB per device, but {usable / gib:.2f} GiB are usable "
        f"(cluster.device_memory_bytes, else the {cfg.controller.hardware or cfg.cluster.hardware} table's memory, "
        f"less controller.memory_headroom={cfg.controller.memory_headroom}): lower trainer.micro_batch_tokens "
        f"(now {cfg.trainer.micro_batch_tokens}) or trainer.vocab_chunk ({cfg.trainer.vocab_chunk}), raise tp "
        "(plan.default.tp or plan.stages.<stage>.tp), set model.remat=true, or give the job more devices")


def _check_layouts(cfg: Config) -> None:
    """Every model-stage's configured layout splits its model: a tp or pp that cannot divide a dimension is
    a ConfigError naming the plan key and the model-stage, before the warm start or any compile."""
    from nereus_jax.model_stage import REWARD_INFER
    from nereus_jax.runtime.step.initial_plan import job_stages
    from nereus_jax.sharding import Layout, LayoutError, check_layout

    for ms in job_stages(cfg):
        model, head, labels = cfg.model, "value" if ms.role == "critic" else "lm", 1
        if ms == REWARD_INFER:
            rm = _checkpoint("task.reward_model_path", cfg.task.reward_model_path)
            model, head, labels = rm.config, rm.head, rm.num_labels
        lc = cfg.plan.layout_for(str(ms))
        key = f"plan.stages.{ms}" if str(ms) in cfg.plan.stages else "plan.default"
        for axis, layout in (("tp", Layout(tp=lc.tp)), ("pp", Layout(tp=lc.tp, pp=lc.pp)),
                             ("ep", Layout(tp=lc.tp, pp=lc.pp, ep=lc.ep))):
            try:
                check_layout(model, layout, kind=ms.kind, head=head, num_labels=labels)
            except LayoutError as e:
                raise ConfigError(f"{key}.{axis}={getattr(lc, axis)} cannot lay out model-stage {ms}: {e}") from None


def _check_prompt_lengths(cfg: Config, task, tok, log: Callable[[str], None]) -> int:
    """Prompts longer than rollout.max_prompt_length tokens (with the chat template and bos): dropped and
    counted from a prompt file with ``task.overlong=drop``, else an error naming the prompt. Built-in tasks
    are checked on the held-out set and the first batch (their lengths do not vary beyond that)."""
    limit = cfg.rollout.max_prompt_length

    def fits(p) -> bool:
        try:
            length = len(prompt_ids(tok, cfg.task, p))
        except TokenizerError as e:  # a character the tokenizer lacks, a template that fails: name the row
            raise TokenizerError(f"{p.source}: {e}" if p.source else str(e)) from None
        if length > limit and cfg.task.overlong == "error":
            where = f"{p.source}: " if p.source else ""
            raise PromptDataError(f"{where}prompt {str(p.prompt)[:40]!r} has {length} tokens (with the chat template "
                                  f"and bos), more than rollout.max_prompt_length={limit}: raise it, shorten the "
                                  "prompt, or set task.overlong=drop")
        return length <= limit

    if hasattr(task, "drop_prompts"):
        dropped = task.drop_prompts(fits)
        if dropped:
            log(f"dropped {len(dropped)} prompts longer than rollout.max_prompt_length={limit} tokens (first: "
                f"{dropped[0].source or repr(dropped[0].prompt)[:60]}); raise it to keep them, or set "
                "task.overlong=error to stop instead")
        return len(dropped)
    for p in task.eval_problems() + [task.problem(i) for i in range(cfg.trainer.prompts_per_step)]:
        if not fits(p):
            raise PromptDataError(f"prompt {str(p.prompt)[:40]!r} has {len(prompt_ids(tok, cfg.task, p))} tokens "
                                  f"(with bos), more than rollout.max_prompt_length={limit}: raise it or shorten "
                                  "the prompts")
    return 0


def run_job(cfg: Config, run_dir: str, *, started: float | None = None) -> dict:
    started = time.perf_counter() if started is None else started
    auto = cfg.trainer.micro_batch_tokens is None
    cfg = with_micro_batch_tokens(cfg)
    opts = cfg.logging
    wandb = dict(project=opts.wandb_project, mode=opts.wandb_mode, config=cfg.to_dict()) if opts.wandb else None
    report = RunReport(run_dir, cfg.trainer.steps, progress=opts.progress, tensorboard=opts.tensorboard, wandb=wandb,
                       primary=is_primary())
    inputs = check_inputs(cfg, log=report.log)
    if auto:
        report.log(f"trainer.micro_batch_tokens: {cfg.trainer.micro_batch_tokens} (chosen: the largest of "
                   f"{AUTO_MICRO_BATCH_TOKENS}, {AUTO_MICRO_BATCH_TOKENS // 2}, ... whose predicted peak fits)")
    try:
        return _run(cfg, run_dir, inputs, report, started)
    finally:
        inputs.rewarder.close()


def _run(cfg: Config, run_dir: str, inputs: Inputs, report: RunReport, started: float) -> dict:
    task, tok = inputs.task, inputs.tokenizer
    cache_dir = cfg.logging.cache_dir or os.path.join(os.path.dirname(os.path.abspath(run_dir)), "cache")
    resume = cfg.checkpoint.resume_from
    if inputs.actor is not None:
        if cfg.trainer.warmup_sft_steps and not resume:
            report.log("model.hf_path is given: the supervised warm start (for the random tiny model) is skipped")
        warm, hit, sft_s = inputs.actor, False, 0.0
    else:
        warm, hit, sft_s = (None, False, 0.0) if resume else warm_start(cfg, task, tok, cache_dir, report)
    job, first, meta = _start_job(cfg, inputs, warm, report)
    report.open()  # the inputs are checked and the job is built: only now does the run directory appear
    report.log(f"plan:\n{job.plan}")
    held_out = task.eval_problems()
    samples = cfg.task.eval_samples
    before = job.evaluate(held_out, samples)
    report.log(f"held-out before RL: {_scores_text(before, samples)}")
    adapter = Adapter(job, log=report.log)
    if meta is not None and not load_controller(adapter, job, meta):
        report.log("the controller starts afresh (the checkpoint was written on another device count)")
    ckpt = Checkpointer(checkpoint_dir(cfg, run_dir), every_steps=cfg.checkpoint.every_steps,
                        keep=cfg.checkpoint.keep, export_hf=cfg.checkpoint.export_hf)
    rl_start, tokens, step_s, stopped, over_cap, diverged = time.perf_counter(), 0, 0.0, None, 0, None
    with GracefulStop() as stop:
        try:
            for result in rl_steps(job, adapter, cfg.trainer.steps, first=first, checkpointer=ckpt):
                metrics = result.metrics
                tokens, step_s = tokens + metrics["response_tokens"], step_s + metrics["step_seconds"]
                over_cap += metrics.get("over_memory_cap", False)
                report.step(metrics)
                stopped = _after_step(cfg, job, adapter, ckpt, stop, metrics["step"] + 1)
                if stopped is not None:
                    break
        except NonFiniteTraining as e:
            diverged = e
        finally:
            adapter.close()
            ckpt.close()  # waits for the save in flight: the checkpoints listed below are complete
    if diverged is not None:
        where = _resume_point(ckpt.directory, diverged.first_step, meta)
        raise NonFiniteTraining(f"{diverged}. {_resume_advice(ckpt.directory, diverged.first_step, where)}",
                                diverged.first_step) from None
    rl_s = time.perf_counter() - rl_start
    if stopped is not None:
        return _stopped(cfg, job, adapter, report, ckpt.directory, stopped, started, meta)
    after = job.evaluate(held_out, samples)
    report.log(f"held-out after {cfg.trainer.steps} RL steps: {_scores_text(after, samples)}")
    exported = export_actor(job, os.path.join(run_dir, "hf"), os.path.join(run_dir, "adapter"))
    report.log(f"the tuned actor is a Hugging Face checkpoint: {exported}")
    if cfg.model.lora_rank and exported is not None:
        report.log(f"its LoRA adapters alone are a PEFT adapter: {os.path.join(run_dir, 'adapter')}")
    control = None
    if cfg.trainer.warmup_sft_steps and cfg.trainer.sft_control and warm is not None and inputs.actor is None:
        if _jax_cpu_collectives_hang():
            report.log("SFT control skipped: on jax < 0.11 (CPU) its 8-device all-reduce deadlocks after the RL "
                        "steps (XLA rendezvous timeout); accuracy_sft_control is null")
        else:
            control = _sft_control(cfg, task, tok, job, warm, rl_s, held_out)
    summary = {"algorithm": cfg.algorithm.name, "model": cfg.model.name, "task": cfg.task.name,
               "model_source": cfg.model.hf_path or cfg.model.name,
               "accuracy_before": before["pass_at_1"], "accuracy_after": after["pass_at_1"],
               "eval_samples": samples, "eval_prompts": len(held_out),
               **({"pass_at_k_before": before["pass_at_k"], "pass_at_k_after": after["pass_at_k"]}
                  if samples > 1 else {}),
               "accuracy_sft_control": control, "prompts_dropped_overlong": inputs.dropped,
               "steps": cfg.trainer.steps, "transitions": adapter.transitions,
               # steps that ended with a device holding more than cluster.device_memory_bytes (a GPU would
               # have run out of memory there)
               "oom_events": over_cap,
               "controller_events": adapter.events, "tokens_per_s": tokens / max(step_s, 1e-9),
               "rl_seconds": rl_s, "warm_start_seconds": sft_s, "warm_start_cache_hit": hit,
               "hf_export": str(exported) if exported else None,
               "plan": repr(job.plan), "peak_rss_bytes": peak_rss_bytes(), "wall_s": time.perf_counter() - started}
    _save_calibration(cfg, adapter, report, cfg.trainer.steps)
    report.finish(summary)
    job.close()
    return summary


def _save_calibration(cfg: Config, adapter: Adapter, report: RunReport, steps: int) -> None:
    """RUN_DIR/calibration.json (primary process): the controller's calibrated cost model after ``steps`` steps,
    replaced atomically (a killed run leaves the previous file or this one)."""
    if report.primary:
        report.open()
        save_calibration(os.path.join(report.run_dir, CALIBRATION_FILE), adapter.pricer.cost, steps=steps,
                         model=cfg.model.name)


def _scores_text(scores: dict[str, float], samples: int) -> str:
    text = f"greedy pass@1 {scores['pass_at_1']:.3f}"
    return text + (f", pass@{samples} {scores['pass_at_k']:.3f}" if samples > 1 else "")


def _start_job(cfg: Config, inputs: Inputs, warm, report: RunReport) -> tuple[Job, int, dict | None]:
    """(job, first step, checkpoint metadata): from checkpoint.resume_from, laid out in the plan for the
    devices present now, else a fresh job from the checkpoint or the warm-started actor."""
    task, tok = inputs.task, inputs.tokenizer
    if not cfg.checkpoint.resume_from:
        return Job(cfg, task, tok, actor=warm, rewarder=inputs.rewarder), 0, None
    job, meta = restore_job(cfg, task, tok, cfg.checkpoint.resume_from, rewarder=inputs.rewarder, log=report.log)
    report.log(f"resumed from {meta['_step_dir']} at step {meta['step']} (written on {meta['num_devices']} "
               f"devices, now {len(job.devices)})")
    return job, meta["step"], meta


def _after_step(cfg: Config, job: Job, adapter: Adapter, ckpt: Checkpointer, stop: GracefulStop, done: int):
    """Periodic and end-of-run checkpoints (with the controller's state); after SIGTERM / SIGINT (on any
    process) a save, and (signal name, step to resume at) to stop the loop. No checkpoint is written while
    the learner is in a streak of non-finite steps (``job.nonfinite``): its weights are the ones the streak
    started from, and resuming from them would run into it again."""
    stopping = done < cfg.trainer.steps and stop_agreed(stop)  # every process asks every step (a collective)
    final = done == cfg.trainer.steps and cfg.checkpoint.every_steps > 0
    saving = ckpt.due(done) or final or stopping
    if saving and job.nonfinite:
        adapter.log(f"step {done - 1} was non-finite ({job.nonfinite} in a row since step {job.nonfinite_since}): "
                    "no checkpoint is written until a step is finite again")
    elif saving:  # the controller's state is read only for a save
        controller = adapter.state_dict()
        ckpt.maybe_save(job, done, controller=controller)
        if final or stopping:
            ckpt.save(job, done, controller=controller)  # a no-op when the periodic save took this step
    return (stop.signal or "a signal to another process", done, job.nonfinite_since) if stopping else None


def _resume_point(directory: str, first_step: int, meta: dict | None) -> tuple[str, int] | None:
    """The checkpoint to resume from after a non-finite streak that began at ``first_step``: the newest
    written before the update of step ``first_step - 1`` (that update gave the weights the streak started
    from; huge but finite ones pass every check and overflow in the next forward), i.e. of a step number
    below ``first_step``: the step it resumes at ran finite. Looked for under ``directory`` and at the
    checkpoint this run resumed from (``meta``); None when none exists."""
    found = [(os.path.join(directory, str(s)), s) for s in complete_steps(directory) if s < first_step]
    if meta is not None and meta["step"] < first_step:
        found.append((meta["_step_dir"], meta["step"]))
    return max(found, key=lambda f: f[1]) if found else None


def _resume_advice(directory: str, first_step: int, where: tuple[str, int] | None) -> str:
    if where is not None:
        return (f"Resume from the newest checkpoint written before step {first_step - 1}'s update (which gave the "
                f"weights the streak started from): checkpoint.resume_from={where[0]}")
    if first_step == 0:
        return "The streak began at the run's first step, so no checkpoint precedes it: start afresh"
    newer = [s for s in complete_steps(directory) if s >= first_step]
    held = f" ({directory}/{newer[0]} holds the weights the streak started from)" if newer else ""
    return (f"No checkpoint written before step {first_step - 1}'s update exists{held}: start afresh "
            "(checkpoint.every_steps and checkpoint.keep decide which checkpoints exist)")


def _stopped(cfg: Config, job: Job, adapter: Adapter, report: RunReport, directory: str, stopped,
             started: float, meta: dict | None) -> dict:
    """The summary of a run that a signal stopped after saving (no final evaluation); stopped during a
    non-finite streak, it saved nothing and names the checkpoint to resume from (:func:`_resume_point`)."""
    name, step, streak = stopped
    resume_from, resume_step = directory, step
    if streak is None:
        report.log(f"stopped by {name} after step {step - 1}; saved {directory}/{step}. Resume: the same command "
                   f"with checkpoint.resume_from={directory}")
    else:
        where = _resume_point(directory, streak, meta)
        resume_from, resume_step = where if where is not None else (None, None)
        report.log(f"stopped by {name} after step {step - 1}, unsaved: steps {streak}..{step - 1} were non-finite. "
                   f"{_resume_advice(directory, streak, where)}")
    summary = {"algorithm": cfg.algorithm.name, "model": cfg.model.name, "task": cfg.task.name,
               "steps": cfg.trainer.steps, "stopped_by": name, "stopped_after": step - 1, "resume_step": resume_step,
               "resume_from": resume_from, "plan": repr(job.plan), "wall_s": time.perf_counter() - started}
    _save_calibration(cfg, adapter, report, step)
    report.finish(summary)
    return summary


def rl_steps(job: Job, adapter: Adapter, steps: int, first: int = 0,
             checkpointer: Checkpointer | None = None) -> Iterator[StepResult]:
    """The learner's updates in order: sync steps with the controller asked at every boundary, or (
    ``trainer.mode=async``) the asynchronous runner, which asks it at weight syncs.

    Sync mode survives devices lost during a step (:class:`DeviceLost`; ``cluster.schedule`` ``fail``
    injects one) through ``Adapter.lose``: the job moves onto the surviving units when every model-stage
    kept a complete copy of its state as of the step's start (to the controller's urgent target, the plan
    a device leaving with notice gets), otherwise it is restored from ``checkpointer``'s last checkpoint
    (a save still being written is waited for: it holds the state as of this step's start); the step (or
    the steps since the checkpoint) is redone. Either way ``job`` itself is recovered (never replaced)."""
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
            rec = adapter.lose(lost.device_ids, step, before,
                               checkpointer.directory if checkpointer is not None else None)
            adapter.log(f"step {step}: {rec.describe()}")
            metrics, step = None, rec.next_step
            continue
        result.metrics["boundary_seconds"] = boundary_s
        metrics = result.metrics
        yield result
        step += 1


def warm_start(cfg: Config, task, tok, cache_dir: str, report: RunReport):
    """The actor's starting parameters as host arrays, whether they came from the cache, and the seconds it
    took: initialised from ``trainer.seed``, then, with ``trainer.warmup_sft_steps``, trained by the supervised
    warm start (cached under ``cache_dir``). With LoRA the warm start trains the base in full (it stands in
    for a pretrained checkpoint); the job then adds fresh adapters to it."""
    cfg = _without_adapters(cfg)
    params = init_params(cfg.model, seed=cfg.trainer.seed)
    if not cfg.trainer.warmup_sft_steps:
        return params, False, 0.0
    t = time.perf_counter()
    mesh, sharded = sft_mesh(cfg, params)
    target = cfg.trainer.warmup_target_accuracy
    until = f", stopping at validation accuracy {target}" if target else ""
    report.log(f"warm start: up to {cfg.trainer.warmup_sft_steps} supervised steps{until} (cache: {cache_dir})")
    trained, hit = cached_warm_start(sharded, cfg, task, tok, mesh, cache_dir)
    from nereus_jax.sharding import gather_params

    host = gather_params(trained, cfg.model)
    seconds = time.perf_counter() - t
    report.log(f"warm start {'loaded from cache' if hit else 'trained'} in {seconds:.1f} s")
    return host, hit, seconds


def sft_mesh(cfg: Config, params: dict):
    """Supervised steps data-parallel over the devices that divide the SFT batch."""
    n = cfg.cluster.num_devices
    dp = max(d for d in range(1, n + 1) if n % d == 0 and cfg.trainer.sft_batch % d == 0)
    mesh = make_mesh(jax.devices()[:dp], Layout(), dp=dp)
    return mesh, shard_params(params, cfg.model, Layout(), mesh)


def _sft_control(cfg: Config, task, tok, job: Job, warm: dict, seconds: float, held_out) -> float:
    """What continuing the supervised phase for the RL phase's wall time reaches (information only; with LoRA,
    the supervised phase trains the whole base, as the warm start did)."""
    cfg = _without_adapters(cfg)
    mesh, sharded = sft_mesh(cfg, warm)
    params = run_sft(sharded, cfg, task, tok, mesh, max_seconds=seconds,
                     first_index=SFT_INDEX_OFFSET + cfg.trainer.warmup_sft_steps * cfg.trainer.sft_batch)
    from nereus_jax.sharding import gather_params

    return evaluate_params(job, gather_params(params, cfg.model), held_out)


def _without_adapters(cfg: Config) -> Config:
    return dataclasses.replace(cfg, model=base_config(cfg.model)) if cfg.model.lora_rank else cfg


def evaluate_params(job: Job, params: dict, problems) -> float:
    """Greedy held-out accuracy of arbitrary (canonical) parameters on the first actor-gen engine."""
    prompts = [job.prompt_ids(p) for p in problems]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=job.R, stop_tokens=tuple(job.tok.eos_ids))

    def run(actor_gen: Generator):
        gen = Generator(actor_gen.engine, actor_gen.engine.load_params(params), pad_id=job.tok.pad_id)
        return gen.rollouts(prompts, sampling)

    out = job.rollout.on_engines([(0, run)])[0]  # with several processes: on its owner, shared with every process
    texts = [job.tok.decode(out.tokens[i, : out.lengths[i]]) for i in range(len(problems))]
    return float(job.rewarder.score(list(problems), texts).correct.mean())


__all__ = ["ConfigError", "check_inputs", "evaluate_params", "run_job"]
