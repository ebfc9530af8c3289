"""Checkpoints of a whole RL job that resume into any plan and device count (Orbax).

What is saved, per step directory ``DIR/<steps done>/``: ``state`` holds every model-stage's state in
canonical form (parameters and optimizer state of one replica, kv heads stored once: layout-independent),
and ``meta`` (JSON) the step, data position, policy version, plan, seeds, model config and the
controller's state. Saves are asynchronous (Orbax copies the arrays off the devices, then writes in a
background thread) and atomic (Orbax writes into a temporary directory and renames it when complete,
so a crash mid-save leaves the previous checkpoint as the latest one); the last ``keep`` are kept.

Restore reads every array straight into the shardings of the plan chosen for the devices present now
(all replicas of a model-stage at once, on the mesh (dp, pp, tp)), so a checkpoint written on 8 devices
resumes on 4 and the reverse. With several processes (jax.distributed) every process calls the same
functions; a checkpoint written by N processes resumes in M.

Stops: :class:`GracefulStop` turns SIGTERM / SIGINT into "finish the step, save, exit 0" (run_job).
Device failures are recovered in :mod:`nereus_jax.runtime.control.recovery` (from the survivors, else from the
last checkpoint through :func:`restore_job`).

    ckpt = Checkpointer(cfg.checkpoint.dir, every_steps=10, keep=2)
    ckpt.maybe_save(job, steps_done=10)               # async; ckpt.close() waits for the last one
    job, meta = restore_job(cfg, task, tok, "ckpts")  # the latest complete one; meta["step"] = next step
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from nereus_jax.config import Config
from nereus_jax.elastic.emu import EMU, assemble_replicas, split_replicas
from nereus_jax.elastic.plan import DEVICE, ExecutionPlan, StagePlan
from nereus_jax.elastic.sources import ZeroSource
from nereus_jax.model_stage import ACTOR_TRAIN, ModelStage
from nereus_jax.models import abstract_params
from nereus_jax.runtime.durability.export import export_dtype, tokenizer_dir
from nereus_jax.runtime.durability.orbax_errors import cause_line, quiet_failed_restore
from nereus_jax.runtime.step.initial_plan import job_stages, plan_from_config
from nereus_jax.runtime.step.job import DeviceLost, Job, JobError  # noqa: F401 - DeviceLost re-exported
from nereus_jax.sharding import Layout, make_mesh

FORMAT = 1
# model keys that may differ between the run that wrote a checkpoint and the run that resumes it
_MODEL_KEYS_FREE = ("name", "remat", "compute_dtype", "hf_path", "critic_hf_path")


class CheckpointError(JobError):
    """A checkpoint that cannot be resumed here: the message names the checkpoint, the problem and the fix."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read or whose arrays do not match the checksums written with them."""


