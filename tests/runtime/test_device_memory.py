"""Counting a device's live bytes while another thread deletes arrays (async generation, a move) must not raise."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nereus_jax.runtime import device_memory


class _Deleted:
    """An array deleted between ``jax.live_arrays()`` and the read of its shards: jax raises one of these."""

    def __init__(self, error):
        self.error = error

    @property
    def addressable_shards(self):
        raise self.error


def test_arrays_deleted_mid_count_are_skipped_and_the_rest_counted(monkeypatch):
    device = jax.devices()[0]
    kept = jax.device_put(jnp.ones((1000,), jnp.float32), device)
    real = jax.live_arrays
    assert device.memory_stats() is None  # the CPU path, which sums live shards
    base = device_memory.device_bytes_in_use([device])[device.id]
    monkeypatch.setattr(jax, "live_arrays", lambda: [_Deleted(RuntimeError("Array has been deleted")),
                                                     _Deleted(TypeError("'NoneType' object is not iterable")),
                                                     *real()])
    assert device_memory.device_bytes_in_use([device])[device.id] == base
    assert base >= kept.nbytes
