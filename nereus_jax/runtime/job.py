"""The RL job: PPO / GRPO / RLOO / ReMax / DAPO / Dr.GRPO / GSPO over model-stages placed by an execution plan.

One synchronous step, as data flows (nereus_jax.rl.batch fixes the sequence layout)::

    prompts (data positions step*B .. step*B+B-1)
      -> actor-gen: the inference engine on every actor-gen replica (continuous batching, n samples)
      -> reward (verifiable, on the host) + actor-infer / ref-infer / critic-infer (jitted, data-parallel)
      -> advantages (the algorithm's estimator), corrected for the rollout/train mismatch and staleness
      -> actor-train / critic-train (one SPMD program over each stage's replicas: mini-batches x epochs
         optimizer updates, token-budget micro-batches inside each mini-batch)
      -> weight sync actor-train -> actor-gen through the elastic executor

Off-policy corrections, in this order (``Job.learn``; one weight per token, never a product of two):

    1. trainer.stale_rollouts=drop: rows staler than trainer.max_staleness are masked out (async)
    2. r = pi_old / pi_behaviour per token: actor-infer's log-probs over the engine's (for a stale row r holds
       the policy lag and the numerics together, for a fresh row the numerics only)
    3. algorithm.rollout_correction on every row: tis -> min(r, correction_clip); icepop -> r inside
       [correction_low, correction_clip], 0 outside (masked); none -> 1
    4. trainer.stale_rollouts=reweight on stale rows: min(r, trainer.importance_clip) instead of 3's weight
       (icepop's masked tokens stay masked)
    5. the weight scales the advantages; PPO's ratio pi / pi_old is then clipped as usual (decoupled PPO)

Randomness is keyed by (seed, data position, sample, token index) inside the engine, never by device,
replica or slot, so the plan changes how fast a step runs, not what it computes (up to float order).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nereus_jax.config import Config, ConfigError, stage_at
from nereus_jax.elastic.costs import pipeline_microbatches
from nereus_jax.elastic.emu import EMU, assemble_replicas, split_replicas
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import DEVICE, HOST, ExecutionPlan, ModelStage
from nereus_jax.elastic.sources import HostSource, ParamSource, ValueHeadSource, units_from_source
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.elastic.weight_sync import WeightSync
from nereus_jax.engine import Generator, JaxEngine, Rollouts, SamplingParams
from nereus_jax.models import abstract_params, forward, init_params
from nereus_jax.rl import algorithms as alg
from nereus_jax.rl import packing
from nereus_jax.rl.batch import RolloutBatch, left_pad, right_pad
from nereus_jax.rl.tasks import Problem, make_task
from nereus_jax.runtime import steps
from nereus_jax.runtime.distributed import share_from
from nereus_jax.runtime.move import move
from nereus_jax.runtime.plans import (
    ACTOR_GEN,
    ACTOR_TRAIN,
    CRITIC_TRAIN,
    REF_INFER,
    REWARD_INFER,
    job_stages,
    plan_from_config,
)
from nereus_jax.sharding import device_index, is_local, make_mesh, to_numpy, tree_to_numpy
from nereus_jax.sharding.pipeline import check_schedule, pipeline_axis, pipeline_forward_fn

# dynamic sampling's extra prompts: a part of the data stream steps never reach, whose sampling keys
# (position mod 2**31) start at 2**30, away from the steps' own
EXTRA_INDEX_OFFSET = (1 << 42) + (1 << 30)


class JobError(ValueError):
    """A job that cannot start: the message names the input and the fix. Raised before any compute."""


@dataclasses.dataclass
class Prepared:
    """What :meth:`Job.prepare` built for a target plan: compiled programs and warmed engines (None: the
    target keeps actor-gen's devices and layout, so the current engines serve it)."""

    plan: ExecutionPlan
    programs: dict[Any, Any]
    engines: list[Generator | None] | None
    seconds: float


class NonFiniteTraining(JobError):
    """Training stopped: a model-stage's updates were non-finite ``trainer.max_nonfinite_steps`` times in a
    row (each was skipped, so the state and its checkpoints stay finite)."""


class DeviceLost(RuntimeError):
    """Devices (plan ids: positions in ``jax.devices()``) that stopped working during a step; raised by the
    runtime (or by an injected fault, :meth:`Job.inject_device_loss`)."""

    def __init__(self, device_ids: Sequence[int], message: str = ""):
        self.device_ids = tuple(sorted(int(d) for d in device_ids))
        super().__init__(message or f"devices {list(self.device_ids)} were lost")


@dataclasses.dataclass
class StepResult:
    metrics: dict[str, Any]
    batch: RolloutBatch


class Job:
    """Holds every model-stage's units (EMUs), the engines of actor-gen, and the data position."""

    def __init__(self, cfg: Config, task, tokenizer, *, actor: ParamSource | dict | None = None,
                 plan: ExecutionPlan | None = None, devices: Sequence[jax.Device] | None = None, rewarder=None):
        """``actor``: where actor-train, actor-gen, ref-infer (and the critic's trunk) start from: a parameter
        source (a Hugging Face checkpoint, read slice by slice into each stage's shardings), a canonical host
        tree, or None for random weights. ``rewarder``: the task's reward (default: built from the config;
        the job does not close one it was given)."""
        self.cfg, self.task, self.tok = cfg, task, tokenizer
        self.algo = alg.algorithm_spec(cfg.algorithm.name)
        self.settings = alg.settings(cfg.algorithm, cfg.rollout.max_response_length)
        self.devices = list(devices or jax.devices()[: cfg.cluster.num_devices])
        if len(self.devices) < cfg.cluster.num_devices:
            raise JobError(f"cluster.num_devices={cfg.cluster.num_devices} but only {len(self.devices)} devices "
                           "exist; lower cluster.num_devices")
        self.plan = plan or plan_from_config(cfg)
        _check_plan_devices(self.plan, len(self.devices))
        self.P, self.R = cfg.rollout.max_prompt_length, cfg.rollout.max_response_length
        self.n = cfg.rollout.samples_per_prompt
        self.rows = cfg.trainer.prompts_per_step * self.n
        self.mini_rows = self.rows // cfg.trainer.mini_batches  # rows of one optimizer update
        _check_rows(self.plan, self.rows, self.mini_rows)
        self.specs = _specs(cfg, self.algo.uses_critic)
        self.reward_model = _reward_model(cfg, self.specs) if cfg.task.reward_model_path else None
        self._own_rewarder = rewarder is None
        if rewarder is None:
            from nereus_jax.rl.rewards import make_rewarder

            rewarder = make_rewarder(cfg.task, task)
        self.rewarder = rewarder
        self.version = 0
        self.updates: dict[ModelStage, int] = {}  # successful training updates per model-stage (this Job)
        self._staged_tasks: dict[int, Any] = {}  # task.schedule: the task of each num_digits, made on first use
        self.packing_fill: float | None = None  # with trainer.packing: the last packed stage's real tokens / slots
        self.nonfinite: dict[ModelStage, int] = {}  # consecutive skipped (non-finite) updates per stage
        self.skipped: dict[ModelStage, int] = {}  # skipped updates per stage in all
        if actor is None:
            actor = init_params(cfg.model, seed=cfg.trainer.seed)
        self.units = self._initial_units(actor if hasattr(actor, "read") else HostSource(actor))
        self.sync = WeightSync(self.plan, self.specs[ACTOR_TRAIN], self.specs[ACTOR_GEN],
                               caps=cfg.cluster.device_memory_bytes)
        self._programs: dict[Any, Any] = {}
        self._signatures: dict[Any, dict[str, tuple]] = {}  # program -> its host inputs' (shape, dtype)
        # one per actor-gen replica; None for a replica on another process's devices (its process runs it)
        self._engines: list[Generator | None] = [self._engine(u) for u in self.units[ACTOR_GEN]]
        self._engine_pool: concurrent.futures.ThreadPoolExecutor | None = None  # see _run_local
        self._engine_pool_size = 0
        self.engine_thread_cpu_s = 0.0  # CPU seconds of the engine threads so far (Python and dispatch)
        self._fault: tuple[int, ...] = ()  # devices an injected fault loses in the next step

    # ------------------------------------------------------------------------------- construction
    def _initial_units(self, actor: ParamSource) -> dict[ModelStage, list[EMU]]:
        """Every model-stage laid out in its plan straight from its source (each device reads its shard)."""
        sources = {ACTOR_TRAIN: actor, ACTOR_GEN: actor, REF_INFER: actor}
        if self.algo.uses_critic:
            sources[CRITIC_TRAIN] = _critic_source(self.cfg, actor)
        if self.reward_model is not None:
            sources[REWARD_INFER] = self.reward_model
        units = {}
        for ms in job_stages(self.cfg):
            sp = self.plan[ms]
            replicas = [[self.devices[i] for i in r] for r in sp.replicas]
            units[ms] = units_from_source(ms, self.specs[ms], sp.layout, replicas, sources[ms])
        return units

    def close(self) -> None:
        """Releases the engines' threads and the reward workers this job started."""
        if self._engine_pool is not None:
            self._engine_pool.shutdown(wait=False)
            self._engine_pool = None
        if self._own_rewarder:
            self.rewarder.close()

    def _engine(self, unit: EMU) -> Generator | None:
        if not is_local(unit.devices[0]):
            return None
        engine = self._new_engine(unit.mesh)
        return Generator(engine, engine.adopt_params(unit.params), version=self.version, pad_id=self.tok.pad_id)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """A problem's prompt as the model sees it (see :func:`prompt_ids`)."""
        return prompt_ids(self.tok, self.cfg.task, problem)

    def _new_engine(self, mesh) -> JaxEngine:
        cfg = self.cfg
        return JaxEngine(cfg.model, mesh, max_concurrent_decodes=max(1, cfg.rollout.max_concurrent_decodes),
                         max_prefill_length=self.P, max_target_length=self.P + self.R,
                         page_size=cfg.rollout.page_size, kv_bytes=cfg.rollout.kv_cache_bytes,
                         decode_steps_per_call=cfg.rollout.decode_steps_per_call,
                         max_prefill_batch=min(16, max(1, cfg.trainer.prompts_per_step)),
                         max_stop_tokens=max(4, len(self.tok.eos_ids)))

    # ------------------------------------------------------------------------------ plan changes
    def prepare(self, plan: ExecutionPlan) -> Prepared:
        """Everything ``plan`` needs compiled, built without touching the current state: the training and
        scoring programs lowered and compiled for the target shardings (ahead of time, from the input
        signatures of the steps run so far) and actor-gen engines on the target meshes, warmed by a
        generation from zero weights. Safe on a background thread while the current plan keeps stepping."""
        t = time.perf_counter()
        _check_plan_devices(plan, len(self.devices))
        _check_rows(plan, self.rows, self.mini_rows)
        programs = {}
        for (kind, ms, *rest), signature in list(self._signatures.items()):
            if ms not in plan or (ms in self.plan and plan[ms] == self.plan[ms]):
                continue  # same devices and layout: the current programs run as they are
            mesh = _plan_mesh(plan[ms], self.devices)
            accum = self._accum(kind, plan[ms].dp)
            mini = self.cfg.trainer.mini_batches if kind == "train" else None
            micro = _abstract_micro(signature, accum, mesh, mini)
            spec = self.specs[ms]
            leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                      for a, sh in zip(spec.abstract(plan[ms].layout), spec.shardings(mesh), strict=True)]
            if kind == "train":
                fn = self._train_program(ms, spec, mesh)
                programs[self._key("train", ms, mesh, accum)] = fn.lower(leaves, micro).compile()
            else:
                fn = _infer_program(spec.model, self.P, rest[0], stage_forward(mesh, spec.kind))
                params = spec.unflatten(leaves)["params"]
                programs[self._key("infer", ms, mesh, accum, rest[0])] = fn.lower(params, micro).compile()
        if plan[ACTOR_GEN] == self.plan[ACTOR_GEN]:  # None: the engines stay (adopt() loads the moved parameters)
            return Prepared(plan, programs, None, time.perf_counter() - t)
        engines = []
        for replica in plan[ACTOR_GEN].replicas:
            if not is_local(self.devices[replica[0]]):
                engines.append(None)  # another process's replica: that process prepares it
                continue
            mesh = make_mesh([self.devices[i] for i in replica], plan[ACTOR_GEN].layout)
            engine = self._new_engine(mesh)
            gen = Generator(engine, engine.load_params(_zeros(self.cfg.model)), pad_id=self.tok.pad_id)
            problems, positions = self.problems(0)
            share = -(-len(problems) // len(plan[ACTOR_GEN].replicas))
            prompts = [self.prompt_ids(p) for p in problems[:share]]
            gen.generate(prompts, self._sampling(self.cfg.rollout.temperature, self.n),
                         prompt_ids=positions[:share] % (2**31))
            engines.append(gen)
        return Prepared(plan, programs, engines, time.perf_counter() - t)

    def check_plan(self, plan: ExecutionPlan) -> WeightSync:
        """Raises (JobError naming the fix, or the weight sync's Infeasible) unless the job can run ``plan``:
        it places the job's model-stages on devices that exist, an engine's replica stays in one process and
        has pp=1, every scoring and training stage's dp divides the rollouts of a step (a training stage's, a
        mini-batch's), the weight sync fits the caps.
        Returns that weight sync. Nothing changes, so a move checks its target before any state moves."""
        _check_plan_devices(plan, len(self.devices))
        _check_rows(plan, self.rows, self.mini_rows)
        if set(plan) != set(self.plan):
            raise JobError(f"the plan holds model-stages {sorted(map(str, plan))}, the job runs "
                           f"{sorted(map(str, self.plan))}: a plan for this job places exactly its model-stages")
        if plan[ACTOR_GEN].layout.pp != 1:
            raise JobError(f"actor-gen's layout {plan[ACTOR_GEN].layout} has pp={plan[ACTOR_GEN].layout.pp}: the "
                           "engines generate with pp=1; use tp for a larger actor-gen replica")
        return WeightSync(plan, self.specs[ACTOR_TRAIN], self.specs[ACTOR_GEN],
                          caps=self.cfg.cluster.device_memory_bytes)

    def adopt(self, plan: ExecutionPlan, units: dict[ModelStage, list[EMU]], prepared: Prepared | None = None, *,
              sync: WeightSync | None = None):
        """Switch to ``plan`` whose state is ``units`` (the executor's output): the weight sync (``sync``, from
        :meth:`check_plan`, or built here), the engines (``prepared``'s warmed ones, or new) and the compiled
        programs follow the plan. State moves go through :func:`nereus_jax.runtime.move.move`, which checks
        the plan before moving and adopts after."""
        sync = sync or self.check_plan(plan)
        same_engines = plan[ACTOR_GEN] == self.plan[ACTOR_GEN]
        self.plan, self.units, self.sync = plan, dict(units), sync
        if prepared is not None and prepared.plan == plan:
            self._programs.update(prepared.programs)
        if prepared is not None and prepared.plan == plan and prepared.engines is not None:
            self._engines = list(prepared.engines)
        elif not same_engines:
            self._engines = [self._engine(u) for u in self.units[ACTOR_GEN]]
            return
        self._set_engine_params()  # warmed engines, or the same ones: load the moved parameters

    def load_state(self, units: dict[ModelStage, list[EMU]], version: int) -> None:
        """Replaces the units (laid out in ``self.plan``) and the policy version, e.g. from a checkpoint;
        the engines adopt the actor-gen parameters."""
        if set(units) != set(self.units):
            raise JobError(f"load_state: model-stages {sorted(map(str, units))} differ from the job's "
                           f"{sorted(map(str, self.units))}")
        self.units, self.version = dict(units), version
        self._set_engine_params()

    def _set_engine_params(self) -> None:
        for gen, unit in zip(self._engines, self.units[ACTOR_GEN], strict=True):
            if gen is not None:
                gen.set_params(gen.engine.adopt_params(unit.params), version=self.version)

    # ----------------------------------------------------------------------------------- one step
    def problems(self, step: int) -> tuple[list[Problem], np.ndarray]:
        b = self.cfg.trainer.prompts_per_step
        positions = np.arange(step * b, (step + 1) * b, dtype=np.int64)
        task = self.task_at(step)
        return [task.problem(int(p)) for p in positions], positions

    def task_at(self, step: int):
        """The task step ``step`` draws from: ``task.schedule``'s stage then (its num_digits), else the job's."""
        stage = stage_at(self.cfg.task.schedule, step)
        if stage is None or stage.num_digits == getattr(self.task, "num_digits", None):
            return self.task
        if stage.num_digits not in self._staged_tasks:
            cfg = dataclasses.replace(self.cfg.task, num_digits=stage.num_digits, eval_size=0)
            self._staged_tasks[stage.num_digits] = make_task(cfg, seed=self.cfg.trainer.seed)
        return self._staged_tasks[stage.num_digits]

    def response_budget(self, step: int | None) -> int:
        """Step ``step``'s response budget: ``rollout.length_schedule``'s stage then, else (and for None)
        ``rollout.max_response_length``."""
        stage = None if step is None else stage_at(self.cfg.rollout.length_schedule, step)
        return self.R if stage is None else stage.max_response_length

    def step(self, step: int) -> StepResult:
        """One synchronous step: generate, score, train, weight sync."""
        problems, positions = self.problems(step)
        t = time.perf_counter()
        batch = self.generate(problems, positions, self.cfg.rollout.temperature, step=step)
        return self.learn(step, problems, batch, {"actor-gen": time.perf_counter() - t}, self._weight_sync)

    def inject_device_loss(self, devices: Sequence[int]) -> None:
        """Fault injection (``cluster.schedule`` ``fail``, tests, drills): the next step raises
        :class:`DeviceLost` for ``devices`` after its generation, before any state changes."""
        self._fault = tuple(devices)

    def learn(self, step: int, problems: Sequence[Problem], batch: RolloutBatch, seconds: dict[str, float],
              sync) -> StepResult:
        """Reward, score, train on ``batch`` (the rollouts of step ``step``), then ``sync()`` the weights.
        With dynamic sampling, prompts whose samples all score the same are replaced by newly generated ones
        first. Rows generated by an older policy than the learner's (async mode) are reweighted or dropped per
        ``trainer.stale_rollouts``, and every row is corrected for the rollout/train mismatch per
        ``algorithm.rollout_correction`` (the order: the module docstring)."""
        if self._fault:
            lost, self._fault = self._fault, ()
            raise DeviceLost(lost, f"devices {list(lost)} failed during step {step} (injected)")
        t = time.perf_counter()
        scores, reward_metrics = self.rewards(problems, batch)
        seconds["reward-infer" if self.reward_model is not None else "reward"] = time.perf_counter() - t
        sampled = {}
        if self.settings.dynamic_sampling:
            problems, batch, scores, sampled = self._dynamic_sampling(step, problems, batch, scores, seconds)
        staleness = self.version - batch.policy_version_b
        stale = {"rollout_staleness_max": int(staleness.max()), "rollouts_dropped": 0}
        if self.cfg.trainer.stale_rollouts == "drop" and (staleness > self.cfg.trainer.max_staleness).any():
            keep = (staleness <= self.cfg.trainer.max_staleness).astype(batch.response_mask_br.dtype)
            stale["rollouts_dropped"] = int((1 - keep).sum())
            batch = batch._replace(response_mask_br=batch.response_mask_br * keep[:, None])
        if self.settings.overlong_buffer:
            budget = self.response_budget(step)  # the buffer: overlong_buffer or its fraction of this budget
            buffer = alg.settings(self.cfg.algorithm, budget).overlong_buffer
            penalty = alg.overlong_penalty(batch.response_mask_br.sum(1), budget, buffer,
                                           self.cfg.algorithm.overlong_penalty)
            scores, sampled["overlong_penalty_mean"] = scores + penalty, float(penalty.mean())
        scored = self._score(batch, seconds)
        adv = self._advantages(step, batch, scores, scored)
        adv, corrected = self._correct(adv, batch, scored["old_logp"], staleness)
        train_metrics = self._train(batch, scored, adv, seconds)
        t = time.perf_counter()
        sync()
        seconds["weight-sync"] = time.perf_counter() - t
        metrics = self._metrics(step, batch, scores, scored, train_metrics, seconds) | reward_metrics
        metrics["accuracy"] = reward_metrics.get("answer_correct_fraction", metrics["accuracy"])
        return StepResult(metrics | stale | corrected | sampled, batch)

    def _dynamic_sampling(self, step: int, problems: Sequence[Problem], batch: RolloutBatch, scores: np.ndarray,
                          seconds: dict[str, float]):
        """DAPO's dynamic sampling: keep the prompts whose samples' rewards differ; while fewer than
        ``trainer.prompts_per_step`` are kept, generate another round of as many prompts, at most
        ``algorithm.dynamic_sampling_max_rounds`` rounds. Round r of step s reads data positions
        EXTRA_INDEX_OFFSET + (s * rounds + r - 1) * B + i: a function of the step, so a resumed run draws the
        same. The batch keeps its size: the first B kept prompts in round order, then (a batch still short
        after the cap) dropped prompts whose rows are masked out of the loss. The step's reward metrics stay
        those of its own prompts (round 0), comparable with every other algorithm's."""
        b, n, cap = self.cfg.trainer.prompts_per_step, self.n, self.cfg.algorithm.dynamic_sampling_max_rounds
        rounds = [(list(problems), batch, scores)]
        while sum(int(alg.informative_groups(sc, n).sum()) for *_, sc in rounds) < b and len(rounds) <= cap:
            positions = EXTRA_INDEX_OFFSET + (step * cap + len(rounds) - 1) * b + np.arange(b, dtype=np.int64)
            extra = [self.task_at(step).problem(int(p)) for p in positions]
            t = time.perf_counter()
            rollouts = self.generate(extra, positions, self.cfg.rollout.temperature, step=step)
            seconds["actor-gen"] = seconds.get("actor-gen", 0.0) + time.perf_counter() - t
            t = time.perf_counter()
            rounds.append((extra, rollouts, self.rewards(extra, rollouts)[0]))
            key = "reward-infer" if self.reward_model is not None else "reward"
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t
        groups = [p for ps, *_ in rounds for p in ps]
        whole = RolloutBatch(*(np.concatenate(parts) for parts in zip(*(r[1] for r in rounds), strict=True)))
        informative = np.concatenate([alg.informative_groups(sc, n) for *_, sc in rounds])
        order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])[:b]
        rows = (order[:, None] * n + np.arange(n)).reshape(-1)
        out = whole.select(rows)
        filler = np.repeat(~informative[order], n)
        out = out._replace(response_mask_br=out.response_mask_br * (~filler[:, None]).astype(np.int32))
        metrics = {"dynamic_sampling_rounds": len(rounds) - 1, "dynamic_sampling_filled": int(filler.sum()) // n,
                   "dynamic_sampling_kept_fraction": float(informative.mean())}
        return [groups[g] for g in order], out, np.concatenate([r[2] for r in rounds])[rows], metrics

    def generate(self, problems: Sequence[Problem], positions: np.ndarray, temperature: float,
                 n: int | None = None, step: int | None = None) -> RolloutBatch:
        """Rollouts of every prompt, the prompts split over the actor-gen replicas in order; responses are cut
        at step ``step``'s budget (:meth:`response_budget`) and right-padded to the programs' R."""
        n = self.n if n is None else n
        prompts = [self.prompt_ids(p) for p in problems]
        _check_prompt_lengths(prompts, self.P)
        sampling = self._sampling(temperature, n, self.response_budget(step))
        chunks = np.array_split(np.arange(len(prompts)), len(self._engines))
        outs = self._on_engines([(i, lambda g, idx=idx: g.generate([prompts[j] for j in idx], sampling,
                                                                     prompt_ids=positions[idx] % (2**31)))
                                 for i, idx in enumerate(chunks) if len(idx)])
        tokens = np.concatenate([o.tokens for o in outs])
        lengths = np.concatenate([o.lengths for o in outs])
        response, response_mask = right_pad([list(t[:n_]) for t, n_ in zip(tokens, lengths, strict=True)],
                                            self.R, self.tok.pad_id)
        prompt, prompt_mask = left_pad([p for p in prompts for _ in range(n)], self.P, self.tok.pad_id)
        logp = np.concatenate([o.logprobs for o in outs])
        logp = np.pad(logp, ((0, 0), (0, self.R - logp.shape[1]))) * response_mask  # a budget under R: pad
        # the oldest policy version behind any of a row's tokens (a resumed partial rollout has several)
        versions = np.concatenate([np.where(o.param_versions < 0, np.iinfo(np.int32).max, o.param_versions).min(1)
                                   for o in outs])
        return RolloutBatch(prompt, prompt_mask, response, response_mask, logp.astype(np.float32),
                            np.repeat(positions, n), np.tile(np.arange(n), len(prompts)).astype(np.int32),
                            versions.astype(np.int32))

    def _on_engines(self, work: Sequence[tuple[int, Any]]) -> list[Rollouts]:
        """``fn(engine)`` for each (engine index, fn), in order. With several processes each process runs
        its own replicas' engines, then every result is shared from its owner, so every process holds
        all rollouts (the same on each)."""
        local = self._run_local([(i, fn) for i, fn in work if self._engines[i] is not None])
        if jax.process_count() == 1:
            return [local[i] for i, _ in work]
        outs = []
        for i, _ in work:
            owner = self.units[ACTOR_GEN][i].devices[0].process_index
            mine = local.get(i)
            arrays = share_from(owner, None if mine is None else [mine.tokens, mine.logprobs, mine.lengths,
                                                                  mine.param_versions, mine.prompt_index,
                                                                  mine.sample_index])
            outs.append(mine or Rollouts(*arrays[:3], (), *arrays[3:], {}))
        return outs

    def _run_local(self, work: Sequence[tuple[int, Any]]) -> dict[int, Rollouts]:
        """This process's engines, each in a thread of its own: every engine's decode loop waits on its own
        devices, so one after another would keep only one replica busy at a time (results do not depend
        on the order: sampling is keyed per request)."""
        if len(work) <= 1:
            return {i: fn(self._engines[i]) for i, fn in work}
        if self._engine_pool is None or self._engine_pool_size < len(work):
            if self._engine_pool is not None:
                self._engine_pool.shutdown(wait=False)
            self._engine_pool = concurrent.futures.ThreadPoolExecutor(len(work), thread_name_prefix="nereus-engine")
            self._engine_pool_size = len(work)
        futures = {i: self._engine_pool.submit(fn, self._engines[i]) for i, fn in work}
        outs = {i: f.result() for i, f in futures.items()}
        self.engine_thread_cpu_s += sum(o.stats.get("thread_cpu_s", 0.0) for o in outs.values())
        return outs

    def _sampling(self, temperature: float, n: int, max_new_tokens: int | None = None) -> SamplingParams:
        c = self.cfg.rollout
        return SamplingParams(temperature=temperature, top_k=c.top_k if temperature else 0,
                              top_p=c.top_p if temperature else 1.0, max_new_tokens=max_new_tokens or self.R,
                              stop_tokens=tuple(self.tok.eos_ids), n=n, seed=c.seed)

    def rewards(self, problems: Sequence[Problem], batch: RolloutBatch) -> tuple[np.ndarray, dict[str, float]]:
        """[rows] sequence rewards and their metrics: the reward model's scores (reward-infer), else the
        task's reward (exact, math or a user function; ``problems`` has one entry per prompt)."""
        if self.reward_model is not None:
            scores = self._infer(REWARD_INFER, "scores", batch)
            if not np.all(np.isfinite(scores)):
                raise JobError(f"the reward model task.reward_model_path={self.cfg.task.reward_model_path!r} gave "
                               f"{int((~np.isfinite(scores)).sum())} non-finite scores: check that its vocabulary "
                               "covers the tokenizer's and that its weights are finite")
            return scores, {"reward_mean": float(scores.mean())}
        n = len(batch.response_br) // len(problems)
        out = self.rewarder.score([p for p in problems for _ in range(n)], self.texts(batch))
        return out.rewards, out.metrics()

    def texts(self, batch: RolloutBatch) -> list[str]:
        """Each row's response, decoded up to its length."""
        lengths = batch.response_mask_br.sum(1)
        return [self.tok.decode(r[:n].tolist()) for r, n in zip(batch.response_br, lengths, strict=True)]

    # ------------------------------------------------------------------------- scoring and training
    def _score(self, batch: RolloutBatch, seconds: dict[str, float]) -> dict[str, np.ndarray]:
        out = {}
        t = time.perf_counter()
        out["old_logp"] = self._infer(ACTOR_TRAIN, "logprobs", batch)
        seconds["actor-infer"] = time.perf_counter() - t
        t = time.perf_counter()
        out["ref_logp"] = self._infer(REF_INFER, "logprobs", batch)
        seconds["ref-infer"] = time.perf_counter() - t
        if self.algo.uses_critic:
            t = time.perf_counter()
            out["values"] = self._infer(CRITIC_TRAIN, "values", batch)
            seconds["critic-infer"] = time.perf_counter() - t
        return out

    def _use(self, ms: ModelStage) -> list[EMU]:
        """The stage's units on device, onloading them first if they are parked."""
        if self.units[ms][0].memory != DEVICE:
            self._move(ms, HOST, DEVICE)
        return self.units[ms]

    def park(self, ms: ModelStage) -> None:
        """With plan.park_idle: offload an idle stage's state to host memory (pinned_host)."""
        if self.cfg.plan.park_idle and ms != ACTOR_GEN and self.units[ms][0].memory == DEVICE:
            self._move(ms, DEVICE, HOST)

    def _move(self, ms: ModelStage, src: str, dst: str) -> None:
        sp = self.plan[ms]
        graph = self._program(("park", ms, src, dst), lambda: TransitionGraph.build(
            ExecutionPlan({ms: dataclasses.replace(sp, memory=src)}),
            ExecutionPlan({ms: dataclasses.replace(sp, memory=dst)}), {ms: self.specs[ms]}))
        move(self, graph)

    def _stage_inputs(self, ms: ModelStage, data: dict, program: tuple, mini: int | None = None):
        """The stage's replicas as one SPMD state, and ``data`` ([rows, ...] host arrays) as token-budget
        micro-batches on its mesh (``mini``: split into mini-batches first), padded or, with
        ``trainer.packing``, packed (:mod:`nereus_jax.rl.packing`). Returns (leaves, mesh, program key, micro,
        order): ``order`` is the row order of the micro-batches' sequences (None: as given). Records padded
        inputs' signature under ``program`` so :meth:`prepare` can compile it ahead."""
        leaves, mesh = assemble_replicas(self._use(ms))
        kind, dp = program[0], mesh.shape["dp"]
        if not self.cfg.trainer.packing:
            self._signatures[program] = {k: (np.shape(v), np.asarray(v).dtype) for k, v in data.items()}
            accum = self._accum(kind, dp)
            host = steps.split_micro(data, accum) if mini is None else steps.split_minibatches(data, mini, accum)
            return leaves, mesh, self._key(kind, ms, mesh, accum, *program[2:]), self._put(host, mesh, mini), None
        layout = packing.pack(data["tokens"], data["mask"], prompt_len=self.P, mini=mini or 1, dp=dp,
                              budget_rows=self.cfg.trainer.micro_batch_tokens // (self.P + self.R))
        host = steps.split_packed(data, layout, mini)
        self.packing_fill = layout.packed_tokens / layout.tokens.size  # real tokens / token slots run
        key = self._key(kind, ms, mesh, layout.accum, "packed", *program[2:])
        return leaves, mesh, key, self._put(host, mesh, mini), layout.order

    @staticmethod
    def _put(host: dict, mesh, mini: int | None) -> dict:
        return steps.put_micro(host, mesh) if mini is None else steps.put_minibatches(host, mesh)

    def _infer(self, ms: ModelStage, what: str, batch: RolloutBatch) -> np.ndarray:
        data = {"tokens": batch.tokens(), "mask": batch.attention_mask()}
        leaves, mesh, key, micro, order = self._stage_inputs(ms, data, ("infer", ms, what))
        params = self.specs[ms].unflatten(leaves)["params"]
        fn = self._program(key, lambda: _infer_program(self.specs[ms].model, self.P, what,
                                                       stage_forward(mesh, self.specs[ms].kind)))
        out = to_numpy(fn(params, micro))
        if ms.kind == "infer":
            self.park(ms)
        out = out.reshape(self.rows, -1)
        if order is not None:
            out = out[np.argsort(order)]
        if what == "scores":
            return out.reshape(self.rows).astype(np.float32)
        return out * batch.response_mask_br

    def _advantages(self, step: int, batch: RolloutBatch, scores: np.ndarray, scored: dict) -> alg.Advantages:
        a = self.cfg.algorithm
        if self.algo.advantage in ("gae", "grpo", "dr_grpo", "rloo"):  # one jitted program, not a chain of eager ops
            values = scored["values"] if self.algo.advantage == "gae" else np.zeros_like(scored["old_logp"])
            return _advantage_program(scores, batch.response_mask_br, scored["old_logp"], scored["ref_logp"],
                                      values, advantage=self.algo.advantage, estimator=a.kl_estimator,
                                      kl_in_reward=a.kl_in_reward, kl_coef=a.kl_coef, gamma=a.gamma, lam=a.lam,
                                      n=self.n)
        mask = jnp.asarray(batch.response_mask_br)
        problems = [self.task_at(step).problem(int(p)) for p in batch.prompt_index_b[:: self.n]]
        greedy = self.generate(problems, batch.prompt_index_b[:: self.n], 0.0, n=1, step=step)
        base = self.rewarder.score(problems, self.texts(greedy)).rewards
        return alg.remax(jnp.asarray(scores), mask, jnp.asarray(np.repeat(base, self.n)))

    def _correct(self, adv: alg.Advantages, batch: RolloutBatch, old_logp: np.ndarray,
                 staleness: np.ndarray) -> tuple[alg.Advantages, dict[str, float]]:
        """Steps 2-5 of the off-policy corrections (module docstring): one weight per token from
        r = pi_old / pi_behaviour on the advantages, and the mismatch metrics of every step."""
        s, t = self.settings, self.cfg.trainer
        mask = batch.response_mask_br
        mode = self.cfg.algorithm.rollout_correction
        metrics = alg.mismatch_metrics(old_logp, batch.behaviour_logp_br, mask, s.correction_low, s.correction_clip)
        stale = (staleness > 0) if t.stale_rollouts == "reweight" else np.zeros(len(staleness), bool)
        if mode == "none" and not stale.any():
            return adv, metrics
        ratio = alg.behaviour_ratio(old_logp, batch.behaviour_logp_br, mask)
        w = alg.correction_weights(ratio, mode, s.correction_low, s.correction_clip)
        if stale.any():
            lag = np.minimum(ratio, t.importance_clip)
            w = np.where(stale[:, None], np.where(w > 0, lag, 0.0) if mode == "icepop" else lag, w)
            metrics["importance_weight_mean"] = float((w * mask)[stale].sum() / max(1, mask[stale].sum()))
        w = (w * mask).astype(np.float32)
        if mode != "none":
            metrics["correction_weight_mean"] = float(w.sum() / max(1, mask.sum()))
            metrics["correction_masked_fraction"] = float(((w == 0) & (mask > 0)).sum() / max(1, mask.sum()))
        return alg.Advantages(jnp.asarray(adv.advantages_bt) * w, adv.returns_bt), metrics

    def _train(self, batch, scored, adv, seconds) -> dict[str, float]:
        data = {"tokens": batch.tokens(), "mask": batch.attention_mask(), "response_mask": batch.response_mask_br,
                "old_logp": scored["old_logp"], "ref_logp": scored["ref_logp"],
                "advantages": np.asarray(adv.advantages_bt, np.float32)}
        t = time.perf_counter()
        metrics = self._train_stage(ACTOR_TRAIN, data)
        seconds["actor-train"] = time.perf_counter() - t
        if self.algo.uses_critic:
            data = {**data, "old_values": scored["values"], "returns": np.asarray(adv.returns_bt, np.float32)}
            t = time.perf_counter()
            metrics |= self._train_stage(CRITIC_TRAIN, data)
            seconds["critic-train"] = time.perf_counter() - t
        return metrics

    def _train_stage(self, ms: ModelStage, data: dict) -> dict[str, float]:
        """One training program: mini_batches x ppo_epochs updates of the stage on ``data`` ([rows, ...]).
        Logged: each metric's mean over the updates (``*_max`` / ``*_min``: the extreme), and with more than
        one update ``<model>_per_update``, the policy's ratio and clipping statistics update by update."""
        leaves, mesh, key, micro, _ = self._stage_inputs(ms, data, ("train", ms), self.cfg.trainer.mini_batches)
        spec = self.specs[ms]
        fn = self._program(key, lambda: self._train_program(ms, spec, mesh))
        new_leaves, metrics = fn(leaves, micro)
        self.units[ms] = split_replicas(new_leaves, mesh, ms, spec)
        self.updates[ms] = self.updates.get(ms, 0) + 1
        if ms != ACTOR_TRAIN:  # the actor's state is read again by the weight sync
            self.park(ms)
        per_update = {k: np.asarray(v, np.float64) for k, v in tree_to_numpy(metrics).items()}  # a collective
        skipped = int(per_update.pop("nonfinite").sum())
        metrics = {k: float(_REDUCE.get(k.rsplit("_", 1)[-1], np.mean)(v)) for k, v in per_update.items()}
        self._check_finite(ms, skipped, metrics)
        metrics[f"{ms.model}_updates_skipped"] = self.skipped.get(ms, 0)
        if len(next(iter(per_update.values()))) > 1:
            metrics[f"{ms.model}_per_update"] = {k: v.tolist() for k, v in per_update.items() if k in _PER_UPDATE}
        return metrics

    def _accum(self, kind: str, dp: int) -> int:
        """Micro-batches per program call: an update's rows (train: a mini-batch) over dp in the token budget."""
        rows = self.mini_rows if kind == "train" else self.rows
        return steps.accumulation_steps(rows, dp, self.P + self.R, self.cfg.trainer.micro_batch_tokens)

    def _check_finite(self, ms: ModelStage, skipped: int, metrics: dict[str, float]) -> None:
        """Counts consecutive training steps with an update skipped as non-finite (the program kept the old
        state; ``skipped``: how many of the step's updates); after ``trainer.max_nonfinite_steps`` such steps
        in a row the job stops, naming the stage and the cause."""
        self.nonfinite[ms] = self.nonfinite.get(ms, 0) + 1 if skipped else 0
        self.skipped[ms] = self.skipped.get(ms, 0) + skipped
        limit = self.cfg.trainer.max_nonfinite_steps
        if self.nonfinite[ms] >= limit:
            lr = self.cfg.trainer.actor_lr if ms.model == "actor" else self.cfg.trainer.critic_lr
            raise NonFiniteTraining(
                f"{ms}: {limit} consecutive training steps gave a non-finite loss, gradient norm or update (last "
                f"loss {metrics.get('loss')}, gradient norm {metrics.get('grad_norm')}); their updates were skipped "
                f"and no checkpoint holds them. Likely cause: the learning rate (trainer.{ms.model}_lr={lr}) or the "
                "loss coefficients; lower it and resume from the last checkpoint")

    def _train_program(self, ms: ModelStage, spec: StateSpec, mesh):
        a, m = self.cfg.algorithm, self.cfg.model
        make_loss = functools.partial(steps.actor_loss if ms.model == "actor" else steps.critic_loss, m, a, self.P)
        grad_fn = stage_value_and_grad(mesh, spec.kind, make_loss, self.cfg.trainer.pipeline_schedule)
        step = steps.make_minibatch_train_step(None, spec.optimizer, m, epochs=self.cfg.trainer.ppo_epochs,
                                               value_and_grad=grad_fn)

        def program(leaves, micro):
            state = spec.unflatten(leaves)
            params, opt, metrics = step(state["params"], state["opt"], micro)
            return spec.flatten({"params": params, "opt": opt}), metrics

        return jax.jit(program, donate_argnums=0, out_shardings=(spec.shardings(mesh), None))

    def _weight_sync(self) -> None:
        self.units[ACTOR_GEN] = self.sync(self._use(ACTOR_TRAIN), self.units[ACTOR_GEN])
        self.park(ACTOR_TRAIN)
        self.version += 1
        self._set_engine_params()

    @staticmethod
    def _key(kind: str, ms: ModelStage, mesh, accum: int, *rest) -> tuple:
        """Programs are bound to devices (their shardings name them): the key holds the mesh's device ids."""
        return (kind, ms, mesh.devices.shape, tuple(device_index(d) for d in mesh.devices.flat), accum, *rest)

    def _program(self, key, build):
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    # ------------------------------------------------------------------------------------ metrics
    def _metrics(self, step, batch, scores, scored, train_metrics, seconds) -> dict[str, Any]:
        mask = batch.response_mask_br
        kl = float(_k1_mean(scored["old_logp"], scored["ref_logp"], mask))
        step_s = sum(seconds.values())
        tokens = int(mask.sum())
        # rows masked out of the loss (dynamic sampling's filler, dropped stale rows) are not responses of length 0
        lengths = mask.sum(1)[mask.sum(1) > 0] if mask.any() else np.zeros(1)
        held = max(device_bytes_in_use(self.devices).values(), default=0)
        cap = self.cfg.cluster.device_memory_bytes
        return {"step": step, "device_bytes_max": held, "over_memory_cap": bool(cap and held > cap),
                "reward_mean": float(scores.mean()), "accuracy": float(np.mean(scores >= 1.0)),
                "kl": kl, "response_length_mean": float(lengths.mean()),
                "response_length_p95": float(np.percentile(lengths, 95)), "response_tokens": tokens,
                "step_seconds": step_s, "tokens_per_s": tokens / max(step_s, 1e-9),
                "stage_seconds": {k: round(v, 4) for k, v in seconds.items()}, **train_metrics,
                "policy_version": self.version, "plan": repr(self.plan), "plan_short": plan_short(self.plan),
                **({"packing_fill": self.packing_fill} if self.packing_fill is not None else {})}

    # ----------------------------------------------------------------------------------- evaluation
    def evaluate(self, problems: Sequence[Problem], samples: int = 1) -> dict[str, float]:
        """Held-out scores of the current actor-gen parameters: ``pass_at_1``, greedy (the fraction of
        prompts answered correctly), and with ``samples`` = k > 1 ``pass_at_k``, the fraction of prompts
        with at least one correct answer among k samples at the rollout temperature."""
        positions = np.arange(len(problems), dtype=np.int64)
        greedy = self.generate(problems, positions, 0.0, n=1)
        out = {"pass_at_1": float(self.rewarder.score(problems, self.texts(greedy)).correct.mean())}
        if samples > 1:
            sampled = self.generate(problems, positions, self.cfg.rollout.temperature, n=samples)
            rows = [p for p in problems for _ in range(samples)]
            correct = self.rewarder.score(rows, self.texts(sampled)).correct.reshape(len(problems), samples)
            out["pass_at_k"] = float(correct.any(axis=1).mean())
        return out

    def actor_host_params(self) -> dict:
        """The actor's training parameters as a canonical numpy tree."""
        return self.units[ACTOR_TRAIN][0].to_host()["params"]


def device_bytes_in_use(devices: Sequence[jax.Device]) -> dict[int, int]:
    """Bytes each of ``devices`` holds now (parameters, optimizer state, the engines' KV caches, anything
    alive): the allocator's count where the backend keeps one (GPU, TPU), else the live arrays' shards on it
    (CPU). Shards that share a buffer count once."""
    stats = {d.id: (d.memory_stats() or {}).get("bytes_in_use") for d in devices if is_local(d)}
    if all(v is not None for v in stats.values()):
        return stats
    held, seen = dict.fromkeys(stats, 0), set()
    for array in jax.live_arrays():
        try:  # another thread (async generation, a move) may delete an array while we look
            shards = [(s.device.id, s.data.unsafe_buffer_pointer(), s.data.nbytes) for s in array.addressable_shards]
        except RuntimeError:
            continue
        for device, pointer, nbytes in shards:
            if device in held and (device, pointer) not in seen:
                seen.add((device, pointer))
                held[device] += nbytes
    return held


def prompt_ids(tokenizer, task_cfg, problem: Problem) -> list[int]:
    """A problem's prompt as the model sees it: rendered with the tokenizer's chat template where
    ``task.chat_template`` says so (with ``task.system_prompt``), then tokenized; prompt lengths are counted
    in these tokens."""
    return tokenizer.encode_prompt(problem.prompt, system_prompt=task_cfg.system_prompt, chat=task_cfg.chat_template)


def plan_short(plan: ExecutionPlan) -> str:
    return " ".join(f"{ms}:{sp.layout}x{sp.dp}" for ms, sp in plan.items())


def _specs(cfg: Config, critic: bool) -> dict[ModelStage, StateSpec]:
    m = cfg.model
    specs = {ACTOR_TRAIN: StateSpec(m, "train", optimizer=steps.make_optimizer(cfg.trainer.actor_lr)),
             ACTOR_GEN: StateSpec(m, "gen", dtype=m.compute_dtype),
             REF_INFER: StateSpec(m, "infer", dtype=m.compute_dtype)}
    if critic:
        specs[CRITIC_TRAIN] = StateSpec(m, "train", head="value",
                                        optimizer=steps.make_optimizer(cfg.trainer.critic_lr))
    return specs


def _reward_model(cfg: Config, specs: dict) -> ParamSource:
    """A local reward model (Hugging Face *ForSequenceClassification), read into reward-infer's units slice
    by slice; adds its StateSpec to ``specs``."""
    from nereus_jax.models.hf import HFCheckpoint

    path = cfg.task.reward_model_path
    try:
        ckpt = HFCheckpoint(path)
    except (OSError, ValueError) as e:
        raise JobError(f"task.reward_model_path={path!r}: {e}") from None
    if ckpt.head != "value":
        raise JobError(f"task.reward_model_path={path!r} is a language model, not a reward model: give a "
                       "*ForSequenceClassification checkpoint (one score per sequence)")
    specs[REWARD_INFER] = StateSpec(ckpt.config, "infer", head="value", num_labels=ckpt.num_labels,
                                    dtype=cfg.model.compute_dtype)
    return ckpt


def _critic_source(cfg: Config, actor: ParamSource) -> ParamSource:
    """The critic starts from ``model.critic_hf_path`` (a *ForSequenceClassification checkpoint of the actor's
    architecture, one label), else from the actor's trunk with a zero value head (values start at 0)."""
    path = cfg.model.critic_hf_path
    if path is None:
        return ValueHeadSource(actor, cfg.model.hidden_size)
    from nereus_jax.hf_config import ARCHITECTURE_KEYS
    from nereus_jax.models.hf import HFCheckpoint

    try:
        ckpt = HFCheckpoint(path)
    except (OSError, ValueError) as e:
        raise JobError(f"model.critic_hf_path={path!r}: {e}") from None
    if ckpt.head != "value" or ckpt.num_labels != 1:
        raise JobError(f"model.critic_hf_path={path!r} is not a one-label *ForSequenceClassification checkpoint "
                       f"(head {ckpt.head!r}, {ckpt.num_labels} labels): give a critic / reward-model checkpoint")
    differ = [k for k in ARCHITECTURE_KEYS if getattr(ckpt.config, k) != getattr(cfg.model, k)]
    if differ:
        shown = ", ".join(f"{k}={getattr(ckpt.config, k)!r} (actor: {getattr(cfg.model, k)!r})" for k in differ)
        raise JobError(f"model.critic_hf_path={path!r} has another architecture than the actor: {shown}; the critic "
                       "shares the actor's architecture (the planner prices both with it)")
    return ckpt


def stage_forward(mesh, kind: str):
    """The forward a stage's programs run on ``mesh``: GPipe over its pp axis when it has one (with the
    micro-batch count the cost model prices, :func:`pipeline_microbatches` of the call's rows per replica),
    else the plain forward."""
    return pipeline_forward_fn(mesh, pipeline_microbatches, kind)


def stage_value_and_grad(mesh, kind: str, make_loss: steps.MakeLoss, schedule: str = "1f1b") -> steps.GradFn:
    """What a stage's training program differentiates with on ``mesh`` (``make_loss(forward_fn)``: the loss):
    the 1F1B schedule over its pp axis when it has one and ``schedule`` is '1f1b'
    (:func:`~nereus_jax.runtime.steps.pipelined_value_and_grad`), else ``jax.value_and_grad`` through
    :func:`stage_forward` (GPipe when pp > 1). Both split a call into the micro-batch count the cost model
    prices; scoring programs keep :func:`stage_forward`."""
    if check_schedule(schedule) == "1f1b" and pipeline_axis(mesh, kind) is not None:
        return steps.pipelined_value_and_grad(make_loss, mesh, pipeline_microbatches, kind)
    return jax.value_and_grad(make_loss(stage_forward(mesh, kind)), has_aux=True)


def _infer_program(cfg, prompt_len: int, what: str, forward_fn=forward):
    """A scoring stage over its micro-batches (padded or packed): log-probs or values [accum, b, R], or
    scores [accum, b]."""
    def one(params, mb):
        if what == "scores":
            return steps.stage_scores(params, cfg, mb, forward_fn)
        if what == "values":
            return steps.stage_values(params, cfg, mb, prompt_len, forward_fn)
        return steps.response_stats(params, cfg, mb, prompt_len, forward_fn)[0]

    def program(params, micro):
        return jax.lax.map(lambda mb: one(params, mb), micro)

    return jax.jit(program)


@functools.partial(jax.jit, static_argnames=("advantage", "estimator", "kl_in_reward", "kl_coef", "gamma", "lam",
                                             "n"))
def _advantage_program(scores, mask, old_logp, ref_logp, values, *, advantage: str, estimator: str,
                       kl_in_reward: bool, kl_coef: float, gamma: float, lam: float, n: int) -> alg.Advantages:
    """PPO's whitened GAE (token rewards: the score on the last token, minus the KL when ``kl_in_reward``), or
    GRPO's / RLOO's grouped advantages; ``values`` is read by GAE only."""
    if advantage != "gae":
        return alg.ADVANTAGES[advantage](scores, mask, n)
    kl = alg.kl_estimate(old_logp, ref_logp, estimator)
    rewards = alg.token_rewards(scores, mask, kl if kl_in_reward else None, kl_coef)
    out = alg.gae(rewards, values, mask, gamma, lam)
    return alg.Advantages(alg.masked_whiten(out.advantages_bt, mask), out.returns_bt)


@jax.jit
def _k1_mean(old_logp, ref_logp, mask) -> jax.Array:
    """The logged ``kl``: the k1 estimate's mean over response tokens."""
    return alg.masked_mean(alg.kl_estimate(old_logp, ref_logp, "k1"), mask)


_REDUCE = {"max": np.max, "min": np.min}  # a per-update metric named *_max / *_min; the rest: the mean
_PER_UPDATE = ("clip_fraction", "approx_kl", "ratio_mean", "ratio_max", "ratio_min", "grad_norm")


def _plan_mesh(sp, devices: Sequence[jax.Device]):
    """The SPMD mesh of a stage's replicas, exactly as ``assemble_replicas`` builds it."""
    return make_mesh([devices[i] for r in sp.replicas for i in r], sp.layout, dp=sp.dp)


def _abstract_micro(signature: dict[str, tuple], accum: int, mesh, mini: int | None = None) -> dict:
    """``put_micro(split_micro(data, accum), mesh)`` as shapes, dtypes and shardings (no data); with ``mini``,
    ``put_minibatches(split_minibatches(data, mini, accum), mesh)``'s."""
    lead = (accum,) if mini is None else (mini, accum)
    rows = NamedSharding(mesh, PartitionSpec(*(None,) * len(lead), "dp"))
    whole = NamedSharding(mesh, PartitionSpec())
    out = {}
    for k, (shape, dtype) in signature.items():
        dtype = jax.dtypes.canonicalize_dtype(dtype)  # what jit makes of a host array (float64 -> float32)
        if len(shape) == 0:
            out[k] = jax.ShapeDtypeStruct(lead, dtype, sharding=whole)
        else:
            per = shape[0] // math.prod(lead)
            out[k] = jax.ShapeDtypeStruct((*lead, per, *shape[1:]), dtype, sharding=rows)
    if mini is not None:
        for k in ("denom", "seq_denom"):
            out[k] = jax.ShapeDtypeStruct(lead, jnp.float32, sharding=whole)
    return out


def _zeros(model) -> dict:
    """Canonical parameters of ``model``, all zeros (engine warm-up: shapes matter, values do not)."""
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params(model))