# ------------------------------------------------------------------------------------------- saving
class Checkpointer:
    """Saves a job every ``every_steps`` steps (0 = only when asked) into ``directory``, keeping ``keep``."""

    def __init__(self, directory: str, *, every_steps: int = 0, keep: int = 2, async_save: bool = True,
                 export_hf: bool = False):
        """``export_hf``: every save also writes ``<step>/hf``, the actor as a Hugging Face checkpoint (the
        save is then waited for, so the export lands in the finished step folder)."""
        self.directory, self.every_steps, self.export_hf = os.path.abspath(directory), every_steps, export_hf
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def due(self, steps_done: int) -> bool:
        return self.every_steps > 0 and steps_done > 0 and steps_done % self.every_steps == 0

    def maybe_save(self, job: Job, steps_done: int, *, controller: Mapping[str, Any] | None = None) -> bool:
        """Saves when ``steps_done`` is a multiple of ``every_steps``; True if a save started."""
        return self.save(job, steps_done, controller=controller) if self.due(steps_done) else False

    def save(self, job: Job, steps_done: int, *, controller: Mapping[str, Any] | None = None,
             wait: bool = False) -> bool:
        """Starts saving ``job`` after ``steps_done`` steps (the step it resumes at) with the controller's state
        (``Adapter.state_dict()``, or None without one); ``wait``: until written."""
        if steps_done in self.manager.all_steps():
            return False  # this step's state is already saved (e.g. the periodic save, then a stop)
        if jax.process_count() == 1:
            state = {str(ms): stage_canonical_leaves(units) for ms, units in job.units.items()}
        else:
            state = {str(ms): shared_host_leaves(units) for ms, units in job.units.items()}
        _check_finite(state)
        meta = _to_json({**job_metadata(job, steps_done, controller),
                         "checksums": {k: checksums(v) for k, v in state.items()}})
        self.manager.save(steps_done, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                              meta=ocp.args.JsonSave(meta)))
        if wait or self.export_hf:
            self.wait()
        if self.export_hf:
            from nereus_jax.runtime.durability.export import export_actor

            export_actor(job, os.path.join(self.directory, str(steps_done), "hf"))
        return True

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def close(self) -> None:
        """Waits for the save in flight, then releases Orbax's threads."""
        self.manager.wait_until_finished()
        self.manager.close()


def _check_finite(state: Mapping[str, list]) -> None:
    """A checkpoint is never written from non-finite weights (it would rotate the last good one away)."""
    for name, leaves in state.items():
        floats = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
        finite = bool(_all_finite(floats)) if isinstance(floats[0], jax.Array) else all(
            np.isfinite(x).all() for x in floats)
        if not finite:
            raise CheckpointError(f"refusing to checkpoint: {name}'s state holds non-finite values (NaN or inf); the "
                                  "checkpoints already written are kept. Lower the learning rate and resume from "
                                  "the last one")


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def canonical_leaves(unit: EMU) -> list[jax.Array]:
    """The unit's state leaves with each kv head stored once (the layout-independent form), on device."""
    leaves = unit.leaves
    if unit.memory != DEVICE:
        leaves = jax.device_put(leaves, unit.spec.shardings(unit.mesh, DEVICE))
    rep = unit.spec.repeat(unit.layout)
    if rep == 1:
        return list(leaves)
    return _repeat_kv(unit.spec, rep, 1, leaves, [NamedSharding(unit.mesh, PartitionSpec())] * len(leaves))


def stage_canonical_leaves(units: Sequence[EMU]) -> list[jax.Array]:
    """A model-stage's state in the layout-independent form (:func:`canonical_leaves` of one replica), on
    device; where the optimizer is split over the replicas, all of them together (its leaves stay split over
    dp: no device holds the whole of it)."""
    first = units[0]
    if first.spec.shards == 1:
        return canonical_leaves(first)
    if first.memory != DEVICE:
        units = [dataclasses.replace(u, leaves=jax.device_put(u.leaves, u.spec.shardings(u.mesh, DEVICE)),
                                     memory=DEVICE) for u in units]
    leaves, mesh = assemble_replicas(units)
    rep = first.spec.repeat(first.layout)
    if rep == 1:
        return leaves
    out = [NamedSharding(mesh, PartitionSpec(*(a if a == "dp" else None for a in leaf.spec)))
           for leaf in first.spec.global_leaves]
    return _repeat_kv(first.spec.whole, rep, 1, leaves, out)


def _repeat_kv(spec, rep_in: int, rep_out: int, leaves, out: Sequence) -> list[jax.Array]:
    """``leaves`` with each kv head stored ``rep_out`` times instead of ``rep_in``, laid out as ``out``: the
    spec's converter pinned at both ends, so every bit is kept (-0.0, subnormals, NaN payloads)."""
    convert = functools.partial(spec.converter(rep_in, rep_out), shardings=tuple(out),
                                sources=tuple(x.sharding for x in leaves))
    return jax.jit(convert, out_shardings=list(out))(list(leaves))


