"""The ledger's account against what the devices really hold: the bytes per ledger key that arrays occupy,
the keys this process owns, and the devices' own memory statistics (GPU, TPU). The transition executor checks
its :class:`~nereus_jax.elastic.ledger.Ledger` with these; the ledger itself stays free of JAX.

    measure(arrays)                  # {key: bytes}, each buffer counted once
    cross_check(ledger, devices)     # {device id: (ledger bytes, bytes_in_use)}; {} on CPU
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import jax
import numpy as np

from nereus_jax.sharding import device_index, is_local

from .ledger import Ledger, key
from .plan import DEVICE


def measure(arrays: Iterable[jax.Array]) -> dict[int, int]:
    """Bytes per key actually held by ``arrays`` (each buffer counted once, however many arrays share it).
    With several processes: this process's devices only (see :func:`local_usage`)."""
    seen: set[tuple[int, int]] = set()
    out: dict[int, int] = {}
    for x in arrays:
        memory = x.sharding.memory_kind or DEVICE
        for shard in x.addressable_shards:
            buf = shard.data
            d = device_index(shard.device)
            try:
                ident = (d, buf.unsafe_buffer_pointer())
            except Exception:  # memory kinds without raw pointers: count per array
                ident = (d, id(buf))
            if ident in seen:
                continue
            seen.add(ident)
            k = key(d, memory)
            out[k] = out.get(k, 0) + math.prod(buf.shape) * np.dtype(buf.dtype).itemsize
    return out


def local_usage(usage: Mapping[int, int]) -> dict[int, int]:
    """The entries of ``usage`` that are this process's devices (or their pinned host memory)."""
    devices = jax.devices()
    return {k: n for k, n in usage.items() if is_local(devices[k if k >= 0 else ~k])}


def cross_check(ledger: Ledger, devices: Iterable[jax.Device]) -> dict[int, tuple[int, int]]:
    """device id -> (ledger bytes, bytes_in_use from memory_stats) where the device reports stats
    (GPU, TPU); CPU devices report none and are skipped. The difference is what the ledger does not
    account for (compiled workspaces, caches, arrays outside the transition)."""
    out = {}
    for d in devices:
        if not is_local(d):  # another process's device: its process checks it
            continue
        stats = d.memory_stats()
        if stats and "bytes_in_use" in stats:
            i = device_index(d)
            out[i] = (ledger.used.get(i, 0), int(stats["bytes_in_use"]))
    return out
