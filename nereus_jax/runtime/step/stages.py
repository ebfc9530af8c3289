"""A job's stage state: where every model-stage's state lives, and the programs compiled for it.

:class:`StageState` holds the execution plan, each model-stage's units (EMUs) and StateSpec, the policy version,
the weight sync actor-train -> actor-gen, and the compiled programs, keyed by the devices they are bound to,
with the input signatures the steps called them with. It onloads a parked stage before use and parks it after
(:meth:`~StageState.use` / :meth:`~StageState.park`), compiles a target plan's programs ahead
(:meth:`~StageState.prepare_programs`) and checks and adopts a new plan's state (:meth:`~StageState.check_plan`
/ :meth:`~StageState.adopt`). The program builders live here too: what a program is depends on its stage's mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nereus_jax.config import Config
from nereus_jax.elastic.costs import pipeline_microbatches
from nereus_jax.elastic.emu import EMU, assemble_replicas
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import DEVICE, HOST, ExecutionPlan
from nereus_jax.elastic.shared_base import frozen_leaves, held_buffers, share_frozen, share_groups
from nereus_jax.elastic.sources import ParamSource, ValueHeadSource, units_from_source
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.elastic.topology import accumulation_steps
from nereus_jax.elastic.weight_sync import WeightSync
from nereus_jax.model_stage import ACTOR_GEN, ACTOR_TRAIN, REWARD_INFER, ModelStage, stage_decl
from nereus_jax.models import forward
from nereus_jax.models.lora import base_config
from nereus_jax.models.peft import adapter_source
from nereus_jax.models.vocab import DEFAULT_VOCAB_CHUNK
from nereus_jax.rl import packing
from nereus_jax.runtime.platform.device_memory import device_bytes_in_use, program_extra_bytes, release_host_memory
from nereus_jax.runtime.step import losses
from nereus_jax.runtime.step.initial_plan import job_stages, predicted_peak
from nereus_jax.sharding import device_index, make_mesh
from nereus_jax.sharding.pipeline import check_schedule, pipeline_axis, pipeline_forward_fn


class JobError(ValueError):
    """A job that cannot start: the message names the input and the fix. Raised before any compute."""


class StageState:
    """Every model-stage's units, specs and compiled programs under one execution plan, and the policy version.

    Built in two steps, as the job's inputs are checked: the constructor checks the plan against the devices
    and the step's rows and reads the specs (and the reward model's); :meth:`place` lays every model-stage out
    from its source. ``move_state(graph)`` runs a transition graph on the job's units (parking goes through it:
    :func:`nereus_jax.runtime.step.move.move` is the one way state moves)."""

    def __init__(self, cfg: Config, devices: Sequence[jax.Device], plan: ExecutionPlan,
                 move_state: Callable[[TransitionGraph], Any]):
        self.cfg, self.devices, self.plan = cfg, list(devices), plan
        _check_plan_devices(self.plan, len(self.devices))
        self.P, self.R = cfg.rollout.max_prompt_length, cfg.rollout.max_response_length
        self.rows = cfg.trainer.prompts_per_step * cfg.rollout.samples_per_prompt
        self.mini_rows = self.rows // cfg.trainer.mini_batches  # rows of one optimizer update
        _check_rows(self.plan, self.rows, self.mini_rows)
        self.specs = _specs(cfg)
        # LoRA: stages whose units hold the frozen base identically share its buffers (elastic/shared_base.py)
        self.share_groups = share_groups(job_stages(cfg), bool(cfg.model.lora_rank) and cfg.plan.share_frozen_base,
                                         critic_from_actor=cfg.model.critic_hf_path is None)
        self.reward_model = _reward_model(cfg, self.specs) if cfg.task.reward_model_path else None
        self.version = 0
        self.units: dict[ModelStage, list[EMU]] = {}
        self.sync: WeightSync | None = None
        self.programs: dict[Any, Any] = {}
        self.signatures: dict[Any, dict[str, tuple]] = {}  # program -> its host inputs' (shape, dtype)
        self.peak_bytes = 0  # the largest peak per device a program reached (see run); the job resets it a step
        self._extra_bytes: dict[Any, int] = {}  # program -> its bytes per device beyond its inputs
        self._predicted: dict[ExecutionPlan, float] = {}
        self._move_state = move_state

    def place(self, actor: ParamSource) -> None:
        """Every model-stage laid out in its plan straight from its source (each device reads its shard), and
        the weight sync between them."""
        if self.cfg.model.lora_rank:  # the adapters: from model.lora_path, the tree given, or fresh (B = 0)
            actor = adapter_source(self.cfg.model, actor, self.cfg.trainer.seed)
        # by the parameters a unit starts from (elastic/topology.py, StageDecl.state); LoRA: "base" reads the
        # actor's source without its adapters (the stage's StateSpec has none)
        sources = {"actor": lambda: actor, "base": lambda: actor, "critic": lambda: _critic_source(self.cfg, actor),
                   "reward-model": lambda: self.reward_model}
        units = {}
        for ms in job_stages(self.cfg):
            sp = self.plan[ms]
            replicas = [[self.devices[i] for i in r] for r in sp.replicas]
            source = sources[stage_decl(str(ms)).state]()
            units[ms] = units_from_source(ms, self.unit_spec(ms), sp.layout, replicas, source)
        self.units = self._share(units)
        self.sync = self.weight_sync(self.plan)

    def weight_sync(self, plan: ExecutionPlan, keep_old: bool = False) -> WeightSync:
        """The actor-train -> actor-gen weight sync of ``plan`` under the cluster's memory caps; ``keep_old``
        (async mode's double buffer) keeps the generating units intact while the new ones are derived. The one
        place the runtime builds one (sync mode's, a move's check, async mode's per plan)."""
        return WeightSync(plan, self.specs[ACTOR_TRAIN], self.specs[ACTOR_GEN],
                          caps=self.cfg.cluster.device_memory_bytes, keep_old=keep_old)

    def unit_spec(self, ms: ModelStage, plan: ExecutionPlan | None = None) -> StateSpec:
        """What each unit of ``ms`` holds in ``plan`` (default: the current one): its StateSpec, with the
        optimizer split over the replicas where ``plan.shard_optimizer`` does so (``StateSpec.for_dp``)."""
        return self.specs[ms].for_dp((plan or self.plan)[ms].dp)

    # ------------------------------------------------------------------------------ plan changes
    def check_plan(self, plan: ExecutionPlan) -> WeightSync:
        """Raises (JobError naming the fix, or the weight sync's Infeasible) unless the job can run ``plan``:
        it places the job's model-stages on devices that exist, an engine's replica stays in one process and
        has pp=1, every scoring and training stage's dp divides the
        rollouts of a step (a training stage's, a mini-batch's), the weight sync fits the caps.
        Returns that weight sync. Nothing changes, so a move checks its target before any state moves."""
        _check_plan_devices(plan, len(self.devices))
        _check_rows(plan, self.rows, self.mini_rows)
        if set(plan) != set(self.plan):
            raise JobError(f"the plan holds model-stages {sorted(map(str, plan))}, the job runs "
                           f"{sorted(map(str, self.plan))}: a plan for this job places exactly its model-stages")
        if plan[ACTOR_GEN].layout.pp != 1:
            raise JobError(f"actor-gen's layout {plan[ACTOR_GEN].layout} has pp={plan[ACTOR_GEN].layout.pp}: the "
                           "engines generate with pp=1; use tp for a larger actor-gen replica")
        return self.weight_sync(plan)

    def prepare_programs(self, plan: ExecutionPlan, changed_only: bool = True) -> dict[Any, Any]:
        """The training and scoring programs ``plan`` needs, lowered and compiled for its shardings ahead of
        time from the input signatures of the steps run so far (a stage whose devices and layout stay keeps
        its programs; ``changed_only=False`` compiles those too, e.g. to read the current plan's compiled
        programs). Touches nothing: safe on a background thread while the current plan keeps stepping."""
        _check_plan_devices(plan, len(self.devices))
        _check_rows(plan, self.rows, self.mini_rows)
        programs = {}
        for (kind, ms, *rest), signature in list(self.signatures.items()):
            if ms not in plan or (changed_only and ms in self.plan and plan[ms] == self.plan[ms]):
                continue  # same devices and layout: the current programs run as they are
            mesh = _plan_mesh(plan[ms], self.devices)
            accum = self.accum(kind, plan[ms].dp)
            mini = self.cfg.trainer.mini_batches if kind == "train" else None
            micro = _abstract_micro(signature, accum, mesh, mini)
            spec = self.unit_spec(ms, plan)
            leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                      for a, sh in zip(spec.global_abstract(plan[ms].layout), spec.shardings(mesh), strict=True)]
            if kind == "train":
                fn = self.train_program(ms, spec, mesh)
                args = (*self.train_args(spec, leaves), micro)
                programs[self.key("train", ms, mesh, accum, _signature(args))] = fn.lower(*args).compile()
            else:
                fn = self.infer_program(ms, rest[0], mesh)
                params = spec.unflatten(leaves)["params"]
                key = self.key("infer", ms, mesh, accum, rest[0], _signature((params, micro)))
                programs[key] = fn.lower(params, micro).compile()
        return programs

    def adopt(self, plan: ExecutionPlan, units: dict[ModelStage, list[EMU]], sync: WeightSync,
              programs: dict[Any, Any]) -> None:
        """Switch to ``plan`` whose state is ``units``, with its weight sync and its programs compiled ahead."""
        self.plan, self.units, self.sync = plan, self._share(units), sync
        self.programs.update(programs)

    def load_state(self, units: dict[ModelStage, list[EMU]], version: int) -> None:
        """Replaces the units (laid out in ``self.plan``) and the policy version, e.g. from a checkpoint."""
        if set(units) != set(self.units):
            raise JobError(f"load_state: model-stages {sorted(map(str, units))} differ from the job's "
                           f"{sorted(map(str, self.units))}")
        self.units, self.version = self._share(units), version

    def replace(self, ms: ModelStage, units: list[EMU] | Any, share: bool = True) -> None:
        """Replaces ``ms``'s units in the current plan: a training step's new state, the generation units a weight
        sync built, a move's placeholder and its result. The runtime writes a stage's units only here (placement,
        :meth:`adopt` and :meth:`load_state` replace them all); tests/test_import_graph.py checks the code for
        other writers. With LoRA the new units' frozen base is shared with the other stages' where they hold it
        identically; not when they hold the replaced units' own frozen arrays (an adapter-only weight sync), nor
        with ``share=False`` (the caller knows they hold the same buffers as before, e.g. a training step's, which
        passes the frozen leaves through)."""
        old, self.units[ms] = self.units.get(ms), units
        if share and ms in self.share_groups and isinstance(units, list) and not _same_base(old, units):
            for other, us in self._share(self.units).items():  # in place: another thread may hold the dict
                if us is not self.units[other]:
                    self.units[other] = us

    def _share(self, units: dict[ModelStage, Any]) -> dict[ModelStage, Any]:
        """``units`` (all stages) with LoRA's frozen base shared where units hold it identically; the first
        holder in run order keeps its arrays."""
        if not self.share_groups:
            return dict(units)
        return share_frozen(units, self.share_groups)

    def held_outside(self, *stages: ModelStage) -> list[EMU]:
        """With LoRA's shared base: the units of every model-stage but ``stages`` (none that a move holds), which
        an executor working on ``stages``' units must leave intact (``TransitionExecutor.run(keep=...)``)."""
        if not self.share_groups:
            return []
        return [u for ms, us in self.units.items() if ms not in stages and isinstance(us, list) for u in us]

    def frozen_index(self, spec: StateSpec) -> list[int]:
        """Positions of ``spec``'s frozen parameter leaves (LoRA's base in a training stage; none without LoRA):
        the training program takes them apart and neither donates nor returns them, so a unit that shares them
        keeps them."""
        if not spec.model.lora_rank:
            return []
        return [i for i, _ in frozen_leaves(spec)]

    # ------------------------------------------------------------------------------ parking
    def use(self, ms: ModelStage) -> list[EMU]:
        """The stage's units on device, onloading them first if they are parked."""
        if self.units[ms][0].memory != DEVICE:
            self._move(ms, HOST, DEVICE)
        return self.units[ms]

    def park(self, ms: ModelStage) -> None:
        """With plan.park_idle: offload an idle stage's state to host memory (pinned_host). Not a stage whose every
        buffer another stage's units hold too (LoRA's reference on the shared base): that would free nothing."""
        if self.cfg.plan.park_idle and ms != ACTOR_GEN and self.units[ms][0].memory == DEVICE \
                and not self._wholly_shared(ms):
            self._move(ms, DEVICE, HOST)

    def _wholly_shared(self, ms: ModelStage) -> bool:
        if ms not in self.share_groups:
            return False
        others = held_buffers(u for other, us in self.units.items() if other != ms and isinstance(us, list)
                              for u in us if u.memory == DEVICE)
        return held_buffers(self.units[ms]) <= others

    def _move(self, ms: ModelStage, src: str, dst: str) -> None:
        sp = self.plan[ms]
        graph = self.program(("park", ms, src, dst), lambda: TransitionGraph.build(
            ExecutionPlan({ms: dataclasses.replace(sp, memory=src)}),
            ExecutionPlan({ms: dataclasses.replace(sp, memory=dst)}), {ms: self.specs[ms]}))
        self._move_state(graph)

    # ------------------------------------------------------------------------------ programs and their inputs
    def stage_inputs(self, ms: ModelStage, data: dict, program: tuple, mini: int | None = None):
        """The stage's replicas as one SPMD state, and ``data`` ([rows, ...] host arrays) as token-budget
        micro-batches on its mesh (``mini``: split into mini-batches first), padded or, with
        ``trainer.packing``, packed (:mod:`nereus_jax.rl.packing`). Returns (leaves, mesh, program key, micro,
        layout): ``layout`` is the packing layout (None: padded, rows as given). Records padded inputs'
        signature under ``program`` so :meth:`prepare_programs` can compile it ahead."""
        leaves, mesh = assemble_replicas(self.use(ms))
        kind, dp = program[0], mesh.shape["dp"]
        if not self.cfg.trainer.packing:
            self.signatures[program] = {k: (np.shape(v), np.asarray(v).dtype) for k, v in data.items()}
            accum = self.accum(kind, dp)
            host = losses.split_micro(data, accum) if mini is None else losses.split_minibatches(data, mini, accum)
            return leaves, mesh, self.key(kind, ms, mesh, accum, *program[2:]), _put(host, mesh, mini), None
        layout = packing.pack(data["tokens"], data["mask"], prompt_len=self.P, mini=mini or 1, dp=dp,
                              budget_rows=self.cfg.trainer.micro_batch_tokens // (self.P + self.R))
        host = losses.split_packed(data, layout, mini)
        key = self.key(kind, ms, mesh, layout.accum, "packed", *program[2:])
        return leaves, mesh, key, _put(host, mesh, mini), layout

    def accum(self, kind: str, dp: int) -> int:
        """Micro-batches per program call: an update's rows (train: a mini-batch) over dp in the token budget."""
        rows = self.mini_rows if kind == "train" else self.rows
        return accumulation_steps(rows, dp, self.P + self.R, self.cfg.trainer.micro_batch_tokens)

    @staticmethod
    def key(kind: str, ms: ModelStage, mesh, accum: int, *rest) -> tuple:
        """Programs are bound to devices (their shardings name them): the key holds the mesh's device ids."""
        return (kind, ms, mesh.devices.shape, tuple(device_index(d) for d in mesh.devices.flat), accum, *rest)

    def program(self, key, build):
        """The program under ``key``, built by ``build()`` the first time."""
        if key not in self.programs:
            self.programs[key] = build()
        return self.programs[key]

    def predicted_peak_bytes(self) -> float:
        """The memory model's peak per device of the current plan on the configured worst case (every prompt
        and response at its maximum: a padded program's shapes), as the planner and the memory trigger see it."""
        if self.plan not in self._predicted:
            self._predicted[self.plan] = predicted_peak(self.cfg, self.plan)[0]
        return self._predicted[self.plan]

    def run(self, key, build, *args):
        """Calls the program under ``key`` and the shapes of ``args`` (``build()``'s jitted function, compiled
        for them the first time, or one compiled ahead by :meth:`prepare_programs`) and records the peak bytes
        it reaches on its busiest device in ``peak_bytes``: what the device held when it started plus the
        program's temporaries and new outputs
        (:func:`~nereus_jax.runtime.platform.device_memory.program_extra_bytes`)."""
        key = (*key, _signature(args))  # a packed batch's shapes vary from step to step: one program each
        program = self.programs.get(key)
        if program is None:
            program = self.programs[key] = build().lower(*args).compile()
        if key not in self._extra_bytes:
            self._extra_bytes[key] = program_extra_bytes(program)
        devices = [self.devices[i] for i in key[3]]
        if key[0] == "train":  # the step's largest working set: CPU devices start it without the allocator's idle pages
            release_host_memory(devices)
        held = device_bytes_in_use(devices)
        self.peak_bytes = max(self.peak_bytes, max(held.values(), default=0) + self._extra_bytes[key])
        return program(*args)

    def infer_program(self, ms: ModelStage, what: str, mesh):
        """The scoring program of ``ms`` on ``mesh`` (:func:`infer_program`; actor-infer replays the recorded
        routes with ``algorithm.routing_replay``)."""
        return infer_program(self.specs[ms].model, self.P, what, stage_forward(mesh, self.specs[ms].kind),
                             vocab_chunk=self.cfg.trainer.vocab_chunk,
                             replay=ms == ACTOR_TRAIN and self.cfg.algorithm.routing_replay)

    def train_program(self, ms: ModelStage, spec: StateSpec, mesh):
        """One training step of ``ms`` on ``mesh``: mini_batches x ppo_epochs optimizer updates (donates the state)."""
        a, m = self.cfg.algorithm, self.cfg.model
        if ms.role == "actor":
            make_loss = functools.partial(losses.actor_loss, m, a, self.P, vocab_chunk=self.cfg.trainer.vocab_chunk)
        else:
            make_loss = functools.partial(losses.critic_loss, m, a, self.P)
        grad_fn = stage_value_and_grad(mesh, spec.kind, make_loss, self.cfg.trainer.pipeline_schedule)
        pins = None
        if spec.shards > 1:  # forward, backward and gradients as without the split (see make_train_step)
            pins = jax.tree.unflatten(spec.params_def, spec.shardings(mesh)[: spec.n_params])
        step = losses.make_minibatch_train_step(None, spec.optimizer, m, epochs=self.cfg.trainer.ppo_epochs,
                                               value_and_grad=grad_fn, param_shardings=pins)

        frozen = self.frozen_index(spec)
        shardings = [sh for i, sh in enumerate(spec.shardings(mesh)) if i not in frozen]

        def program(updated, frozen_leaves, micro):
            state = spec.unflatten(_merge_leaves(updated, frozen_leaves, frozen))
            params, opt, metrics = step(state["params"], state["opt"], micro)
            out = spec.flatten({"params": params, "opt": opt})
            return [x for i, x in enumerate(out) if i not in frozen], metrics

        # the frozen leaves (LoRA's base) are read, never donated nor returned: other stages may share them
        return jax.jit(program, donate_argnums=0, out_shardings=(shardings, None))

    def train_args(self, spec: StateSpec, leaves: Sequence[Any]) -> tuple[list, list]:
        """A training program's state arguments: (the leaves it updates and donates, the frozen ones)."""
        frozen = set(self.frozen_index(spec))
        return ([x for i, x in enumerate(leaves) if i not in frozen], [leaves[i] for i in sorted(frozen)])

    def train_result(self, spec: StateSpec, leaves: Sequence[Any], updated: Sequence[Any]) -> list:
        """The whole state after a training program: its ``updated`` leaves, and ``leaves``' frozen ones as they
        were (the same buffers)."""
        frozen = self.frozen_index(spec)
        return _merge_leaves(updated, [leaves[i] for i in frozen], frozen)


def _same_base(old: Any, new: list[EMU]) -> bool:
    """Whether ``new`` units hold ``old``'s frozen arrays themselves (same places, the same array objects)."""
    if not isinstance(old, list) or len(old) != len(new):
        return False
    return all(a.devices == b.devices and a.spec is b.spec and all(a.leaves[i] is b.leaves[i] for i, _ in
                                                                     frozen_leaves(a.spec))
               for a, b in zip(old, new, strict=True))


def _merge_leaves(updated: Sequence[Any], frozen: Sequence[Any], where: Sequence[int]) -> list:
    """One list of state leaves from the ``updated`` ones and the ``frozen`` ones, which go at positions ``where``."""
    out, rest, fixed = [], iter(updated), dict(zip(where, frozen, strict=True))
    for i in range(len(updated) + len(frozen)):
        out.append(fixed[i] if i in fixed else next(rest))
    return out


def _put(host: dict, mesh, mini: int | None) -> dict:
    return losses.put_micro(host, mesh) if mini is None else losses.put_minibatches(host, mesh)


def _specs(cfg: Config) -> dict[ModelStage, StateSpec]:
    """Each model-stage the job places, but reward-infer (:func:`_reward_model`: its architecture is its
    checkpoint's): its StateSpec, by the parameters its units start from (``StageDecl.state``)."""
    m, zero = cfg.model, cfg.plan.shard_optimizer
    specs = {}
    for ms in job_stages(cfg):
        state = stage_decl(str(ms)).state
        if state == "critic":
            specs[ms] = StateSpec(m, "train", head="value", optimizer=losses.make_optimizer(cfg.trainer.critic_lr),
                                  shard_optimizer=zero)
        elif state == "base":  # the reference: the actor without LoRA adapters
            specs[ms] = StateSpec(base_config(m), ms.kind, dtype=m.compute_dtype)
        elif state == "actor" and ms.kind == "train":
            specs[ms] = StateSpec(m, "train", optimizer=losses.make_optimizer(cfg.trainer.actor_lr),
                                  shard_optimizer=zero)
        elif state == "actor":
            specs[ms] = StateSpec(m, ms.kind, dtype=m.compute_dtype)
        elif state != "reward-model":
            raise JobError(f"model-stage {ms} is declared with state {state!r}: the runtime places units that start "
                           "from 'actor', 'base', 'critic' or 'reward-model' (elastic/topology.py, JOB_STAGES)")
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


def stage_value_and_grad(mesh, kind: str, make_loss: losses.MakeLoss, schedule: str = "1f1b") -> losses.GradFn:
    """What a stage's training program differentiates with on ``mesh`` (``make_loss(forward_fn)``: the loss):
    the 1F1B schedule over its pp axis when it has one and ``schedule`` is '1f1b'
    (:func:`~nereus_jax.runtime.step.losses.pipelined_value_and_grad`), else ``jax.value_and_grad`` through
    :func:`stage_forward` (GPipe when pp > 1). Both split a call into the micro-batch count the cost model
    prices; scoring programs keep :func:`stage_forward`."""
    if check_schedule(schedule) == "1f1b" and pipeline_axis(mesh, kind) is not None:
        return losses.pipelined_value_and_grad(make_loss, mesh, pipeline_microbatches, kind)
    return jax.value_and_grad(make_loss(stage_forward(mesh, kind)), has_aux=True)


def infer_program(cfg, prompt_len: int, what: str, forward_fn=forward, *, vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                  replay: bool = False):
    """A scoring stage over its micro-batches (padded or packed): log-probs or values [accum, b, R], or
    scores [accum, b]; log-probs over ``vocab_chunk``-wide vocabulary chunks. Log-probs of micro-batches that
    carry recorded routes (``routes``, a mixture-of-experts actor) are routed by them with ``replay`` and come
    with each response token's routing mismatches, ``(logprobs, mismatch, own mismatch)`` [accum, b, R] each
    (:func:`~nereus_jax.runtime.step.losses.route_mismatch`), and the token-expert pairs each expert got in each
    layer, [accum, layers, experts] (``RouterStats.counts_le``: the expert load the controller watches)."""
    def one(params, mb):
        if what == "scores":
            return losses.stage_scores(params, cfg, mb, forward_fn)
        if what == "values":
            return losses.stage_values(params, cfg, mb, prompt_len, forward_fn)
        routed = "routes" in mb or "packed_routes" in mb
        out = losses.response_stats(params, cfg, mb, prompt_len, forward_fn, vocab_chunk=vocab_chunk,
                                    replay=replay, routing=routed)
        return (out[0], *losses.route_mismatch(out[2]), out[2].counts_le) if routed else out[0]

    def program(params, micro):
        return jax.lax.map(lambda mb: one(params, mb), micro)

    return jax.jit(program)


def _plan_mesh(sp, devices: Sequence[jax.Device]):
    """The SPMD mesh of a stage's replicas, exactly as ``assemble_replicas`` builds it."""
    return make_mesh([devices[i] for r in sp.replicas for i in r], sp.layout, dp=sp.dp)


def _signature(args) -> tuple:
    """The structure, shapes and dtypes of a program's arguments (arrays or ShapeDtypeStructs): what a
    compiled executable is bound to beyond its key."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves)


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


def _check_plan_devices(plan: ExecutionPlan, available: int) -> None:
    """Raises JobError unless ``plan`` uses only devices 0..available-1 and keeps each engine in one process."""
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
    """Raises JobError unless every scoring and training stage's dp divides a step's rows (training: a
    mini-batch's)."""
    mini_rows = rows if mini_rows is None else mini_rows
    for ms, sp in plan.items():
        if ms.kind != "gen" and rows % sp.dp:
            raise JobError(f"{ms}: {rows} rollouts a step (trainer.prompts_per_step x rollout.samples_per_prompt) "
                           f"do not split over dp={sp.dp} replicas; choose a dp dividing {rows}")
        if ms.kind == "train" and mini_rows % sp.dp:
            raise JobError(f"{ms}: a mini-batch of {mini_rows} rollouts (a step's {rows} over trainer.mini_batches) "
                           f"does not split over dp={sp.dp} replicas; choose a dp dividing {mini_rows} or fewer "
                           "trainer.mini_batches")