def shared_host_leaves(units: Sequence[EMU]) -> list[np.ndarray]:
    """Several processes: the canonical state as numpy on every process (Orbax writes it from process 0),
    read from a replica that one process holds and broadcast to the others. Orbax refuses arrays that live
    on one process only, which the replicas of a split plan do; this costs one host copy of the state.
    A replica spanning processes is gathered by all of them instead."""
    from jax.experimental import multihost_utils

    local = [u for u in units if len({d.process_index for d in u.devices}) == 1]
    if units[0].spec.shards > 1:  # the optimizer is split over the replicas: gathered from all of them
        host = multihost_utils.process_allgather(stage_canonical_leaves(units), tiled=True)
        return [np.asarray(x) for x in host]
    if not local:  # every replica spans processes: each process holds part of it
        host = multihost_utils.process_allgather(canonical_leaves(units[0]), tiled=True)
        return [np.asarray(x) for x in host]
    unit = local[0]
    owner = unit.devices[0].process_index
    if jax.process_index() == owner:
        leaves = [np.asarray(x) for x in canonical_leaves(unit)]
    else:
        leaves = [np.zeros(leaf.shape, leaf.dtype) for leaf in unit.spec.leaves]
    return [np.asarray(x) for x in multihost_utils.broadcast_one_to_all(leaves, is_source=jax.process_index() == owner)]


def job_metadata(job: Job, steps_done: int, controller: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything besides arrays that a resumed job needs to continue exactly where this one stopped
    (``controller``: the controller's state, ``Adapter.state_dict()``, when one runs the job)."""
    cfg = job.cfg
    model = cfg.model.to_dict()
    return {
        "format": FORMAT, "step": steps_done, "prompts_per_step": cfg.trainer.prompts_per_step,
        "data_position": steps_done * cfg.trainer.prompts_per_step, "policy_version": job.version,
        "plan": plan_to_json(job.plan), "num_devices": len(job.devices),
        "seeds": {"trainer": cfg.trainer.seed, "rollout": cfg.rollout.seed},
        "algorithm": cfg.algorithm.name, "model": model, "model_fingerprint": fingerprint(model),
        "export": {"dtype": export_dtype(cfg), "tokenizer_dir": tokenizer_dir(cfg), "eos_ids": list(job.tok.eos_ids),
                   "bos_id": job.tok.bos_id, "pad_id": job.tok.pad_id},
        "stages": {str(ms): [[list(leaf.shape), str(leaf.dtype)] for leaf in job.specs[ms].leaves]
                   for ms in job.units},
        "controller": None if controller is None else dict(controller),
        "schedules": _schedules(cfg),
        "process_count": jax.process_count(), "jax": jax.__version__, "written_at": time.time(),
    }


def _schedules(cfg: Config) -> dict[str, list]:
    """The staged budgets a resumed run must continue: the length schedule and the task curriculum."""
    return {"rollout.length_schedule": [s.to_dict() for s in cfg.rollout.length_schedule],
            "task.schedule": [s.to_dict() for s in cfg.task.schedule]}


def fingerprint(model: Mapping[str, Any]) -> str:
    """A hash of the model config keys that decide what the saved arrays mean."""
    kept = {k: v for k, v in sorted(model.items()) if k not in _MODEL_KEYS_FREE}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def plan_to_json(plan: ExecutionPlan) -> dict[str, Any]:
    return {str(ms): {"tp": sp.layout.tp, "pp": sp.layout.pp, "ep": sp.layout.ep,
                      "replicas": [list(r) for r in sp.replicas], "memory": sp.memory} for ms, sp in plan.items()}


def plan_from_json(data: Mapping[str, Any]) -> ExecutionPlan:
    return ExecutionPlan({ModelStage.parse(k): StagePlan(Layout(tp=v["tp"], pp=v["pp"], ep=v.get("ep", 1)),
                                                         tuple(tuple(r) for r in v["replicas"]), v["memory"])
                          for k, v in data.items()})


def _to_json(data: Any) -> Any:
    """JSON-safe copy (numpy scalars and arrays become numbers and lists; tuples become lists)."""
    return json.loads(json.dumps(data, default=_json_default))


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic | np.ndarray):
        return x.tolist()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    if isinstance(x, ExecutionPlan):
        return plan_to_json(x)
    raise TypeError(f"checkpoint metadata: cannot store a {type(x).__name__} as JSON ({x!r:.80})")


# ------------------------------------------------------------------------------------------ finding
def locate(path: str) -> tuple[str, int]:
    """(checkpoint root, step) for ``path``: a root (its latest complete step) or one step's directory."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist: give a checkpoint folder "
                              "(checkpoint.dir of the earlier run, or one of its step folders)")
    name = os.path.basename(path)
    if name.isdigit() and os.path.isdir(os.path.join(path, "meta")):
        return os.path.dirname(path), int(name)
    steps = complete_steps(path)
    if not steps:
        partial = [n for n in os.listdir(path) if "tmp" in n]
        why = f" (only unfinished saves: {partial})" if partial else ""
        raise CheckpointError(f"no complete checkpoint in {path!r}{why}: resume from another folder or start "
                              "fresh by dropping checkpoint.resume_from")
    return path, steps[-1]


def complete_steps(directory: str) -> list[int]:
    """The steps saved completely under ``directory`` (a checkpoint root), in order; [] when it does not exist."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def read_metadata(path: str) -> dict[str, Any]:
    """The JSON metadata of the checkpoint at ``path`` (root or step folder)."""
    root, step = locate(path)
    file = os.path.join(root, str(step), "meta", "metadata")
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {os.path.join(root, str(step))!r} is incomplete or damaged "
                              f"(metadata: {e}): delete that folder to resume from the one before, or point "
                              "checkpoint.resume_from at an older step folder") from None
    meta["_root"], meta["_step_dir"] = root, os.path.join(root, str(step))
    return meta


