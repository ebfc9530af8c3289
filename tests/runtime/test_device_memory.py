"""Counting a device's live bytes while another thread deletes arrays (async generation, a move) must not raise;
releasing the host allocator's freed pages before a CPU program shrinks the process's resident memory."""

from __future__ import annotations

import gc
import os

import jax
import jax.numpy as jnp
import pytest

from nereus_jax.runtime.platform import device_memory


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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm") or device_memory._malloc_trim() is None,
                    reason="reads Linux's /proc and needs glibc's malloc_trim")
def test_releasing_host_memory_returns_freed_heap_pages_on_cpu():
    """Blocks under glibc's mmap threshold (64 KiB here), freed below one still in use, stay in the process's
    resident memory until trimmed: the reference is the RSS with them freed but kept."""
    blocks = [bytearray(b"x" * 65536) for _ in range(3000)]  # ~190 MiB from the heap, every page touched
    pin = bytearray(b"y" * 65536)  # above them: free() alone cannot shrink the heap's top
    del blocks
    gc.collect()
    kept = _rss_bytes()
    device_memory.release_host_memory([jax.devices("cpu")[0]])
    assert kept - _rss_bytes() > 100 * 2**20, (kept, _rss_bytes())
    del pin


def test_releasing_host_memory_skips_accelerators(monkeypatch):
    """Device memory is not the host's on GPU/TPU: nothing is trimmed (a trim costs up to ~0.1 s)."""
    calls = []
    monkeypatch.setattr(device_memory, "_malloc_trim", lambda: calls.append)

    class Gpu:
        platform = "gpu"

    device_memory.release_host_memory([Gpu()])
    device_memory.release_host_memory([])
    device_memory.release_host_memory(jax.devices("cpu")[:1])
    assert calls == [0]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_peak_rss_is_the_kernels_high_water_mark():
    """Reference: VmHWM of /proc/self/status, read just before and after (the peak can only grow)."""
    def hwm() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    before = hwm()
    peak = device_memory.peak_rss_bytes()
    assert before <= peak <= hwm()
