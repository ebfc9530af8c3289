"""What the job's devices hold: live bytes per device, and the peak a compiled program reaches on them.

On GPU and TPU the allocator counts bytes in use; a CPU device keeps no count, so the live arrays' shards are
summed. Neither sees a program's temporaries while it runs: XLA's buffer assignment does
(``Compiled.memory_analysis()``), so a program's peak on a device is what the device held when it started
plus its temporaries and the outputs that do not reuse a donated input (:func:`program_extra_bytes`).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Sequence

import jax

from nereus_jax.sharding import is_local


def device_bytes_in_use(devices: Sequence[jax.Device]) -> dict[int, int]:
    """Bytes each of ``devices`` holds now (parameters, optimizer state, the engines' KV caches, anything
    alive): the allocator's count where the backend keeps one (GPU, TPU), else the live arrays' shards on it
    (CPU). Shards that share a buffer count once."""
    stats = {d.id: (d.memory_stats() or {}).get("bytes_in_use") for d in devices if is_local(d)}
    if all(v is not None for v in stats.values()):
        return stats
    held, seen = dict.fromkeys(stats, 0), set()
    for array in jax.live_arrays():
        try:  # another thread (async generation, a move) may delete an array while we look: jax then raises
            # RuntimeError ("deleted") or, when the deletion lands mid-read, TypeError on its cleared buffer list
            shards = [(s.device.id, s.data.unsafe_buffer_pointer(), s.data.nbytes) for s in array.addressable_shards]
        except (RuntimeError, TypeError):
            continue
        for device, pointer, nbytes in shards:
            if device in held and (device, pointer) not in seen:
                seen.add((device, pointer))
                held[device] += nbytes
    return held


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library). The process's own symbols: ctypes.util.find_library
    would run ldconfig in a child process, a fork of a process holding gigabytes."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_host_memory(devices: Sequence[jax.Device]) -> None:
    """Before a program with a large working set runs on CPU devices (whose memory is the host's): hands the
    pages the C allocator keeps from freed buffers (earlier programs' temporaries) back to the system, so the
    process's peak resident memory is what is live plus this program's working set. glibc keeps freed blocks
    under its mmap threshold (which grows to 32 MiB) for reuse; a job of many programs otherwise holds
    hundreds of MB it does not use (docs/results.md, issue 32's RSS). No-op on GPU/TPU devices and without glibc;
    one call takes up to ~0.1 s with a large heap."""
    trim = _malloc_trim()
    if trim is not None and devices and all(d.platform == "cpu" for d in devices):
        trim(0)


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (the kernel's high-water mark), or None where the platform
    keeps none (Windows). On CPU devices it covers their arrays and programs' temporaries too."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def program_extra_bytes(compiled) -> int:
    """Bytes per device a compiled program needs beyond its inputs: temporaries plus outputs that do not alias
    a donated input (0 when the backend gives no analysis)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return 0
    return int(analysis.temp_size_in_bytes + max(0, analysis.output_size_in_bytes - analysis.alias_size_in_bytes))