def check_compatible(cfg: Config, meta: Mapping[str, Any]) -> None:
    """Raises CheckpointError when ``cfg`` describes another job than the one that wrote ``meta``."""
    where = meta["_step_dir"]
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {where!r} has format {meta.get('format')}, this version reads {FORMAT}")
    model = cfg.model.to_dict()
    if fingerprint(model) != meta["model_fingerprint"]:
        diff = sorted(k for k in set(model) | set(meta["model"]) if k not in _MODEL_KEYS_FREE
                      and model.get(k) != meta["model"].get(k))
        shown = ", ".join(f"model.{k}={meta['model'].get(k)!r} (config: {model.get(k)!r})" for k in diff)
        raise CheckpointError(f"checkpoint {where!r} was written by another model shape: {shown}; resume with the "
                              "checkpoint's model config or start fresh")
    stages = sorted(str(ms) for ms in job_stages(cfg))
    if sorted(meta["stages"]) != stages:
        raise CheckpointError(f"checkpoint {where!r} holds model-stages {sorted(meta['stages'])} but "
                              f"algorithm.name={cfg.algorithm.name} needs {stages}: resume with "
                              f"algorithm.name={meta['algorithm']}")
    for key, saved in meta.get("schedules", {}).items():
        if _schedules(cfg)[key] != saved:
            raise CheckpointError(f"checkpoint {where!r} was written with {key}={saved}, the config has "
                                  f"{_schedules(cfg)[key]}: resume with the saved schedule so the run continues it")
    for key, now, then in (("trainer.prompts_per_step", cfg.trainer.prompts_per_step, meta["prompts_per_step"]),
                           ("rollout.seed", cfg.rollout.seed, meta["seeds"]["rollout"])):
        if now != then:
            raise CheckpointError(f"checkpoint {where!r} was written with {key}={then}, the config has {now}: "
                                  f"set {key}={then} so no sample is skipped, repeated or drawn differently")


