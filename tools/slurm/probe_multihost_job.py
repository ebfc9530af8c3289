"""Diagnostic, not part of the package: what the RL Job needs to run as 2 processes x 4 CPU devices.

The Job assumes one process in five places; this script patches each (FIX 1-5 below) and runs the tiny
PPO job for 3 steps. Measured on jax 0.12 (warm-started actor, colocated plan, actor-gen dp=2): both
processes print the same metrics and rollouts as one process with 8 devices (loss equal to 1.5e-8).
Once the fixes land in nereus_jax/elastic and nereus_jax/runtime/job.py, this script can go.

    FIX 1  elastic/emu.py view(): make_array_from_single_device_arrays takes this process's shards only
           (and needs dtype= when it has none)
    FIX 2  runtime/job.py generate(): run only the engines on this process's devices; share the rollouts
           from their owner (nereus_jax.runtime.distributed.share_from)
    FIX 3  runtime/job.py _infer(): np.asarray of a dp-sharded global output -> process_allgather
    FIX 4  elastic/executor.py and EMU.device_ids: plan ids are positions in jax.devices(), not Device.id
           (process 1's CPU devices have ids 2048..2051)
    FIX 5  elastic/ledger.py cross_check(): memory_stats() only of addressable devices

Run (two shells, or as below; WARM= an npz from the warm-start cache makes the steps non-trivial):

    for i in 0 1; do env -u XLA_FLAGS JAX_PLATFORMS=cpu NEREUS_COORDINATOR=127.0.0.1:12355 NEREUS_NUM_PROCESSES=2 \
        NEREUS_PROCESS_ID=$i NEREUS_LOCAL_DEVICES=4 timeout -s KILL 300 python tools/slurm/probe_multihost_job.py & done
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python tools/slurm/probe_multihost_job.py
"""
import os
import sys
import traceback
import types

from nereus_jax.runtime.distributed import initialize, share_from

initialize()  # before any JAX use

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import nereus_jax.elastic.emu as emu_mod  # noqa: E402
import nereus_jax.elastic.executor as ex_mod  # noqa: E402
import nereus_jax.elastic.ledger as ledger_mod  # noqa: E402
import nereus_jax.runtime.job as job_mod  # noqa: E402
from nereus_jax.sharding import Layout, make_mesh  # noqa: E402

ME = jax.process_index()
INDEX = {d: i for i, d in enumerate(jax.devices())}


def view(x_shards, shape, sharding, devices, dtype=None):
    """FIX 1: only this process's shards; dtype when it has none."""
    local = [x_shards[d] for d in devices if d.process_index == ME]
    if dtype is None and not local:
        dtype = next(iter(x_shards.values())).dtype if x_shards else np.float32  # probe only: callers pass it
    return jax.make_array_from_single_device_arrays(shape, sharding, local, dtype=dtype)


def assemble_replicas(units):
    first = units[0]
    devices = [d for u in units for d in u.devices]
    mesh = make_mesh(devices, first.layout, dp=len(units))
    leaves = []
    for i, sharding in enumerate(first.spec.shardings(mesh, first.memory)):
        shards = {}
        for u in units:
            shards.update(emu_mod.shards_by_device(u.leaves[i]))
        leaves.append(view(shards, first.leaves[i].shape, sharding, devices, first.leaves[i].dtype))
    return leaves, mesh


def split_replicas(leaves, mesh, stage, spec, memory="device"):
    layout = Layout(tp=mesh.shape["tp"], pp=mesh.shape["pp"])
    shards = [emu_mod.shards_by_device(x) for x in leaves]
    units = []
    for row in mesh.devices:
        devices = tuple(row.reshape(-1))
        sub = spec.shardings(make_mesh(devices, layout), memory)
        units.append(emu_mod.EMU(stage, layout, devices, [view(s, x.shape, sh, devices, x.dtype)
                                                          for s, x, sh in zip(shards, leaves, sub, strict=True)],
                                 spec, memory))
    return units


class _GlobalNumpy:
    """FIX 3: numpy whose asarray gathers a global array first."""

    def __getattr__(self, name):
        return getattr(np, name)

    def asarray(self, x, *args, **kwargs):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            x = multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x, *args, **kwargs)


class _Shared:
    """FIX 2: an engine that generates on its owning process only and shares the rollouts."""

    def __init__(self, gen):
        self.gen = gen

    def generate(self, prompts, sampling, prompt_ids):
        owner = self.gen.engine.mesh.devices.flat[0].process_index
        out = self.gen.generate(prompts, sampling, prompt_ids=prompt_ids) if owner == ME else None
        arrays = share_from(owner, None if out is None else [out.tokens, out.lengths, out.logprobs,
                                                             out.param_versions])
        return types.SimpleNamespace(tokens=arrays[0], lengths=arrays[1], logprobs=arrays[2],
                                     param_versions=arrays[3])


_generate = job_mod.Job.generate


def generate(self, problems, positions, temperature, n=None):
    engines = self._engines
    self._engines = [_Shared(g) for g in engines]
    try:
        return _generate(self, problems, positions, temperature, n)
    finally:
        self._engines = engines


_run_init, _cross_check = ex_mod._Run.__init__, ledger_mod.Ledger.cross_check


def run_init(self, ex, graph, units):
    _run_init(self, ex, graph, units)
    self.devices = dict(enumerate(jax.devices()))  # FIX 4


def patch() -> None:
    emu_mod.view = ex_mod.view = view
    emu_mod.assemble_replicas = job_mod.assemble_replicas = assemble_replicas
    emu_mod.split_replicas = job_mod.split_replicas = split_replicas
    job_mod.np = _GlobalNumpy()
    job_mod.Job.generate = generate
    emu_mod.EMU.device_ids = property(lambda self: tuple(INDEX[d] for d in self.devices))  # FIX 4
    ex_mod._Run.__init__ = run_init
    ledger_mod.Ledger.cross_check = lambda self, devices: _cross_check(  # FIX 5
        self, [d for d in devices if d.process_index == ME])


BASE = ["rollout.max_prompt_length=12", "rollout.max_response_length=8", "trainer.prompts_per_step=8",
        "rollout.samples_per_prompt=2", "trainer.actor_lr=1e-3", "trainer.critic_lr=1e-3", "logging.progress=false",
        "task.num_digits=1", "task.eval_size=16", "plan.stages.actor-gen.dp=2"]


def main() -> None:
    from nereus_jax.config import load_config
    from nereus_jax.models import abstract_params
    from nereus_jax.rl.tasks import make_task
    from nereus_jax.rl.tokenizer import CharTokenizer
    from nereus_jax.runtime.warmstart import load_params

    jax.config.update("jax_default_matmul_precision", "highest")
    if jax.process_count() > 1:
        patch()
    cfg = load_config(None, BASE + sys.argv[1:])
    warm = load_params(os.environ["WARM"], abstract_params(cfg.model)) if os.environ.get("WARM") else None
    job = job_mod.Job(cfg, make_task(cfg.task), CharTokenizer(), actor_params=warm)
    print(job.plan, flush=True)
    for s in range(3):
        r = job.step(s)
        shown = {k: r.metrics[k] for k in ("reward_mean", "kl", "loss", "value_loss", "policy_version")}
        print("STEP", s, shown, "response token sum", int(r.batch.response_br.sum()), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)  # a clean exit could wait on the other process forever