def _check_plan_devices(plan: ExecutionPlan, available: int) -> None:
    missing = [d for d in plan.devices if d >= available]
    if missing:
        raise JobError(f"the plan uses devices {missing} but only devices 0..{available - 1} exist: "
                       "lower the plan's dp/tp/pp or raise cluster.num_devices")
    for replica, owners in engine_replicas_across_processes(plan):
        raise JobError(f"actor-gen replica on devices {list(replica)} spans processes {owners}: an engine "
                       "runs its decode loop in one process; give actor-gen a tp x pp that fits one "
                       "host's devices (training stages may span hosts)")


def engine_replicas_across_processes(plan: ExecutionPlan) -> list[tuple[tuple[int, ...], list[int]]]:
    """(devices, processes) of each actor-gen replica of ``plan`` whose devices belong to several processes
    (an engine's decode loop runs in one process, so such a plan cannot run)."""
    if jax.process_count() == 1 or ACTOR_GEN not in plan:
        return []
    devices = jax.devices()
    spans = [(tuple(r), sorted({devices[d].process_index for d in r})) for r in plan[ACTOR_GEN].replicas]
    return [(r, owners) for r, owners in spans if len(owners) > 1]


def _check_rows(plan: ExecutionPlan, rows: int, mini_rows: int | None = None) -> None:
    mini_rows = rows if mini_rows is None else mini_rows
    for ms, sp in plan.items():
        if ms.kind != "gen" and rows % sp.dp:
            raise JobError(f"{ms}: {rows} rollouts a step (trainer.prompts_per_step x rollout.samples_per_prompt) "
                           f"do not split over dp={sp.dp} replicas; choose a dp dividing {rows}")
        if ms.kind == "train" and mini_rows % sp.dp:
            raise JobError(f"{ms}: a mini-batch of {mini_rows} rollouts (a step's {rows} over trainer.mini_batches) "
                           f"does not split over dp={sp.dp} replicas; choose a dp dividing {mini_rows} or fewer "
                           "trainer.mini_batches")


def _check_prompt_lengths(prompts: list[list[int]], limit: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest > limit:
        raise ConfigError(f"a prompt has {longest} tokens (with bos) but rollout.max_prompt_length={limit}: "
                          "raise rollout.max_prompt_length or shorten the prompts")