# ---------------------------------------------------------------------------------------- restoring
def choose_plan(cfg: Config, meta: Mapping[str, Any], devices: int) -> ExecutionPlan:
    """The checkpoint's own plan when the device count is the one it was written on, else the config's
    plan for the ``devices`` present now (the controller may move from there)."""
    if meta["num_devices"] == devices:
        return plan_from_json(meta["plan"])
    return plan_from_config(cfg, list(range(devices)))


def restore_job(cfg: Config, task, tokenizer, path: str, *, plan: ExecutionPlan | None = None,
                devices: Sequence[jax.Device] | None = None, rewarder=None,
                log=None) -> tuple[Job, dict[str, Any]]:
    """A Job on ``devices`` (default: the config's) with the state of the checkpoint at ``path`` laid out in
    ``plan`` (default: :func:`choose_plan`); returns (job, metadata). ``meta["step"]`` is the next step.

    ``path`` a checkpoint root: its newest complete step, and if that one is damaged (unreadable files, or an
    array that does not match its checksum) the one before, with a warning through ``log``, unless
    ``checkpoint.strict_resume`` (then the damage is the error). A step folder: that step only."""
    return _newest_readable(cfg, path, log, lambda where: _restore_step(cfg, task, tokenizer, where, plan, devices,
                                                                      rewarder))


def restore_onto(job: Job, path: str, plan: ExecutionPlan, *, log=None) -> dict[str, Any]:
    """Restores the checkpoint at ``path`` (as :func:`restore_job` picks its step) into ``job`` itself, laid out
    in ``plan`` on the job's devices: device-loss recovery's fallback, so no loop holding the job ever sees
    it replaced. The job adopts ``plan`` (engines rebuilt where actor-gen's devices or layout change) and the
    checkpoint's policy version; returns the metadata (``meta["step"]``: the next step). Either the job runs
    ``plan`` with the checkpoint's state, or, on an error (a damaged checkpoint, a plan it cannot run), it is
    left as it was."""
    return _newest_readable(job.cfg, path, log, lambda where: _restore_step_onto(job, where, plan))


def _newest_readable(cfg: Config, path: str, log, read):
    """``read(step_dir)`` of the newest complete step under the root ``path`` (the one before it, with a warning
    through ``log``, when it is damaged, unless ``checkpoint.strict_resume``); a step folder: that step only."""
    root, step = locate(path)
    steps = [step] if os.path.basename(os.path.abspath(path)) == str(step) else _complete_steps(root)
    for i, candidate in enumerate(steps):
        try:
            return read(os.path.join(root, str(candidate)))
        except DamagedCheckpoint as e:
            if cfg.checkpoint.strict_resume or i == len(steps) - 1:
                raise
            if log is not None:
                log(f"warning: {e}; resuming from step {steps[i + 1]} instead (checkpoint.strict_resume=true stops)")
    raise AssertionError("unreachable: at least one step is tried")


def _complete_steps(root: str) -> list[int]:
    """The complete step folders under ``root``, newest first."""
    return sorted((int(n) for n in os.listdir(root) if n.isdigit() and os.path.isdir(os.path.join(root, n, "meta"))),
                  reverse=True)


def _restore_step(cfg, task, tokenizer, path, plan, devices, rewarder) -> tuple[Job, dict[str, Any]]:
    meta = read_metadata(path)
    check_compatible(cfg, meta)
    devices = list(devices or jax.devices()[: cfg.cluster.num_devices])
    plan = plan or choose_plan(cfg, meta, len(devices))
    _check_plan_fits(plan, len(devices), meta["_step_dir"])
    job = Job(cfg, task, tokenizer, actor=ZeroSource(abstract_params(cfg.model)), plan=plan, devices=devices,
              rewarder=rewarder)
    try:
        restore_into(job, meta)
    except BaseException:
        job.close()
        raise
    return job, meta


