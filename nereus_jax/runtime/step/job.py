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

The job is a facade over three collaborators, each in its module: the stage state (plan, units, specs, policy
version, compiled programs, parking, plan changes: :mod:`~nereus_jax.runtime.step.stages`), the rollout side (data
stream, engines, generation, parameter loads, evaluation: :mod:`~nereus_jax.runtime.step.rollout`) and the learner
side (rewards, scoring, advantages, corrections, training, metrics: :mod:`~nereus_jax.runtime.step.learner`). A
runner that drives them itself (the async runner) uses ``job.stages``, ``job.rollout`` and ``job.learner``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from nereus_jax.config import Config
from nereus_jax.elastic.emu import EMU, stage_to_host
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.elastic.sources import HostSource, ParamSource
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.elastic.weight_sync import WeightSync
from nereus_jax.engine import Generator
from nereus_jax.model_stage import ACTOR_GEN, ACTOR_TRAIN, ModelStage
from nereus_jax.models import init_params
from nereus_jax.rl import algorithms as alg
from nereus_jax.rl.batch import RolloutBatch
from nereus_jax.rl.tasks import Problem
from nereus_jax.runtime.platform.device_memory import device_bytes_in_use
from nereus_jax.runtime.platform.xla_workarounds import serialize_cpu_compile_cache
from nereus_jax.runtime.step.initial_plan import plan_from_config, with_micro_batch_tokens
from nereus_jax.runtime.step.learner import (
    EXTRA_INDEX_OFFSET,
    Learner,
    NonFiniteTraining,
    StepResult,
    plan_short,
)
from nereus_jax.runtime.step.move import move
from nereus_jax.runtime.step.rollout import Rollout, prompt_ids
from nereus_jax.runtime.step.stages import (
    JobError,
    StageState,
    engine_replicas_across_processes,
    stage_forward,
    stage_value_and_grad,
)

__all__ = ["EXTRA_INDEX_OFFSET", "DeviceLost", "Job", "JobError", "NonFiniteTraining", "Prepared", "StepResult",
           "device_bytes_in_use", "engine_replicas_across_processes", "plan_short", "prompt_ids", "stage_forward",
           "stage_value_and_grad"]


@dataclasses.dataclass
class Prepared:
    """What :meth:`Job.prepare` built for a target plan: compiled programs and warmed engines (None: the
    target keeps actor-gen's devices and layout, so the current engines serve it)."""

    plan: ExecutionPlan
    programs: dict[Any, Any]
    engines: list[Generator | None] | None
    seconds: float


class DeviceLost(RuntimeError):
    """Devices (plan ids: positions in ``jax.devices()``) that stopped working during a step; raised by the
    runtime (or by an injected fault, :meth:`Job.inject_device_loss`)."""

    def __init__(self, device_ids: Sequence[int], message: str = ""):
        self.device_ids = tuple(sorted(int(d) for d in device_ids))
        super().__init__(message or f"devices {list(self.device_ids)} were lost")


def _of(part: str, name: str, doc: str, writable: bool = False) -> property:
    """``job.<name>``: the collaborator ``part``'s attribute of that name (one owner, read through the job)."""
    def get(self):
        return getattr(getattr(self, part), name)

    def put(self, value):
        setattr(getattr(self, part), name, value)

    return property(get, put if writable else None, doc=doc)


