"""Multi-host start-up: every process runs the same program; JAX's multi-controller runtime joins them.

``initialize()`` must run before anything touches a JAX backend. It calls ``jax.distributed.initialize``
when the launch asks for several processes, and does nothing otherwise:

* under SLURM (``SLURM_NTASKS`` > 1): JAX reads the coordinator, process count and id from SLURM's
  environment (one task per node or per GPU; see tools/slurm/nereus.sbatch);
* with a coordinator address: ``NEREUS_COORDINATOR=host:port``, ``NEREUS_NUM_PROCESSES``,
  ``NEREUS_PROCESS_ID`` (or the same as arguments).

On CPU, ``NEREUS_LOCAL_DEVICES`` sets each process's device count and the collectives run over gloo.
``NEREUS_TRANSFER_ADDRESS=host:port`` (one per process) enables ``jax.device_put`` from one process's
devices to another's (what a transition moving a unit across hosts does); the sender must stay up until
the receiver has the data. Two processes x 4 CPU devices on one machine::

    for i in 0 1; do NEREUS_COORDINATOR=127.0.0.1:12355 NEREUS_NUM_PROCESSES=2 NEREUS_PROCESS_ID=$i \\
        NEREUS_LOCAL_DEVICES=4 NEREUS_TRANSFER_ADDRESS=127.0.0.1:1236$i JAX_PLATFORMS=cpu \\
        python -m nereus_jax.train ppo_tiny cluster.num_devices=8 & done

Every process runs the whole job; only process 0 writes the run directory (see nereus_jax/runtime/step/job.py
and adapt.py for what is shared: rollouts from the engines' owners, process 0's measurements).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

ENV_COORDINATOR, ENV_PROCESSES, ENV_ID, ENV_LOCAL, ENV_TRANSFER = (
    "NEREUS_COORDINATOR", "NEREUS_NUM_PROCESSES", "NEREUS_PROCESS_ID", "NEREUS_LOCAL_DEVICES",
    "NEREUS_TRANSFER_ADDRESS")


class DistributedError(RuntimeError):
    """A multi-process launch that is incomplete or inconsistent; the message names the variable to set."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process was started: ``source`` is "single", "env" (NEREUS_* variables) or "slurm"."""

    source: str
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    local_devices: int | None = None

    @property
    def multi(self) -> bool:
        return self.num_processes > 1


def detect(env: Mapping[str, str] | None = None) -> Launch:
    """Reads the launch from the environment (NEREUS_* first, then SLURM); "single" when neither applies."""
    env = os.environ if env is None else env
    local = int(env[ENV_LOCAL]) if env.get(ENV_LOCAL) else None
    if env.get(ENV_COORDINATOR):
        missing = [k for k in (ENV_PROCESSES, ENV_ID) if not env.get(k)]
        if missing:
            raise DistributedError(f"{ENV_COORDINATOR} is set but {', '.join(missing)} is not: set the process "
                                   "count and this process's id (0-based) too")
        n, i = int(env[ENV_PROCESSES]), int(env[ENV_ID])
        if not 0 <= i < n:
            raise DistributedError(f"{ENV_ID}={i} is outside 0..{n - 1} ({ENV_PROCESSES}={n})")
        return Launch("env", env[ENV_COORDINATOR], n, i, local)
    if int(env.get("SLURM_NTASKS", "1")) > 1 and env.get("SLURM_PROCID") is not None:
        return Launch("slurm", None, int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]), local)
    return Launch("single", local_devices=local)


def initialize(launch: Launch | None = None, *, timeout_s: int = 300) -> Launch:
    """Joins the processes of a multi-process launch (no-op for a single process). Before any JAX use."""
    import jax

    launch = detect() if launch is None else launch
    cpu = os.environ.get("JAX_PLATFORMS", "") == "cpu"
    if cpu and launch.local_devices is not None:
        jax.config.update("jax_num_cpu_devices", launch.local_devices)
    if not launch.multi:
        return launch
    if os.environ.get(ENV_TRANSFER):
        jax.config.update("jax_cross_host_transfer_socket_address", os.environ[ENV_TRANSFER])
    if cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if launch.source == "slurm":
        jax.distributed.initialize(initialization_timeout=timeout_s)  # JAX's SLURM cluster detection
    else:
        jax.distributed.initialize(coordinator_address=launch.coordinator, num_processes=launch.num_processes,
                                   process_id=launch.process_id, initialization_timeout=timeout_s)
    return launch


def is_primary() -> bool:
    """True on the process that writes logs and reports (process 0)."""
    import jax

    return jax.process_index() == 0


def share_from(owner: int, arrays: list | None) -> list:
    """Numpy arrays that process ``owner`` holds (``arrays``; None elsewhere), on every process: a header
    with their shapes and dtypes, then the arrays, each broadcast from ``owner``. Every process calls it."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    me = jax.process_index() == owner
    header = np.zeros(8192, np.uint8)
    if me:
        arrays = [np.asarray(a) for a in arrays]
        text = json.dumps([[list(a.shape), a.dtype.str] for a in arrays]).encode()
        assert len(text) <= header.size, "share_from: too many arrays for one header"
        header[: len(text)] = np.frombuffer(text, np.uint8)
    header = np.asarray(multihost_utils.broadcast_one_to_all(header, is_source=me))
    specs = json.loads(bytes(header[header > 0]).decode())
    like = arrays if me else [np.zeros(s, np.dtype(d)) for s, d in specs]
    return [np.asarray(x) for x in multihost_utils.broadcast_one_to_all(like, is_source=me)]


def agree(value: Any) -> Any:
    """Process 0's ``value`` (anything JSON can carry) on every process; ``value`` itself with one process.
    Decisions that read clocks (the controller's measured step times) go through this, so every process
    takes the same decision."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return value
    mine = [np.frombuffer(json.dumps(value).encode(), np.uint8)] if jax.process_index() == 0 else None
    return json.loads(bytes(share_from(0, mine)[0]).decode())


def all_processes(flag: bool) -> bool:
    """True when ``flag`` is true on every process (a collective: every process calls it)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.asarray(multihost_utils.process_allgather(np.int32(bool(flag)))).all())