def restore_into(job: Job, meta: Mapping[str, Any]) -> None:
    """Reads the checkpoint described by ``meta`` into ``job``'s current plan. Either every model-stage's
    state is replaced (and the engines see the new parameters), or, on an error, nothing is."""
    install(job, _read_units(job, meta, job.plan), int(meta["policy_version"]))


def _restore_step_onto(job: Job, path: str, plan: ExecutionPlan) -> dict[str, Any]:
    meta = read_metadata(path)
    check_compatible(job.cfg, meta)
    _check_plan_fits(plan, len(job.devices), meta["_step_dir"])
    sync = job.check_plan(plan)
    units = _read_units(job, meta, plan)  # nothing of the job changes before this has read every array
    old = job.version
    job.version = int(meta["policy_version"])  # before adopt: engines built there are tagged with it
    try:
        job.adopt(plan, units, sync=sync)
    except BaseException:
        job.version = old
        raise
    job.learner.nonfinite, job.learner.nonfinite_since = 0, None  # the steps of a streak are redone
    return meta


def _read_units(job: Job, meta: Mapping[str, Any], plan: ExecutionPlan) -> dict[ModelStage, list[EMU]]:
    """The checkpoint described by ``meta`` read into units laid out in ``plan`` (checked against its
    checksums); the job is not touched."""
    root, step = meta["_root"], meta["step"]
    targets = {str(ms): _targets(job, ms, plan) for ms in job.units}
    abstract = {k: [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s)
                    for leaf, s in zip(job.specs[ModelStage.parse(k)].leaves, sh, strict=True)]
                for k, (sh, _) in targets.items()}
    _check_shapes(meta, abstract)
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=False))
    try:
        with quiet_failed_restore():
            state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    except Exception as e:  # Orbax/tensorstore raise many types for missing or cut files
        raise DamagedCheckpoint(f"checkpoint {meta['_step_dir']!r} is incomplete or damaged ({cause_line(e)}): "
                                "delete that folder to resume from the one before, or point "
                                "checkpoint.resume_from at an older step folder") from e
    finally:
        manager.close()
    _verify(meta, state, job)
    return {ms: _units(job, ms, state[str(ms)], targets[str(ms)][1], plan) for ms in job.units}


def restore_actor(path: str) -> tuple[Any, dict, dict[str, Any]]:
    """(model config, canonical host parameters of actor-train, metadata) of the checkpoint at ``path``
    (a root or a step folder), read without devices of any particular count: what an export needs."""
    from nereus_jax._typed_tree import from_dict
    from nereus_jax.config import ModelConfig
    from nereus_jax.elastic.spec import StateSpec

    meta = read_metadata(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {meta['_step_dir']!r} has format {meta.get('format')}, this version "
                              f"reads {FORMAT}")
    key = str(ACTOR_TRAIN)
    try:
        model = from_dict(ModelConfig, meta["model"], "model")
        saved = meta["stages"][key]
    except (KeyError, TypeError) as e:
        raise DamagedCheckpoint(f"checkpoint {meta['_step_dir']!r} is damaged: its metadata lacks {e}; export an "
                                "older step folder") from None
    spec = StateSpec(model, "infer")
    if [list(leaf.shape) for leaf in spec.leaves] != [s for s, _ in saved[: spec.n_params]]:
        raise CheckpointError(f"checkpoint {meta['_step_dir']!r}: {key}'s saved shapes do not match its model config")
    cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    # the whole stage (Orbax's partial restore takes no prefix of a list): its optimizer state is read too
    item = {key: [jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=cpu) for shape, dtype in saved]}
    manager = ocp.CheckpointManager(meta["_root"], options=ocp.CheckpointManagerOptions(create=False))
    args = ocp.args.PyTreeRestore(item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True)
    try:
        with quiet_failed_restore():
            restored = manager.restore(meta["step"], args=ocp.args.Composite(state=args))["state"]
    except Exception as e:  # Orbax/tensorstore raise many types for missing or cut files
        raise DamagedCheckpoint(f"checkpoint {meta['_step_dir']!r} is incomplete or damaged ({cause_line(e)}): "
                                "export an older step folder") from e
    finally:
        manager.close()
    leaves = [np.asarray(x) for x in restored[key][: spec.n_params]]
    return model, spec.unflatten(leaves)["params"], meta