class Job:
    """Holds every model-stage's units (EMUs), the engines of actor-gen, and the data position: the stage
    state (``stages``), the rollout side (``rollout``) and the learner side (``learner``) of one RL job."""

    plan = _of("stages", "plan", "The execution plan the job runs.")
    units = _of("stages", "units", "Each model-stage's units (EMUs), laid out in ``plan``.")
    specs = _of("stages", "specs", "Each model-stage's StateSpec (its whole state on one replica).")
    sync = _of("stages", "sync", "The weight sync actor-train -> actor-gen of ``plan``.")
    reward_model = _of("stages", "reward_model", "reward-infer's source (task.reward_model_path), or None.")
    version = _of("stages", "version", "The policy version: training updates the actor has had.", writable=True)
    updates = _of("learner", "updates", "Successful training updates per model-stage (this Job).")
    nonfinite = _of("learner", "nonfinite", "Consecutive non-finite steps (scores or an update): the streak.")
    nonfinite_since = _of("learner", "nonfinite_since", "The non-finite streak's first step (None: no streak).")
    skipped = _of("learner", "skipped", "Skipped (non-finite) updates per model-stage in all.")
    packing_fill = _of("learner", "packing_fill", "With trainer.packing: the last packed stage's tokens / slots.")
    engine_thread_cpu_s = _of("rollout", "engine_thread_cpu_s", "CPU seconds of the engine threads so far.")

    def __init__(self, cfg: Config, task, tokenizer, *, actor: ParamSource | dict | None = None,
                 plan: ExecutionPlan | None = None, devices: Sequence[jax.Device] | None = None, rewarder=None):
        """``actor``: where actor-train, actor-gen, ref-infer (and the critic's trunk) start from: a parameter
        source (a Hugging Face checkpoint, read slice by slice into each stage's shardings), a canonical host
        tree, or None for random weights. ``rewarder``: the task's reward (default: built from the config;
        the job does not close one it was given)."""
        serialize_cpu_compile_cache()  # engines, the compile-ahead thread and the loop compile concurrently
        cfg = with_micro_batch_tokens(cfg)  # trainer.micro_batch_tokens=null: what the memory allows
        self.cfg, self.task, self.tok = cfg, task, tokenizer
        self.algo = alg.algorithm_spec(cfg.algorithm.name)
        self.settings = alg.settings(cfg.algorithm, cfg.rollout.max_response_length)
        self.devices = list(devices or jax.devices()[: cfg.cluster.num_devices])
        if len(self.devices) < cfg.cluster.num_devices:
            raise JobError(f"cluster.num_devices={cfg.cluster.num_devices} but only {len(self.devices)} devices "
                           "exist; lower cluster.num_devices")
        # checks the plan against the devices and the step's rows, reads the specs (and the reward model's)
        self.stages = StageState(cfg, self.devices, plan or plan_from_config(cfg), functools.partial(move, self))
        self.P, self.R = cfg.rollout.max_prompt_length, cfg.rollout.max_response_length
        self.n = cfg.rollout.samples_per_prompt
        self.rows, self.mini_rows = self.stages.rows, self.stages.mini_rows  # mini_rows: one optimizer update's
        self._own_rewarder = rewarder is None
        if rewarder is None:
            from nereus_jax.rl.rewards import make_rewarder

            rewarder = make_rewarder(cfg.task, task)
        self.rewarder = rewarder
        if actor is None:
            actor = init_params(cfg.model, seed=cfg.trainer.seed)
        self.stages.place(actor if hasattr(actor, "read") else HostSource(actor))
        self.rollout = Rollout(cfg, task, tokenizer, self.stages, rewarder)
        self.learner = Learner(cfg, self.stages, self.rollout, rewarder, self.algo, self.settings)
        self._fault: tuple[int, ...] = ()  # devices an injected fault loses in the next step

    def close(self) -> None:
        """Releases the engines' threads and the reward workers this job started."""
        self.rollout.close()
        if self._own_rewarder:
            self.rewarder.close()

    # ------------------------------------------------------------------------------ plan changes
    def prepare(self, plan: ExecutionPlan) -> Prepared:
        """Everything ``plan`` needs compiled, built without touching the current state: the training and
        scoring programs lowered and compiled for the target shardings (ahead of time, from the input
        signatures of the steps run so far) and actor-gen engines on the target meshes, warmed by a
        generation from zero weights. Safe on a background thread while the current plan keeps stepping."""
        t = time.perf_counter()
        programs = self.stages.prepare_programs(plan)
        if plan[ACTOR_GEN] == self.plan[ACTOR_GEN]:  # None: the engines stay (adopt() loads the moved parameters)
            return Prepared(plan, programs, None, time.perf_counter() - t)
        return Prepared(plan, programs, self.rollout.prepare_engines(plan), time.perf_counter() - t)

    def check_plan(self, plan: ExecutionPlan) -> WeightSync:
        """Raises unless the job can run ``plan``; returns its weight sync (:meth:`StageState.check_plan`)."""
        return self.stages.check_plan(plan)

    def adopt(self, plan: ExecutionPlan, units: dict[ModelStage, list[EMU]], prepared: Prepared | None = None, *,
              sync: WeightSync | None = None):
        """Switch to ``plan`` whose state is ``units`` (the executor's output): the weight sync (``sync``, from
        :meth:`check_plan`, or built here), the engines (``prepared``'s warmed ones, or new) and the compiled
        programs follow the plan. State moves go through :func:`nereus_jax.runtime.step.move.move`, which checks
        the plan before moving and adopts after."""
        sync = sync or self.check_plan(plan)
        same_engines = plan[ACTOR_GEN] == self.plan[ACTOR_GEN]
        ready = prepared if prepared is not None and prepared.plan == plan else None
        self.stages.adopt(plan, units, sync, ready.programs if ready is not None else {})
        self.rollout.adopt(ready.engines if ready is not None else None, same_engines)

    def load_state(self, units: dict[ModelStage, list[EMU]], version: int) -> None:
        """Replaces the units (laid out in ``self.plan``) and the policy version, e.g. from a checkpoint;
        the engines adopt the actor-gen parameters."""
        self.stages.load_state(units, version)
        self.rollout.set_params()

    def park(self, ms: ModelStage) -> None:
        """With plan.park_idle: offload an idle stage's state to host memory (pinned_host)."""
        self.stages.park(ms)

    # ----------------------------------------------------------------------------------- one step
    def prompt_ids(self, problem: Problem) -> list[int]:
        """A problem's prompt as the model sees it (see :func:`prompt_ids`)."""
        return self.rollout.prompt_ids(problem)

    def problems(self, step: int) -> tuple[list[Problem], np.ndarray]:
        """Step ``step``'s prompts and their data positions."""
        return self.rollout.problems(step)

    def task_at(self, step: int):
        """The task step ``step`` draws from (:meth:`Rollout.task_at`)."""
        return self.rollout.task_at(step)

    def response_budget(self, step: int | None) -> int:
        """Step ``step``'s response budget (:meth:`Rollout.response_budget`)."""
        return self.rollout.response_budget(step)

    def step(self, step: int) -> StepResult:
        """One synchronous step: generate, score, train, weight sync."""
        problems, positions = self.problems(step)
        t = time.perf_counter()
        batch = self.collect_rollouts(problems, positions, self.cfg.rollout.temperature, step=step)
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
        return self.learner.learn(step, problems, batch, seconds, sync)

    def collect_rollouts(self, problems: Sequence[Problem], positions: np.ndarray, temperature: float,
                 n: int | None = None, step: int | None = None) -> RolloutBatch:
        """Rollouts of every prompt over the actor-gen replicas (:meth:`Rollout.collect`)."""
        return self.rollout.collect(problems, positions, temperature, n, step)

    def rewards(self, problems: Sequence[Problem], batch: RolloutBatch) -> tuple[np.ndarray, dict[str, float]]:
        """[rows] sequence rewards and their metrics (:meth:`Learner.rewards`)."""
        return self.learner.rewards(problems, batch)

    def texts(self, batch: RolloutBatch) -> list[str]:
        """Each row's response, decoded up to its length."""
        return self.rollout.texts(batch)

    def _weight_sync(self) -> None:
        units = self.sync(self.stages.use(ACTOR_TRAIN), self.units[ACTOR_GEN],
                          keep=self.stages.held_outside(ACTOR_TRAIN, ACTOR_GEN))
        self.park(ACTOR_TRAIN)
        self.version += 1
        self.rollout.load_units(units)

    # ----------------------------------------------------------------------------------- evaluation
    def evaluate(self, problems: Sequence[Problem], samples: int = 1) -> dict[str, float]:
        """Held-out ``pass_at_1`` (and with ``samples`` > 1 ``pass_at_k``) of the current actor-gen parameters
        (:meth:`Rollout.evaluate`)."""
        return self.rollout.evaluate(problems, samples)

    def unit_spec(self, ms: ModelStage, plan: ExecutionPlan | None = None) -> StateSpec:
        """What each unit of ``ms`` holds in ``plan`` (default: the current one); see ``StageState.unit_spec``."""
        return self.stages.unit_spec(ms, plan)

    def stage_host_state(self, ms: ModelStage) -> dict:
        """``ms``'s whole state as a canonical numpy tree ({"params", "opt"}), however its replicas hold it."""
        return stage_to_host(self.units[ms])

    def actor_host_params(self) -> dict:
        """The actor's training parameters as a canonical numpy tree."""
        return self.units[ACTOR_TRAIN][0].to_host()["params"]