def checksums(leaves: Sequence[Any]) -> list[int]:
    """One uint32 per array over its raw bits and their positions (a flipped bit anywhere changes it):
    computed on device for device arrays, with numpy for host arrays, and equal for equal contents."""
    if leaves and isinstance(leaves[0], jax.Array):
        return [int(x) for x in np.asarray(_device_checksums(list(leaves)))]
    return [_host_checksum(np.asarray(x)) for x in leaves]


_MULTIPLIER = 2654435761  # Knuth's multiplicative hash constant: positions weigh differently


def _bits_uint32(x):
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    if x.dtype.itemsize == 8:  # a 64-bit leaf as two 32-bit halves
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).reshape(-1)


@jax.jit
def _device_checksums(leaves: list[jax.Array]) -> jax.Array:
    sums = []
    for x in leaves:
        bits = _bits_uint32(x)
        index = jax.lax.iota(jnp.uint32, bits.shape[0])
        sums.append(jnp.sum(bits * (index * jnp.uint32(_MULTIPLIER) + jnp.uint32(1)), dtype=jnp.uint32))
    return jnp.stack(sums) if sums else jnp.zeros((0,), jnp.uint32)


def _host_checksum(x: np.ndarray) -> int:
    raw = np.ascontiguousarray(x).reshape(-1)
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[raw.dtype.itemsize]
    bits = raw.view(view).astype(np.uint32)
    index = np.arange(bits.shape[0], dtype=np.uint64).astype(np.uint32)
    with np.errstate(over="ignore"):
        return int(np.sum(bits * (index * np.uint32(_MULTIPLIER) + np.uint32(1)), dtype=np.uint32))


def _verify(meta: Mapping[str, Any], state: Mapping[str, list], job: Job) -> None:
    """Compares every restored array with the checksum written with it; names the first that differs."""
    saved = meta.get("checksums")
    if saved is None:  # a checkpoint written without checksums: nothing to compare
        return
    for name, leaves in state.items():
        got = checksums(leaves)
        for i, (a, b) in enumerate(zip(got, saved[name], strict=True)):
            if a != b:
                spec = job.specs[ModelStage.parse(name)]
                raise DamagedCheckpoint(f"checkpoint {meta['_step_dir']!r}: array {_leaf_name(spec, i)} of {name} "
                                        f"does not match the checksum written with it (the file was changed or "
                                        "corrupted): delete that folder to resume from the one before")


def _leaf_name(spec, i: int) -> str:
    if i < spec.n_params:
        from nereus_jax.elastic.sources import param_paths

        return "/".join(param_paths(spec)[i])
    return f"optimizer state leaf {i - spec.n_params}"


def load_controller(adapter, job: Job, meta: Mapping[str, Any]) -> bool:
    """Gives ``adapter`` (the job's controller in the loop) the saved controller state, if the checkpoint has
    one and was written on as many devices as the job has (a controller's pool and references describe that
    cluster); True if so."""
    if meta.get("controller") is None:
        return False
    if meta["num_devices"] != len(job.devices):
        return False
    adapter.load_state_dict(meta["controller"])
    return True


def _targets(job: Job, ms: ModelStage, plan: ExecutionPlan) -> tuple[list[NamedSharding], Any]:
    """Shardings to read each canonical leaf into (on the stage's (dp, pp, tp) mesh in ``plan``) and the mesh."""
    sp, spec = plan[ms], job.unit_spec(ms, plan)
    mesh = make_mesh([job.devices[i] for i in sp.devices], sp.layout, dp=sp.dp)
    if spec.repeat(sp.layout) == 1:
        return spec.shardings(mesh), mesh
    return [NamedSharding(mesh, PartitionSpec())] * len(spec.leaves), mesh  # expanded after reading


def _check_shapes(meta: Mapping[str, Any], abstract: Mapping[str, list]) -> None:
    for k, leaves in abstract.items():
        saved = meta["stages"][k]
        want = [[list(x.shape), str(np.dtype(x.dtype))] for x in leaves]
        if [s for s, _ in saved] != [s for s, _ in want]:
            bad = next(i for i, (a, b) in enumerate(zip(saved, want, strict=False)) if a[0] != b[0]) \
                if len(saved) == len(want) else None
            what = f"leaf {bad}: saved {saved[bad][0]}, needed {want[bad][0]}" if bad is not None else \
                f"{len(saved)} saved leaves, {len(want)} needed"
            raise CheckpointError(f"checkpoint {meta['_step_dir']!r}: {k} has other shapes than this job's ({what}):"
                                  " it was written by another model or optimizer; resume with that config")


def _units(job: Job, ms: ModelStage, leaves: list[jax.Array], mesh, plan: ExecutionPlan) -> list[EMU]:
    sp, spec = plan[ms], job.unit_spec(ms, plan)
    rep = spec.repeat(sp.layout)
    if rep > 1:
        leaves = _repeat_kv(spec, 1, rep, leaves, spec.shardings(mesh))
    if sp.memory != DEVICE:
        leaves = jax.device_put(list(leaves), spec.shardings(mesh, sp.memory))
    return split_replicas(list(leaves), mesh, ms, spec, sp.memory)


def install(job: Job, units: dict[ModelStage, list[EMU]], version: int) -> None:
    """Replaces ``job``'s units (laid out in ``job.plan``) and policy version; the engines adopt the
    actor-gen parameters."""
    job.load_state(units, version)


def _check_plan_fits(plan: ExecutionPlan, available: int, where: str) -> None:
    missing = [d for d in plan.devices if d >= available]
    if missing:
        raise CheckpointError(f"resuming {where!r}: the plan uses devices {missing} but only devices "
                              f"0..{available - 1} exist: choose a plan for {available} devices (or drop it "
                              "to let the job choose one) or raise cluster.num_devices")


def latest_step(directory: str) -> int | None:
    """The latest complete step saved under ``directory`` (None when there is none)."""
    try:
        return locate(directory)[1]
    except CheckpointError:
        return None


# ------------------------------------------------------------------------------------ stops and faults
class GracefulStop:
    """Within ``with GracefulStop() as stop:``, SIGTERM / SIGINT set ``stop.signal`` (the signal's name)
    instead of ending the process, so the loop can finish its step and save; a second SIGINT raises
    KeyboardInterrupt as usual. The previous handlers come back on exit. Main thread only."""

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)):
        self.signals, self.signal, self._old = tuple(signals), None, {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def stop_agreed(stop: GracefulStop) -> bool:
    """Whether to stop after this step: this process's signal, or with several processes any process's
    (one tiny all-gather a step, so every process stops after the same step and saves together)."""
    if jax.process_count() == 1:
        return stop.requested
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(stop.requested))).any())


def checkpoint_dir(cfg: Config, run_dir: str) -> str:
    """checkpoint.dir, else RUN_DIR/checkpoints."""
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))


def resume_command(argv: Sequence[str], directory: str) -> str:
    """The command line that resumes a run started with ``argv`` (the train CLI's arguments)."""
    kept = [a for a in argv if not a.startswith("checkpoint.resume_from=")]
    return " ".join(["python -m nereus_jax.train", *kept, f"checkpoint.resume_from={directory}"])
